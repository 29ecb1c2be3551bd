"""Packed fixed-length pretraining sequences, and corruption draws keyed by data index.

Documents are tokenised without special tokens and concatenated into one stream, each followed by
a separator id (EOS by default); the stream is cut into consecutive ``seq_len`` windows (the tail
shorter than ``seq_len`` is dropped). A window may span several documents, but two documents are
always joined through the separator, never directly. Items are indexable, so a sampler can resume
at any index.

Sources:

* local text files (``from_text_files``), with ``split``: ``"file"`` (each file is one document),
  ``"paragraph"`` (documents separated by one or more blank lines) or ``"line"`` (each non-empty line
  is a document, e.g. PTB sentences);
* a ``datasets`` corpus by hub name or builder + data files (``from_hub``), one row of
  ``text_column`` per document — OpenWebText is ``from_hub("Skylion007/openwebtext", ...)``;
* already-tokenised documents (``from_token_documents``).

Corruption draws for the masked-diffusion forward process depend only on ``(seed, data_index)``
(``mdlmpe_ds.seeding.corruption_draws``), not on the model, the position encoding, the rank or the
batch a sequence lands in, so every encoding compared sees exactly the same masks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

SPLIT_MODES = ("file", "paragraph", "line")


def split_documents(text: str, mode: str) -> list[str]:
    """Documents of one file's ``text`` under ``mode`` (see module doc); empty documents are dropped."""
    if mode == "file":
        docs = [text.strip("\n")]
    elif mode == "paragraph":
        docs = [d.strip("\n") for d in re.split(r"\n[ \t]*\n", text)]
    elif mode == "line":
        docs = [d.strip() for d in text.split("\n")]
    else:
        raise ValueError(f"split={mode!r}; expected one of {SPLIT_MODES}")
    return [d for d in docs if d.strip()]


def separator_for(tokenizer, separator_id: int | None = None) -> int:
    """``separator_id``, else the tokenizer's EOS id (a tokenizer without EOS needs one given)."""
    sep = tokenizer.eos_token_id if separator_id is None else separator_id
    if sep is None:
        raise ValueError("the tokenizer has no eos_token_id; pass separator_id explicitly")
    return int(sep)


