"""Tokenizers as Hugging Face tokenizer directories that ``AutoTokenizer.from_pretrained`` loads.

Two kinds:

* the exact **Qwen2.5 / Dream-7B** tokenizer, rebuilt from the ``qwen.tiktoken`` rank file that
  registry packages ship (see docs/data.md §2): byte-level BPE whose ids are the tiktoken
  ranks, merges recovered from the ranks, Qwen2's pre-tokenizer regex, an NFC normalizer, the 22
  Qwen2.5 added tokens from 151643, then Dream's ``<|beginoftext|>`` = 151665 and ``<|mask|>`` = 151666;
* the **GPT-2** tokenizer, rebuilt the same way from its rank file.

Small SentencePiece tokenizers trained on a local corpus for from-scratch runs are in
data/spm_tokenizer.py.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

# Qwen2's pre-tokenizer split (single digits, contractions, letters with one leading non-letter, ...).
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Qwen2.5 added tokens 151643..151664 in id order, with their `special` flag (the tool/FIM/repo
# markers are ordinary added tokens in Qwen2.5's tokenizer.json), then Dream's two additions.
QWEN25_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
DREAM_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (("<|beginoftext|>", True), ("<|mask|>", True))
QWEN25_FIRST_ADDED_ID = 151643

# Qwen2.5 ChatML with Dream's default system prompt (docs/models.md §5 Dream); honours add_generation_prompt.
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a tiktoken rank file (one ``base64(token) rank`` per line) into ``{token bytes: rank}``."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected 'base64 rank', got {line[:80]!r}")
            ranks[base64.b64decode(parts[0])] = int(parts[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not a permutation of 0..{len(ranks) - 1}")
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character map used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _recover_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair whose merge creates ``token``: run BPE on its bytes using only lower-ranked tokens.

    tiktoken applies merges by ascending rank of the merged token, so the last step of encoding
    ``token`` with every rank below its own leaves exactly two parts; that pair is its merge rule.
    """
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best_rank is None or r < best_rank):
                best_rank, best_i = r, i
        if best_rank is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {limit}) is not reachable by merges of lower ranks")
    return parts[0], parts[1]


def tiktoken_to_tokenizer(
    ranks: dict[bytes, int],
    pattern: str,
    added_tokens: Sequence[tuple[str, bool]],
    *,
    nfc: bool,
) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` equivalent to a tiktoken encoding.

    Ids are the tiktoken ranks; merges are ordered by the rank of the token they create (so the HF
    merge priority equals tiktoken's rank priority); added tokens take the ids after the last rank.
    """
    to_char = _bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(to_char[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, _rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            left, right = _recover_merge(tok, ranks)
            merges.append((to_str(left), to_str(right)))
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    first_id = len(ranks)
    for offset, (content, special) in enumerate(added_tokens):
        added = AddedToken(
            content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special
        )
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
        got = tok.token_to_id(content)
        if got != first_id + offset:
            raise ValueError(f"added token {content!r} got id {got}, expected {first_id + offset}")
    return tok


def _added_tokens_decoder(first_id: int, added: Sequence[tuple[str, bool]]) -> dict[str, dict]:
    return {
        str(first_id + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(added)
    }


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _save_tokenizer_json(tok: Tokenizer, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tok.save(str(tmp), pretty=True)
    os.replace(tmp, path)


def build_qwen25_tokenizer(tiktoken_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write Dream-7B's Qwen2.5 tokenizer (tokenizer.json + tokenizer_config.json) into ``out_dir``.

    eos = pad = ``<|endoftext|>`` (151643) as in Dream's tokenizer, mask = ``<|mask|>`` (151666),
    bos = ``<|beginoftext|>`` (151665, never added automatically), ChatML template with Dream's
    default system prompt.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = read_tiktoken_ranks(tiktoken_file)
    if len(ranks) != QWEN25_FIRST_ADDED_ID:
        raise ValueError(f"{tiktoken_file}: {len(ranks)} ranks, Qwen2.5 has {QWEN25_FIRST_ADDED_ID}")
    added = QWEN25_ADDED_TOKENS + DREAM_ADDED_TOKENS
    tok = tiktoken_to_tokenizer(ranks, QWEN2_PATTERN, added, nfc=True)
    _save_tokenizer_json(tok, out / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens_decoder(QWEN25_FIRST_ADDED_ID, added),
        "bos_token": "<|beginoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "mask_token": "<|mask|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 131072,
        "padding_side": "right",
        "split_special_tokens": False,
        "chat_template": QWEN25_CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", config)
    return out


def build_gpt2_tokenizer(tiktoken_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write GPT-2's tokenizer (50257 ids, ``<|endoftext|>`` = 50256 as bos/eos/unk) into ``out_dir``.

    From a ``gpt2.tiktoken`` rank file: GPT-2's regex, no normalizer. GPT-2 has no pad or mask
    token; a diffusion run adds its own.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = read_tiktoken_ranks(tiktoken_file)
    if len(ranks) != 50256:
        raise ValueError(f"{tiktoken_file}: {len(ranks)} ranks, GPT-2 has 50256")
    tok = tiktoken_to_tokenizer(ranks, GPT2_PATTERN, (("<|endoftext|>", True),), nfc=False)
    _save_tokenizer_json(tok, out / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens_decoder(50256, (("<|endoftext|>", True),)),
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
    }
    _write_json(out / "tokenizer_config.json", config)
    return out
