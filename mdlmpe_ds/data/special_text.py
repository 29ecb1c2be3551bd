"""Chat content that spells a special token ("<|mask|>", "<|im_end|>", "<|endoftext|>") is
encoded as the text it is, not as the token.

Why: a chat template puts message content into one string, and the tokenizer reads every special
token's spelling in that string as the token itself. A user turn quoting "<|mask|>" then gives the
model a mask id in its prompt and, in a response, a mask id as a target; a quoted "<|im_end|>"
ends the turn in the middle. Datasets about code and tokenizers hold such text. The official
LLaDA / Dream recipes tokenise the rendered string whole, so they inject these tokens too; a row
without such text is encoded exactly as before (``build_sft_dataset`` takes this path only for
rows that need it, and counts them).

How: each occurrence in a message's content is replaced by a sentinel (``mark``) before the
template renders, so the template's own special tokens and its stripping of content are as
before; ``encode`` then tokenises the rendered text piece by piece: the text between sentinels
as usual, each marked spelling with ``split_special_tokens`` (its characters as ordinary tokens).
A piece boundary may tokenise differently from the same characters inside one piece.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from mdlmpe_ds.data.chat_templates import Message

#: Sentinel around the index of a marked spelling: supplementary private-use characters, which no
#: tokenizer here gives a meaning and real text does not use.
OPEN, CLOSE = "\U000f0000", "\U000f0001"
_MARK = re.compile(f"{OPEN}(\\d+){CLOSE}")


def special_spellings(tokenizer: Any) -> tuple[str, ...]:
    """The spellings of ``tokenizer``'s special tokens, longest first (so that a spelling holding
    another is matched whole)."""
    spellings = set(getattr(tokenizer, "all_special_tokens", ()))
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            spellings.add(str(token.content))
    return tuple(sorted((s for s in spellings if s), key=len, reverse=True))


def mark(messages: Sequence[Message], spellings: Sequence[str]) -> tuple[list[Message], list[str]]:
    """``messages`` with every special spelling in a content replaced by a sentinel, and the
    spellings in sentinel order (empty: nothing to mark, the messages unchanged)."""
    if not spellings:
        return list(messages), []
    pattern = re.compile("|".join(re.escape(s) for s in spellings))
    found: list[str] = []

    def sentinel(match: re.Match) -> str:
        found.append(match.group(0))
        return f"{OPEN}{len(found) - 1}{CLOSE}"

    marked = [{**m, "content": pattern.sub(sentinel, m["content"])} for m in messages]
    return marked, found


def encode(tokenizer: Any, text: str, found: Sequence[str]) -> list[int]:
    """Token ids of rendered ``text`` whose sentinels stand for ``found``: the pieces between them
    tokenised as usual, each marked spelling as plain text."""
    ids: list[int] = []
    start = 0
    for match in _MARK.finditer(text):
        if match.start() > start:
            ids += tokenizer(text[start : match.start()], add_special_tokens=False)["input_ids"]
        spelled = found[int(match.group(1))]
        ids += tokenizer(spelled, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        start = match.end()
    if start < len(text):
        ids += tokenizer(text[start:], add_special_tokens=False)["input_ids"]
    return ids