def token_documents(texts: Iterable[str], tokenizer, batch_size: int = 256) -> Iterator[list[int]]:
    """Each text's ids (no special tokens), tokenised ``batch_size`` texts at a time."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            yield from tokenizer(batch, add_special_tokens=False)["input_ids"]
            batch = []
    if batch:
        yield from tokenizer(batch, add_special_tokens=False)["input_ids"]


class PackedTokenDataset(Dataset):
    """Fixed-length windows over a separator-joined token stream.

    ``self[i]`` is ``{"input_ids": LongTensor[seq_len], "index": i}``; window ``i`` covers stream
    tokens ``[i * seq_len, (i + 1) * seq_len)``.
    """

    def __init__(self, stream: np.ndarray, doc_ends: np.ndarray, seq_len: int, separator_id: int, store=None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if stream.ndim != 1:
            raise ValueError(f"stream must be 1-D, got shape {stream.shape}")
        # [T] integer ids (int64 in memory, or a token store's uint16/uint32 memory map), every
        # document followed by separator_id
        self.stream = stream
        self.doc_ends = doc_ends  # [num_docs] exclusive end offset of each document's separator
        self.seq_len = seq_len
        self.separator_id = separator_id
        self.store = store  # the data/token_store.TokenStore mapped, if any

    @classmethod
    def from_store(cls, store, seq_len: int) -> PackedTokenDataset:
        """Windows over a token store: a window reads only its own ids from the file."""
        return cls(store.tokens, store.doc_ends, seq_len, store.separator_id, store=store)

    @classmethod
    def from_token_documents(
        cls, documents: Iterable[Sequence[int]], seq_len: int, separator_id: int
    ) -> PackedTokenDataset:
        """Pack already-tokenised documents (each followed by ``separator_id``)."""
        pieces, ends, total = [], [], 0
        for doc in documents:
            arr = np.asarray(doc, dtype=np.int64)
            if arr.ndim != 1:
                raise ValueError(f"document {len(ends)} is not a flat token list (shape {arr.shape})")
            if arr.size == 0:
                continue
            pieces.append(arr)
            pieces.append(np.array([separator_id], dtype=np.int64))
            total += arr.size + 1
            ends.append(total)
        if not ends:
            raise ValueError("no non-empty documents to pack")
        return cls(np.concatenate(pieces), np.asarray(ends, dtype=np.int64), seq_len, separator_id)

    @classmethod
    def from_texts(
        cls,
        texts: Iterable[str],
        tokenizer,
        seq_len: int,
        separator_id: int | None = None,
        batch_size: int = 256,
    ) -> PackedTokenDataset:
        """Tokenise ``texts`` (one document each, no special tokens) and pack them.

        ``separator_id`` defaults to ``tokenizer.eos_token_id``; a tokenizer without EOS needs one.
        """
        sep = separator_for(tokenizer, separator_id)
        return cls.from_token_documents(token_documents(texts, tokenizer, batch_size), seq_len, sep)

    @classmethod
    def from_text_files(
        cls,
        files: Sequence[str | os.PathLike],
        tokenizer,
        seq_len: int,
        split: str = "file",
        separator_id: int | None = None,
    ) -> PackedTokenDataset:
        """Pack local UTF-8 text files, documents delimited per ``split`` (``file|paragraph|line``)."""
        if split not in SPLIT_MODES:
            raise ValueError(f"split={split!r}; expected one of {SPLIT_MODES}")
        texts: list[str] = []
        for f in files:
            path = Path(f)
            if not path.is_file():
                raise FileNotFoundError(f"pretraining text file {path} does not exist")
            texts.extend(split_documents(path.read_text(encoding="utf-8"), split))
        return cls.from_texts(texts, tokenizer, seq_len, separator_id)

    @classmethod
    def from_hub(
        cls,
        path: str,
        tokenizer,
        seq_len: int,
        *,
        split: str = "train",
        text_column: str = "text",
        data_files=None,
        name: str | None = None,
        max_documents: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        separator_id: int | None = None,
    ) -> PackedTokenDataset:
        """Pack a ``datasets`` corpus: ``datasets.load_dataset(path, name, split=..., data_files=...)``.

        E.g. ``from_hub("Skylion007/openwebtext", tok, 1024)`` (needs the hub), or offline
        ``from_hub("json", tok, 1024, data_files="docs.jsonl")`` / ``from_hub("text", ...)``.
        Each row's ``text_column`` is one document; ``max_documents`` keeps the first rows only.
        """
        import datasets

        ds = datasets.load_dataset(
            path,
            name,
            split=split,
            data_files=data_files,
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
        if text_column not in ds.column_names:
            raise KeyError(
                f"dataset {path!r} split {split!r} has no column {text_column!r} ({ds.column_names})"
            )
        if max_documents is not None:
            ds = ds.select(range(min(max_documents, len(ds))))
        texts = (row[text_column] for row in ds)
        return cls.from_texts((t for t in texts if t and t.strip()), tokenizer, seq_len, separator_id)

    @property
    def num_tokens(self) -> int:
        """Tokens covered by the windows (stream length rounded down to a multiple of seq_len)."""
        return len(self) * self.seq_len

    def __len__(self) -> int:
        return self.stream.size // self.seq_len

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} packed sequences")
        start = index * self.seq_len
        if self.store is not None:
            window = self.store.read(start, self.seq_len)  # [seq_len] int64, from the file
        else:
            window = self.stream[start : start + self.seq_len].astype(np.int64)  # [seq_len], a copy
        window = torch.from_numpy(window)
        return {"input_ids": window, "index": index}

    def document_ids(self, index: int) -> np.ndarray:
        """Which document each token of window ``index`` comes from (the separator counts with the
        document it ends)."""
        positions = np.arange(index * self.seq_len, (index + 1) * self.seq_len)
        return np.searchsorted(self.doc_ends, positions, side="right")  # [seq_len]


def packed_collate(items: Sequence[dict]) -> dict:
    """Stack packed items: ``input_ids`` [B, L], ``valid`` [B, L] (all True: no padding), ``index`` [B]."""
    ids = torch.stack([it["input_ids"] for it in items])  # [B, L]
    return {
        "input_ids": ids,
        "valid": torch.ones_like(ids, dtype=torch.bool),
        "index": torch.tensor([it["index"] for it in items], dtype=torch.long),
    }
