"""SFT chat data: load, validate, render with the family's chat template, tokenise, truncate, collate.

Conventions (docs/models.md §3.2, §3.5, §5; docs/data.md §3):
- Rows are ``{"messages": [{"role", "content"}, ...]}`` (Tulu-3, SmolTalk) or
  ``{"prompt": str, "response": str}`` (optional ``"system"``). Extra keys are ignored.
- One example = (prompt, response). The prompt is ``template(messages[:k], add_generation_prompt=True)``
  and the response is assistant turn k. ``multiturn="last"`` gives one example per dialogue, the
  last assistant turn with every earlier turn as prompt (LLaDA's multi-turn rule: the pair includes
  the earlier turns as prompt); ``"expand"`` gives one example per assistant turn; ``"sample"``
  gives one example per dialogue at an assistant turn drawn uniformly (LLaDA Appendix B.1: n
  single-turn pairs, one sampled), fixed by (``seed``, row index) so every rank agrees.
- The response ends with the family's end-of-response rule ``response_end``:
  ``"turn"`` (LLaDA default): the template's own end of turn, e.g. ``answer<|eot_id|>`` for LLaDA's
  template (what LLaDA-8B-Instruct emits before its EOS padding), ``answer<|im_end|>\\n`` for ChatML;
  ``"eos"`` (Dream default, as Dream-train's ``sft_dataset.py``): ``answer + eos_token``.
- Prompt and response are tokenised separately without added special tokens (template text carries
  them), so ``input_ids = prompt_ids + response_ids`` and ``prompt_len = len(prompt_ids)``.
- Too long: the response is truncated to ``max_len`` (``overlong="truncate"``) or the example dropped
  (``overlong="drop"``); an example whose prompt alone leaves no room for one response token is
  dropped. Both are counted in ``SFTDataStats`` and logged.
- Padding (``SFTCollator``): right-padding with EOS, which LLaDA and official Dream SFT attend to and
  train on: the pads are part of the answer, maskable and in the loss (docs/models.md §3.2, §3.5).
  Optionally Dream-train's per-batch cutoff: prompts left-padded to the batch's longest (those
  pads are never attended nor trained) and every response cut to one length drawn from the batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import zipfile
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from mdlmpe_ds import stop_request
from mdlmpe_ds.data.chat_templates import ChatTemplate, Message, template_for
from mdlmpe_ds.data.fingerprint import file_sha256
from mdlmpe_ds.seeding import mix_seed

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
DEFAULT_RESPONSE_END = {"llada": "turn", "dream": "eos"}
_TOKENIZE_CHUNK = 1024
_LOGGED_BAD_LINES = 20  # skipped undecodable lines named in the log; the rest are only counted


class SFTDataError(ValueError):
    """A malformed SFT row; the message names the source and the 0-based row index."""


class _Malformed(Exception):
    """Internal: the reason a row is malformed, before the source/row prefix is known."""


@dataclass(frozen=True)
class SFTExample:
    """One tokenised (prompt, response) pair. ``input_ids[:prompt_len]`` is the prompt."""

    input_ids: list[int]
    prompt_len: int


@dataclass
class SFTDataStats:
    """Counts from ``build_sft_dataset``; ``skip_reasons`` maps a reason to its count."""

    rows: int = 0  # rows read from the source
    skipped: int = 0  # malformed rows skipped (skip_malformed=True)
    examples: int = 0  # examples kept
    truncated: int = 0  # kept with a truncated response
    dropped: int = 0  # dropped: prompt alone does not fit, or overlong with overlong="drop"
    skip_reasons: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"{self.rows} rows -> {self.examples} examples "
            f"({self.truncated} truncated, {self.dropped} dropped as too long, "
            f"{self.skipped} malformed skipped)"
        )


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def _local_format(source: str) -> str | None:
    """'json' / 'parquet' for a local file source, None for a hub name. Missing file -> error."""
    path = Path(source)
    fmt = LOCAL_FORMATS.get(path.suffix.lower())
    if fmt is None:
        if path.is_file():
            raise ValueError(
                f"{source}: unsupported SFT file type {path.suffix!r}; use .json, .jsonl or .parquet"
            )
        return None
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file not found: {source}")
    return fmt


def load_sft_rows(source: str | Path, split: str = "train") -> Any:
    """The raw rows of ``source`` as a ``datasets.Dataset``.

    ``source`` is a local ``.json``/``.jsonl``/``.parquet`` file (``FileNotFoundError`` naming the path
    if it is missing), a local dataset directory, or a hub dataset name (e.g.
    ``allenai/tulu-3-sft-mixture``, ``HuggingFaceTB/smoltalk``; needs network or a populated cache).
    """
    import datasets  # imported here: loading it is slow and only data preparation needs it

    source = str(source)
    fmt = _local_format(source)
    if fmt is not None:
        return datasets.load_dataset(fmt, data_files={split: source}, split=split)
    from mdlmpe_ds.hub.resolve import split_dataset_name

    name, config = split_dataset_name(source)  # "HuggingFaceTB/smoltalk:all" names config "all"
    return datasets.load_dataset(name, config, split=split)


class _BadLine(NamedTuple):
    """Internal: a unit of a local JSON file that cannot become a row (bytes that are not UTF-8, text
    that is not JSON). ``build_sft_dataset`` fails on it naming the file, row and line, or, with
    ``skip_malformed``, skips and counts it under ``kind`` like any malformed row."""

    line: int | None  # 1-based line of the file (None: a row of a JSON array, whose line is unknown)
    kind: str  # the skip reason counted in SFTDataStats.skip_reasons
    detail: str  # the rest of the error message, e.g. "is not valid JSON (Expecting value: ...)"


_UTF8_BOM = b"\xef\xbb\xbf"


def _json_rows(path: str) -> Iterator[Any]:
    """Rows of a local .json / .jsonl file, parsed here rather than by ``datasets``.

    ``datasets`` (pyarrow) fails a whole file on one line that is not JSON, names no line for bytes
    that are not UTF-8 (and may only fail later, while rows are iterated), and cannot skip either.
    Parsing here names the line, lets ``skip_malformed`` skip exactly that line, streams (memory
    does not grow with the file) and writes no Arrow copy of the file to the datasets cache.

    - JSON Lines (.jsonl, or a .json whose first character is not '['): each non-blank line is
      one row; a line that is not UTF-8 or not JSON is yielded as a ``_BadLine``. Lines are split
      on b"\\n" only (JSON strings may hold U+2028 and friends, which ``str.splitlines`` splits on).
    - A JSON array: one document, parsed whole. If it is not valid JSON it cannot be cut into rows,
      so that is an error even with ``skip_malformed``. Bytes that are not UTF-8 are decoded with
      ``surrogateescape`` so the rest parses, and each row holding such bytes is a ``_BadLine``.
    """
    with open(path, "rb") as f:
        lines = enumerate(f, start=1)
        offset = 0  # byte offset of the current line in the file
        for line_no, raw in lines:  # up to the first non-blank line, which tells the layout
            if line_no == 1 and raw.startswith(_UTF8_BOM):
                offset, raw = len(_UTF8_BOM), raw[len(_UTF8_BOM) :]
            if raw.strip():
                break
            offset += len(raw)
        else:
            return  # only blank lines: no rows
        if raw.lstrip().startswith(b"["):
            yield from _json_array_rows(path, raw + f.read(), line_no, offset)
            return
        yield _json_line(raw, line_no, offset)
        offset += len(raw)
        for line_no, raw in lines:
            if raw.strip():
                yield _json_line(raw, line_no, offset)
            offset += len(raw)


def _json_line(raw: bytes, line_no: int, offset: int) -> Any:
    """One JSON Lines row from the bytes of line ``line_no`` (starting at byte ``offset``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"byte 0x{raw[e.start]:02x} at byte offset {offset + e.start} of the file"
        return _BadLine(line_no, "not valid UTF-8", f"is not valid UTF-8 ({where})")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return _BadLine(line_no, "not valid JSON", f"is not valid JSON (column {e.pos + 1}: {e.msg})")


def _json_array_rows(path: str, data: bytes, first_line: int, offset: int) -> Iterator[Any]:
    """The rows of a JSON array (``data``: the file's bytes from line ``first_line``, byte ``offset``)."""
    bad_utf8 = None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        bad_utf8 = f"byte 0x{data[e.start]:02x} at line {line}, byte offset {offset + e.start} of the file"
        text = data.decode("utf-8", errors="surrogateescape")  # invalid bytes -> lone surrogates
        # (rows holding one are found after parsing: their JSON text is not valid Unicode)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        note = f"; it also holds bytes that are not UTF-8 (first: {bad_utf8})" if bad_utf8 else ""
        raise SFTDataError(
            f"{path}: not valid JSON (line {first_line + e.lineno - 1}, column {e.colno}: {e.msg}){note}"
        ) from None
    if not isinstance(rows, list):
        raise SFTDataError(f"{path}: a JSON file starting with '[' must be an array of rows")
    for row in rows:
        if bad_utf8 is not None and _not_unicode(json.dumps(row, ensure_ascii=False)):
            detail = f"holds bytes that are not valid UTF-8 (the file's first: {bad_utf8})"
            yield _BadLine(None, "not valid UTF-8", detail)
        else:
            yield row


def _iter_rows(source: str | Path, split: str) -> Iterator[Any]:
    """Rows of ``source``: local JSON files through ``_json_rows``, the rest through ``datasets``.

    A local file of 0 bytes is an error naming it (``datasets`` gives "generator raised
    StopIteration" for it)."""
    source = str(source)
    fmt = _local_format(source)
    if fmt is not None and os.path.getsize(source) == 0:
        raise SFTDataError(f"{source}: the file is empty (0 bytes)")
    if fmt == "json":
        yield from _json_rows(source)
        return
    if fmt == "parquet":
        _check_parquet(source)
    yield from load_sft_rows(source, split)


def _check_parquet(path: str) -> None:
    """Read a local parquet file's footer before ``datasets`` does: it reports a truncated file
    without naming it, and fails on a file with no rows ("BatchSize must be greater than 0")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError) as e:
        raise SFTDataError(f"{path}: not a readable parquet file, truncated or corrupt? ({e})") from e
    if rows == 0:
        raise SFTDataError(f"{path}: no rows (the parquet file holds none)")


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _type_name(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def _not_unicode(text: str) -> bool:
    """True for a string holding a lone surrogate: JSON allows escapes such as "\\ud800", but no
    tokenizer takes them (a TypeError naming no row)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_LONE_SURROGATE = "is not valid Unicode (a lone surrogate such as \\ud800)"


def row_messages(row: Any) -> list[Message]:
    """The validated ``messages`` of one row (``prompt``/``response`` rows are converted).

    Raises ``_Malformed`` with the reason: missing keys, unknown roles, non-string content, an empty
    assistant turn, a dialogue that does not end with an assistant turn.
    """
    if not isinstance(row, dict):
        raise _Malformed(f"row is {_type_name(row)}, expected an object")
    if row.get("messages") is not None:
        raw = row["messages"]
        if not isinstance(raw, list):
            raise _Malformed(f"'messages' is {_type_name(raw)}, expected a list")
        if not raw:
            raise _Malformed("'messages' is empty")
        messages = []
        for k, m in enumerate(raw):
            if not isinstance(m, dict):
                raise _Malformed(f"message {k} is {_type_name(m)}, expected an object with role and content")
            role, content = m.get("role"), m.get("content")
            if role is None:
                raise _Malformed(f"message {k} has no 'role'")
            if not isinstance(role, str) or role not in ROLES:
                expected = ", ".join(ROLES)
                raise _Malformed(f"message {k} has unknown role {role!r} (expected one of {expected})")
            if content is None:
                raise _Malformed(f"message {k} ({role}) has no 'content'")
            if not isinstance(content, str):
                raise _Malformed(f"message {k} ({role}) content is {_type_name(content)}, expected a string")
            if _not_unicode(content):
                raise _Malformed(f"message {k} ({role}) content {_LONE_SURROGATE}")
            if role == "assistant" and not content.strip():
                raise _Malformed(f"message {k} (assistant) is empty")
            messages.append({"role": role, "content": content})
        if messages[-1]["role"] != "assistant":
            last = messages[-1]["role"]
            raise _Malformed(f"last message is {last!r}, expected an assistant turn to train on")
        return messages
    if row.get("prompt") is not None or row.get("response") is not None:
        prompt, response, system = row.get("prompt"), row.get("response"), row.get("system")
        for key, value in (("prompt", prompt), ("response", response)):
            if not isinstance(value, str):
                raise _Malformed(f"'{key}' is {_type_name(value)}, expected a string")
        if not response.strip():
            raise _Malformed("'response' is empty")
        if system is not None and not isinstance(system, str):
            raise _Malformed(f"'system' is {_type_name(system)}, expected a string")
        for key, value in (("prompt", prompt), ("response", response), ("system", system or "")):
            if _not_unicode(value):
                raise _Malformed(f"'{key}' {_LONE_SURROGATE}")
        messages = [{"role": "system", "content": system}] if system else []
        return [*messages, {"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    raise _Malformed(f"row has neither 'messages' nor 'prompt'/'response' (keys: {sorted(row)})")


MULTITURN = ("last", "expand", "sample")


def conversation_pairs(
    messages: Sequence[Message], multiturn: Literal["last", "expand", "sample"] = "last", draw: int = 0
) -> list[tuple[list[Message], Message]]:
    """(earlier turns, assistant turn) pairs to train on: the last one, one per assistant turn, or
    the one at assistant turn ``draw % (number of assistant turns)`` for ``"sample"``."""
    if multiturn == "last":
        return [(list(messages[:-1]), messages[-1])]
    pairs = [(list(messages[:k]), m) for k, m in enumerate(messages) if m["role"] == "assistant"]
    if multiturn == "expand":
        return pairs
    if multiturn == "sample":
        return [pairs[draw % len(pairs)]]
    raise ValueError(f"multiturn must be one of {MULTITURN}, got {multiturn!r}")


# ----------------------------------------------------------------------------------------------
# Dataset
# ----------------------------------------------------------------------------------------------


class SFTDataset(torch.utils.data.Dataset):
    """Tokenised SFT examples in one flat int32 token array (4 bytes/token, not Python ints).

    ``lengths`` (np.int64 [N]) feeds ``LengthGroupedSampler``; ``dataset[i]`` is an ``SFTExample``.
    """

    def __init__(self, examples: Iterable[SFTExample] = ()) -> None:
        ids: list[np.ndarray] = []
        prompt_lens: list[int] = []
        for ex in examples:
            ids.append(np.asarray(ex.input_ids, dtype=np.int32))
            prompt_lens.append(ex.prompt_len)
        self._set(ids, prompt_lens)

    def _set(self, ids: list[np.ndarray], prompt_lens: list[int]) -> None:
        self.lengths = np.array([len(x) for x in ids], dtype=np.int64)
        self.offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        self.tokens = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)
        self.prompt_lens = np.array(prompt_lens, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> SFTExample:
        if not -len(self) <= i < len(self):
            raise IndexError(f"SFT example {i} out of range for {len(self)} examples")
        i = i % len(self)
        start, end = self.offsets[i], self.offsets[i + 1]
        return SFTExample(self.tokens[start:end].tolist(), int(self.prompt_lens[i]))


def eos_pad_id(tokenizer: Any) -> int:
    """The EOS id, which is also the padding id for LLaDA and Dream SFT (docs/models.md §3.2, §3.5)."""
    if tokenizer.eos_token_id is None:
        name = getattr(tokenizer, "name_or_path", "")
        raise ValueError(f"tokenizer {name!s} has no eos_token; SFT pads with EOS")
    return int(tokenizer.eos_token_id)


def _render_pair(
    template: ChatTemplate,
    prompt_messages: list[Message],
    response: Message,
    response_end: str,
    eos_token: str,
) -> tuple[str, str]:
    prompt = template.render(prompt_messages, add_generation_prompt=True)
    if response_end == "eos":
        return prompt, response["content"] + eos_token
    full = template.render([*prompt_messages, response], add_generation_prompt=False)
    if not full.startswith(prompt):
        raise _Malformed(
            f"chat template {template.name!r} is not prefix-consistent: the prompt rendered with a "
            "generation prompt is not a prefix of the rendered conversation"
        )
    return prompt, full[len(prompt) :]


def build_sft_dataset(
    source: str | Path,
    tokenizer: Any,
    family: str,
    max_len: int,
    *,
    split: str = "train",
    skip_malformed: bool = False,
    multiturn: Literal["last", "expand", "sample"] = "last",
    response_end: Literal["turn", "eos"] | None = None,
    overlong: Literal["truncate", "drop"] = "truncate",
    max_rows: int | None = None,
    template: ChatTemplate | None = None,
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> tuple[SFTDataset, SFTDataStats]:
    """Load, validate, render and tokenise ``source`` into an ``SFTDataset`` plus its counts.

    A malformed row raises ``SFTDataError`` naming ``source`` and the 0-based row index, unless
    ``skip_malformed`` (then it is counted in ``stats.skipped`` / ``stats.skip_reasons``).
    ``response_end`` defaults per family (``DEFAULT_RESPONSE_END``); ``template`` defaults to
    ``template_for(family, tokenizer)``; ``max_rows`` keeps the first rows only (Dream-train's Tulu
    recipe used the first 10,000); ``seed`` fixes the turn drawn by ``multiturn="sample"``.

    ``cache_dir``: the tokenised result is saved there under a key of everything it depends on (the
    source file's content hash or the hub name, the tokenizer's vocabulary and template, and every
    argument above) and loaded instead of rebuilt when the key matches; a damaged cache file is
    named in a warning and rebuilt. Writes are atomic, so ranks
    may share the folder; to tokenise once, build on rank 0, barrier, then build on the others.
    """
    if family not in DEFAULT_RESPONSE_END:
        raise ValueError(f"unknown model family {family!r}; expected one of {tuple(DEFAULT_RESPONSE_END)}")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    if multiturn not in MULTITURN:
        raise ValueError(f"multiturn must be one of {MULTITURN}, got {multiturn!r}")
    template = template or template_for(family, tokenizer)
    response_end = response_end or DEFAULT_RESPONSE_END[family]
    if response_end not in ("turn", "eos"):
        raise ValueError(f"response_end must be 'turn' or 'eos', got {response_end!r}")
    eos_token = tokenizer.eos_token if response_end == "eos" else ""
    if response_end == "eos" and not eos_token:
        raise ValueError("response_end='eos' needs a tokenizer with an eos_token")

    cache_file = None
    if cache_dir is not None:
        settings = {
            "split": split,
            "family": family,
            "max_len": max_len,
            "skip_malformed": skip_malformed,
            "multiturn": multiturn,
            "response_end": response_end,
            "overlong": overlong,
            "max_rows": max_rows,
            "template": template.name,
            "seed": seed,
        }
        cache_file = Path(cache_dir) / f"sft-{_cache_key(source, tokenizer, settings, split)}.npz"
        if cache_file.is_file():
            try:
                dataset, stats = _load_cache(cache_file)
            except SFTCacheError as err:  # truncated or damaged: tokenised again and replaced
                logger.warning("%s; tokenising %s again", err, source)
            else:
                logger.info("SFT data %s: loaded from cache %s: %s", source, cache_file, stats.summary())
                return dataset, stats

    stats = SFTDataStats()
    reasons: Counter[str] = Counter()
    kept_ids: list[np.ndarray] = []
    kept_prompt_lens: list[int] = []
    pending: list[tuple[str, str]] = []

    def flush() -> None:
        if not pending:
            return
        prompts = tokenizer([p for p, _ in pending], add_special_tokens=False)["input_ids"]
        responses = tokenizer([r for _, r in pending], add_special_tokens=False)["input_ids"]
        for p_ids, r_ids in zip(prompts, responses, strict=True):
            if len(p_ids) >= max_len:
                stats.dropped += 1
                continue
            if len(p_ids) + len(r_ids) > max_len:
                if overlong == "drop":
                    stats.dropped += 1
                    continue
                r_ids = r_ids[: max_len - len(p_ids)]
                stats.truncated += 1
            kept_ids.append(np.asarray(p_ids + r_ids, dtype=np.int32))
            kept_prompt_lens.append(len(p_ids))
        pending.clear()

    for index, row in enumerate(_iter_rows(source, split)):
        if max_rows is not None and index >= max_rows:
            break
        stop_request.poll(f"tokenising {source} (row {index})")  # Ctrl-C / SIGTERM stop here
        stats.rows += 1
        if isinstance(row, _BadLine):
            line = "" if row.line is None else f" (line {row.line})"
            if not skip_malformed:
                raise SFTDataError(f"{source}: row {index}{line} {row.detail}")
            if stats.skipped < _LOGGED_BAD_LINES:
                logger.warning("%s: skipping row %d%s: it %s", source, index, line, row.detail)
            stats.skipped += 1
            reasons[row.kind] += 1
            continue
        try:
            messages = row_messages(row)
            rendered = [
                _render_pair(template, prompt, response, response_end, eos_token)
                for prompt, response in conversation_pairs(messages, multiturn, mix_seed(seed, index))
            ]
        except _Malformed as e:
            if not skip_malformed:
                raise SFTDataError(f"{source}: row {index}: {e}") from None
            stats.skipped += 1
            reasons[str(e)] += 1
            continue
        pending.extend(rendered)
        if len(pending) >= _TOKENIZE_CHUNK:
            flush()
    flush()
    if stats.rows == 0 and max_rows != 0:
        raise SFTDataError(f"{source}: no rows (an empty split, JSON array or file of blank lines)")

    dataset = SFTDataset()
    dataset._set(kept_ids, kept_prompt_lens)
    stats.examples = len(dataset)
    stats.skip_reasons = dict(reasons)
    logger.info("SFT data %s (template %s, max_len %d): %s", source, template.name, max_len, stats.summary())
    if cache_file is not None:
        _save_cache(cache_file, dataset, stats)
    return dataset, stats


_CACHE_VERSION = 2  # 2: a local file is keyed by its content hash (1: by size and mtime)


class SFTCacheError(ValueError):
    """A tokenised-SFT cache file that cannot be read (truncated, damaged); names the file."""


def _cache_key(source: str | Path, tokenizer: Any, settings: dict[str, Any], split: str = "train") -> str:
    """sha256 over the source identity, the tokenizer (vocabulary, merges, template) and the settings.

    A local file is identified by resolved path and the SHA-256 of its bytes (content, not names: an
    edit in place that keeps the size and the mtime gives another key); a hub dataset or local dataset
    directory by its name, split and the ``datasets`` fingerprint of the split (for a hub dataset
    derived from the revision resolved: a new upload gives another key). ``datasets`` itself does
    not notice files of a local directory edited in place: clear its cache and this one for that.
    """
    path = Path(str(source))
    if path.is_file():
        ident: dict[str, Any] = {"path": str(path.resolve()), "sha256": file_sha256(path)}
    else:
        rows = load_sft_rows(source, split)
        ident = {
            "hub": str(source),
            "split": split,
            "datasets_fingerprint": getattr(rows, "_fingerprint", None),
        }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    h = hashlib.sha256()
    meta = {
        "version": _CACHE_VERSION,
        "source": ident,
        "settings": settings,
        "eos": tokenizer.eos_token,
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    h.update(vocab.encode())
    return h.hexdigest()[:24]


def _save_cache(path: Path, dataset: SFTDataset, stats: SFTDataStats) -> None:
    """Atomic write (temporary file, then rename) so concurrent ranks never read a partial file.
    The temporary name carries host and pid: nodes sharing the folder never write the same file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{socket.gethostname()}.{os.getpid()}")
    with open(tmp, "wb") as f:
        np.savez(
            f,
            tokens=dataset.tokens,
            offsets=dataset.offsets,
            prompt_lens=dataset.prompt_lens,
            stats=np.array(json.dumps(asdict(stats))),
        )
    os.replace(tmp, path)


def _load_cache(path: Path) -> tuple[SFTDataset, SFTDataStats]:
    """The cached dataset; ``SFTCacheError`` naming ``path`` when it cannot be read whole."""
    try:
        with np.load(path, allow_pickle=False) as z:
            dataset = SFTDataset()
            dataset.tokens = z["tokens"]
            dataset.offsets = z["offsets"]
            dataset.prompt_lens = z["prompt_lens"]
            dataset.lengths = np.diff(dataset.offsets)
            stats = SFTDataStats(**json.loads(str(z["stats"])))
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as err:
        raise SFTCacheError(f"SFT token cache {path} is unreadable ({type(err).__name__}: {err})") from err
    if dataset.offsets.size == 0 or int(dataset.offsets[-1]) != dataset.tokens.size:
        raise SFTCacheError(f"SFT token cache {path} is inconsistent (offsets do not end at its token count)")
    return dataset, stats


# ----------------------------------------------------------------------------------------------
# Collation
# ----------------------------------------------------------------------------------------------


PERBATCH_CUTOFFS = ("none", "random", "random_with_input_pad")
_CUTOFF_STREAM = 0x43555446  # "CUTF": keeps the cutoff draws apart from the sampler and noise streams


def response_body_len(example: SFTExample, pad_id: int) -> int:
    """Response tokens without the trailing run of ``pad_id`` (EOS): the length Dream-train's
    per-batch cutoff counts (it counts the response's non-pad tokens, and its pad is EOS)."""
    end = len(example.input_ids)
    while end > example.prompt_len and example.input_ids[end - 1] == pad_id:
        end -= 1
    return end - example.prompt_len


def cutoff_generator(seed: int, draw_key: Sequence[int]) -> torch.Generator:
    """The generator of one batch's cutoff draws, seeded by (seed, draw_key) only.

    The trainer's key is (sampler epoch, the batch's sample indices): the draw belongs to the batch,
    so a resumed run redraws it exactly, on any world size (the sampler's global micro-batch
    sequence does not depend on it), and never touches the global RNG.
    """
    g = torch.Generator()
    g.manual_seed(mix_seed(_CUTOFF_STREAM, seed, *draw_key))
    return g


class SFTCollator:
    """Pads a list of ``SFTExample`` with EOS into the tensors the trainer needs.

    Returns a dict with
    - ``input_ids`` [B, L] long: clean tokens (also the targets), pads = ``pad_id`` (EOS);
    - ``prompt_mask`` [B, L] bool: True on prompt tokens (never corrupted, never in the loss);
    - ``maskable`` [B, L] bool: response tokens plus EOS pads (official LLaDA/Dream: pads are
      trained targets); only the response when ``attend_padding=False``; never a left pad;
    - ``valid`` [B, L] bool: attention validity, True by default on everything but left pads
      (right pads are attended, as in LLaDA and official Dream SFT); also False on right pads with
      ``attend_padding=False`` (pads then neither attended nor in the loss);
    - ``answer_len`` [B] long: maskable tokens per row, LLaDA's loss normaliser;
    - ``seq_len`` [B] long: tokens of the example kept in the row (no pads of either side);
    - ``positions`` [B, L] long, only with ``perbatch_cutoff="random_with_input_pad"``: the RoPE /
      MDLMPE position of each token, 0 at the row's first real token (pads: 0). Pass it to the model.

    ``perbatch_cutoff`` (Dream-train's ``OptimizedCollateFunction``; ``DataConfig.perbatch_cutoff``):
    - ``"none"``: right-padding to the longest example, rounded up to ``pad_to_multiple_of`` but
      capped at ``max_len``;
    - ``"random"``: one row is drawn uniformly and every row is cut to (or EOS-padded up to) its
      length without trailing EOS; a row whose prompt is longer keeps only part of its prompt;
    - ``"random_with_input_pad"``: prompts are left-padded to the batch's longest prompt P (pads
      not attended, never masked, not in the loss); one row is drawn uniformly and every response
      is cut to (or EOS-padded up to) that row's response length R without trailing EOS, capped at
      ``max_len - P``; the width is P + R. The drawn row itself ends without EOS, as in Dream-train.
    Then, with probability ``resp_cutoff_ratio``, c ~ U{1 .. m - 1} columns are cut from the end of
    the batch, m the smallest ``answer_len`` (nothing when m <= 1), so each row keeps an answer token.

    Draws come from ``cutoff_generator(seed, draw_key)``; a cutoff needs ``draw_key``. An example
    longer than ``max_len`` is an error (``build_sft_dataset`` already truncates).
    """

    def __init__(
        self,
        pad_id: int,
        max_len: int | None = None,
        pad_to_multiple_of: int | None = None,
        attend_padding: bool = True,
        perbatch_cutoff: str = "none",
        resp_cutoff_ratio: float = 0.0,
        seed: int = 0,
    ) -> None:
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        if perbatch_cutoff not in PERBATCH_CUTOFFS:
            raise ValueError(f"perbatch_cutoff must be one of {PERBATCH_CUTOFFS}, got {perbatch_cutoff!r}")
        if not 0.0 <= resp_cutoff_ratio <= 1.0:
            raise ValueError(f"resp_cutoff_ratio must be in [0, 1], got {resp_cutoff_ratio}")
        self.cuts = perbatch_cutoff != "none" or resp_cutoff_ratio > 0.0
        if self.cuts and pad_to_multiple_of:
            # The rounding pads would be trained EOS right after responses the cutoff truncated.
            raise ValueError("pad_to_multiple_of cannot be combined with perbatch_cutoff / resp_cutoff_ratio")
        self.pad_id = int(pad_id)
        self.max_len = max_len
        self.pad_to_multiple_of = pad_to_multiple_of
        self.attend_padding = attend_padding
        self.perbatch_cutoff = perbatch_cutoff
        self.resp_cutoff_ratio = float(resp_cutoff_ratio)
        self.seed = int(seed)

    def __call__(
        self, examples: Sequence[SFTExample], draw_key: Sequence[int] | None = None
    ) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("SFTCollator got an empty batch")
        if self.cuts and draw_key is None:
            raise ValueError(
                "SFTCollator with a per-batch cutoff needs draw_key (e.g. the epoch and the batch's "
                "sample indices) to seed its draw"
            )
        lengths = [len(ex.input_ids) for ex in examples]
        longest = max(lengths)
        if self.max_len is not None and longest > self.max_len:
            raise ValueError(f"an SFT example has {longest} tokens > max_len {self.max_len}")
        for row, ex in enumerate(examples):
            if not 0 <= ex.prompt_len < len(ex.input_ids):
                raise ValueError(f"example {row} of the batch: prompt_len {ex.prompt_len} leaves no response")
        gen = cutoff_generator(self.seed, draw_key) if self.cuts else None
        B = len(examples)
        prompt_lens = [ex.prompt_len for ex in examples]
        # 1. Layout per row: `left` pads, then the first `kept` tokens of the example; width L.
        left, kept = [0] * B, lengths
        if self.perbatch_cutoff == "none":
            L = longest
            if self.pad_to_multiple_of:
                L = math.ceil(L / self.pad_to_multiple_of) * self.pad_to_multiple_of
                if self.max_len is not None:
                    L = min(L, self.max_len)
        else:
            drawn = int(torch.randint(B, (1,), generator=gen))
            body = response_body_len(examples[drawn], self.pad_id)
            if self.perbatch_cutoff == "random":
                L = max(1, examples[drawn].prompt_len + body)
                kept = [min(n, L) for n in lengths]
            else:  # random_with_input_pad
                P = max(prompt_lens)
                R = max(1, body)
                if self.max_len is not None:
                    R = min(R, self.max_len - P)
                L = P + R
                left = [P - p for p in prompt_lens]
                kept = [p + min(n - p, R) for p, n in zip(prompt_lens, lengths, strict=True)]
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        for row, ex in enumerate(examples):
            input_ids[row, left[row] : left[row] + kept[row]] = torch.as_tensor(
                ex.input_ids[: kept[row]], dtype=torch.long
            )
        # 2. Masks.                                                                   all [B, L]
        pos = torch.arange(L).unsqueeze(0)  # [1, L]
        start = torch.tensor(left, dtype=torch.long)[:, None]  # [B, 1] first real token
        prompt_end = start + torch.tensor(prompt_lens, dtype=torch.long)[:, None]
        prompt_mask = (pos >= start) & (pos < prompt_end)
        real = (pos >= start) & (pos < start + torch.tensor(kept, dtype=torch.long)[:, None])
        if self.perbatch_cutoff == "random_with_input_pad":
            valid = pos >= start if self.attend_padding else real
        else:
            valid = torch.ones(B, L, dtype=torch.bool) if self.attend_padding else real
        maskable = ~prompt_mask & valid
        # 3. Optional tail cut (Dream-train's resp_cutoff_ratio): keeps >= 1 answer token per row.
        if self.resp_cutoff_ratio > 0.0 and float(torch.rand(1, generator=gen)) < self.resp_cutoff_ratio:
            shortest = int(maskable.sum(dim=1).min())
            if shortest > 1:
                L -= int(torch.randint(1, shortest, (1,), generator=gen))
                input_ids, prompt_mask, real, valid, maskable = (
                    x[:, :L] for x in (input_ids, prompt_mask, real, valid, maskable)
                )
        out = {
            "input_ids": input_ids,
            "prompt_mask": prompt_mask,
            "maskable": maskable,
            "valid": valid,
            "answer_len": maskable.sum(dim=1),
            "seq_len": real.sum(dim=1),
        }
        if self.perbatch_cutoff == "random_with_input_pad":
            out["positions"] = (pos[:, :L] - start).clamp(min=0)  # [B, L]
        return out
