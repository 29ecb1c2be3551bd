"""SFT chat data: render with the family's chat template, tokenise, truncate and cache the rows
that data/sft_rows.py reads and validates; data/sft_collate.py pads them into batches.

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
import os
import socket
import zipfile
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from mdlmpe_ds import stop_request
from mdlmpe_ds.data import special_text
from mdlmpe_ds.data.chat_templates import ChatTemplate, Message, template_for
from mdlmpe_ds.data.fingerprint import file_sha256
from mdlmpe_ds.data.sft_rows import (
    LOGGED_BAD_LINES,
    MULTITURN,
    BadLine,
    Malformed,
    SFTDataError,
    conversation_pairs,
    iter_rows,
    load_sft_rows,
    local_files,
    local_selection,
    row_messages,
)
from mdlmpe_ds.seeding import mix_seed

logger = logging.getLogger(__name__)

DEFAULT_RESPONSE_END = {"llada": "turn", "dream": "eos"}
_TOKENIZE_CHUNK = 1024


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
    special_text: int = 0  # rows quoting a special token's spelling, encoded as text (special_text.py)
    # Token lengths of every (prompt, response) pair before any cut, for choosing max_len when many
    # are dropped or cut (0: not known, a cache written before these were counted).
    longest: int = 0
    median_length: int = 0
    shortest_cut: int = 0  # fewest response tokens a truncated example kept (0: none truncated)

    @property
    def candidates(self) -> int:
        """Examples before the length cut: kept plus dropped as too long."""
        return self.examples + self.dropped

    def summary(self) -> str:
        quoted = f", {self.special_text} quoting special tokens as text" if self.special_text else ""
        return (
            f"{self.rows} rows -> {self.examples} examples "
            f"({self.truncated} truncated, {self.dropped} dropped as too long, "
            f"{self.skipped} malformed skipped{quoted})"
        )


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
        raise Malformed(
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

    selection = local_selection(source, split)  # the files read (and keyed), resolved once
    files = None if selection is None else selection.files
    if selection is not None and Path(selection.source).is_dir():
        logger.info(selection.describe())
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
        cache_file = Path(cache_dir) / f"sft-{_cache_key(source, tokenizer, settings, split, files)}.npz"
        if cache_file.is_file():
            try:
                dataset, stats = _load_cache(cache_file)
            except SFTCacheError as err:  # truncated or damaged: tokenised again and replaced
                logger.warning("%s; tokenising %s again", err, source)
            else:
                logger.info("SFT data %s: loaded from cache %s: %s", source, cache_file, stats.summary())
                return dataset, stats

    stats = SFTDataStats()
    full_lengths = array("q")  # prompt + response tokens of each pair, before any cut
    reasons: Counter[str] = Counter()
    kept_ids: list[np.ndarray] = []
    kept_prompt_lens: list[int] = []
    pending: list[tuple[str, str]] = []
    spellings = special_text.special_spellings(tokenizer)

    def keep(p_ids: list[int], r_ids: list[int]) -> None:
        """One tokenised (prompt, response): kept, truncated or dropped by ``max_len``."""
        full_lengths.append(len(p_ids) + len(r_ids))
        if len(p_ids) >= max_len:
            stats.dropped += 1
            return
        if len(p_ids) + len(r_ids) > max_len:
            if overlong == "drop":
                stats.dropped += 1
                return
            r_ids = r_ids[: max_len - len(p_ids)]
            stats.truncated += 1
            stats.shortest_cut = min(stats.shortest_cut or len(r_ids), len(r_ids))
        kept_ids.append(np.asarray(p_ids + r_ids, dtype=np.int32))
        kept_prompt_lens.append(len(p_ids))

    def flush() -> None:
        """Tokenise the pending (prompt, response) texts in one batch and keep them in order."""
        if not pending:
            return
        prompts = tokenizer([p for p, _ in pending], add_special_tokens=False)["input_ids"]
        responses = tokenizer([r for _, r in pending], add_special_tokens=False)["input_ids"]
        for p_ids, r_ids in zip(prompts, responses, strict=True):
            keep(p_ids, r_ids)
        pending.clear()

    for index, (origin, origin_row, row) in enumerate(iter_rows(source, split, files)):
        if max_rows is not None and index >= max_rows:
            break
        stop_request.poll(f"tokenising {source} (row {index})")  # Ctrl-C / SIGTERM stop here
        stats.rows += 1
        if isinstance(row, BadLine):
            line = "" if row.line is None else f" (line {row.line})"
            if not skip_malformed:
                raise SFTDataError(f"{origin}: row {origin_row}{line} {row.detail}")
            if stats.skipped < LOGGED_BAD_LINES:
                logger.warning("%s: skipping row %d%s: it %s", origin, origin_row, line, row.detail)
            stats.skipped += 1
            reasons[row.kind] += 1
            continue
        try:
            messages, quoted = special_text.mark(row_messages(row), spellings)
            rendered = [
                _render_pair(template, prompt, response, response_end, eos_token)
                for prompt, response in conversation_pairs(messages, multiturn, mix_seed(seed, index))
            ]
        except Malformed as e:
            if not skip_malformed:
                raise SFTDataError(f"{origin}: row {origin_row}: {e}") from None
            stats.skipped += 1
            reasons[str(e)] += 1
            continue
        if quoted:  # encoded as the text it is, not as the special token it spells
            stats.special_text += 1
            if stats.special_text <= LOGGED_BAD_LINES:
                logger.warning(
                    "%s: row %d quotes special token spellings %s in its content: encoded as text",
                    origin, origin_row, sorted(set(quoted)),
                )  # fmt: skip
            flush()  # the rows before it first: the examples keep the rows' order
            for p, r in rendered:
                keep(special_text.encode(tokenizer, p, quoted), special_text.encode(tokenizer, r, quoted))
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
    if full_lengths:
        stats.longest, stats.median_length = max(full_lengths), int(np.median(full_lengths))
    logger.info("SFT data %s (template %s, max_len %d): %s", source, template.name, max_len, stats.summary())
    if cache_file is not None:
        _save_cache(cache_file, dataset, stats)
    return dataset, stats


#: 3: content quoting a special token's spelling is encoded as text; 2: a local file is keyed by its
#: content hash (1: by size and mtime)
_CACHE_VERSION = 3


class SFTCacheError(ValueError):
    """A tokenised-SFT cache file that cannot be read (truncated, damaged); names the file."""


def _cache_key(
    source: str | Path,
    tokenizer: Any,
    settings: dict[str, Any],
    split: str = "train",
    files: list[Path] | None = None,
) -> str:
    """sha256 over the source identity, the tokenizer (vocabulary, merges, template) and the settings.

    A local file is identified by resolved path and the SHA-256 of its bytes (content, not names: an
    edit in place that keeps the size and the mtime gives another key); a local dataset directory
    likewise by each of its files of the split (``sft_rows.local_files``, or ``files`` when the caller
    resolved them: the very list it reads); a hub dataset by its name, split and the ``datasets``
    fingerprint of the split (derived from the revision resolved: a new upload gives another key).
    """
    files = local_files(source, split) if files is None else files
    if files is not None:  # a local file, or a local directory's files of the split: by content
        ident: dict[str, Any] = {"split": split, "files": {str(f.resolve()): file_sha256(f) for f in files}}
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
