"""Chat templates for SFT: LLaDA's Llama-3 style, Dream's ChatML, or the tokenizer's own.

Why our own renderers instead of ``tokenizer.apply_chat_template``: LLaDA-8B-Instruct's shipped
template always appends an assistant header and ignores ``add_generation_prompt`` (docs/models.md §5),
so rendering a full conversation for SFT gives a dangling header. Both renderers below honour
``add_generation_prompt`` and have the prefix property the SFT split relies on:
``render(messages[:k], add_generation_prompt=True)`` is a prefix of ``render(messages)`` when
``messages[k]`` is an assistant turn.

``template_for(family, tokenizer)`` picks the family's renderer when the tokenizer carries that
family's special tokens, else the tokenizer's own chat template (e.g. the embedded demo: a tiny
LLaDA-family model with the real Qwen2.5 tokenizer, which has no LLaDA header tokens, so its own
ChatML template is used). The choice is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

Message = dict[str, str]  # {"role": "system"|"user"|"assistant", "content": str}

FAMILIES = ("llada", "dream")

# LLaDA-8B-Instruct special tokens (docs/models.md §5).
LLADA_BOS = "<|startoftext|>"
LLADA_HEADER_START = "<|start_header_id|>"
LLADA_HEADER_END = "<|end_header_id|>"
LLADA_EOT = "<|eot_id|>"
LLADA_TOKENS = (LLADA_BOS, LLADA_HEADER_START, LLADA_HEADER_END, LLADA_EOT)

# Dream / Qwen2.5 ChatML special tokens (docs/models.md §5).
CHATML_START = "<|im_start|>"
CHATML_END = "<|im_end|>"
CHATML_TOKENS = (CHATML_START, CHATML_END)
DREAM_DEFAULT_SYSTEM = "You are a helpful assistant."


def render_llada(messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """LLaDA-8B-Instruct's template, honouring ``add_generation_prompt`` (unlike upstream).

    ``<|startoftext|>`` once, then per message
    ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content.strip()}<|eot_id|>``, then, if asked,
    ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``.
    """
    parts = [LLADA_BOS]
    for m in messages:
        parts.append(
            f"{LLADA_HEADER_START}{m['role']}{LLADA_HEADER_END}\n\n{m['content'].strip()}{LLADA_EOT}"
        )
    if add_generation_prompt:
        parts.append(f"{LLADA_HEADER_START}assistant{LLADA_HEADER_END}\n\n")
    return "".join(parts)


def render_chatml(messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """Dream-v0-Instruct's (Qwen2.5) ChatML, default system prompt when the first turn is not one.

    ``<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n`` then per message
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then, if asked, ``<|im_start|>assistant\\n``.
    Content is not stripped (as in Qwen2.5's template).
    """
    parts = []
    if not messages or messages[0]["role"] != "system":
        parts.append(f"{CHATML_START}system\n{DREAM_DEFAULT_SYSTEM}{CHATML_END}\n")
    for m in messages:
        parts.append(f"{CHATML_START}{m['role']}\n{m['content']}{CHATML_END}\n")
    if add_generation_prompt:
        parts.append(f"{CHATML_START}assistant\n")
    return "".join(parts)


@dataclass(frozen=True)
class ChatTemplate:
    """A named renderer ``messages -> str`` (special tokens as text; tokenise without adding any).

    ``name`` is one of ``"llada"``, ``"chatml"``, ``"tokenizer"`` and is what gets logged.
    """

    name: str
    render_fn: Callable[[Sequence[Message], bool], str]

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        return self.render_fn(messages, add_generation_prompt)


LLADA_TEMPLATE = ChatTemplate("llada", render_llada)
CHATML_TEMPLATE = ChatTemplate("chatml", render_chatml)


def _has_tokens(tokenizer: Any, tokens: Sequence[str]) -> bool:
    """True when every string is a single (added or regular) token of ``tokenizer``."""
    vocab = tokenizer.get_vocab()
    return all(tok in vocab for tok in tokens)


def _tokenizer_template(tokenizer: Any) -> ChatTemplate:
    def render(messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    return ChatTemplate("tokenizer", render)


def template_for(family: str, tokenizer: Any) -> ChatTemplate:
    """The chat template for SFT on a ``family`` ("llada" | "dream") model with ``tokenizer``.

    1. The family's own renderer if the tokenizer has its special tokens
       (LLaDA: ``<|startoftext|>``, ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>``;
       Dream: ``<|im_start|>``, ``<|im_end|>``).
    2. Else the tokenizer's own ``chat_template`` (rendered through ``apply_chat_template``).
    3. Else ``ValueError`` naming what is missing.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r} for a chat template; expected one of {FAMILIES}")
    own, needed = (LLADA_TEMPLATE, LLADA_TOKENS) if family == "llada" else (CHATML_TEMPLATE, CHATML_TOKENS)
    if _has_tokens(tokenizer, needed):
        logger.info("chat template: %s (family %s; tokenizer has %s)", own.name, family, ", ".join(needed))
        return own
    if getattr(tokenizer, "chat_template", None):
        logger.info(
            "chat template: the tokenizer's own (family %s, but the tokenizer lacks %s)",
            family,
            ", ".join(t for t in needed if t not in tokenizer.get_vocab()),
        )
        return _tokenizer_template(tokenizer)
    raise ValueError(
        f"no chat template for family {family!r}: the tokenizer "
        f"({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!s}) lacks the family's special "
        f"tokens {needed} and has no chat_template of its own"
    )
