"""Content fingerprints of training data, stored in every checkpoint so that a resume on other data
(a re-tokenised corpus, an edited file of the same size, another tokenizer) is caught.

SHA-256 over the token arrays as the model sees them, plus the tokenizer's vocabulary, special
tokens and chat template: hashing the tokenised form catches every change that matters to training
and nothing that does not (file timestamps, JSON formatting).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, read in 16 MiB blocks: the content identity of a source file (a
    sequential read on one core: 0.2-0.5 GB/s on the project's CI machines, more on a server core
    with SHA extensions; seconds for a multi-GB jsonl, against minutes to tokenise it)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 24):
            h.update(block)
    return h.hexdigest()


class Fingerprint:
    """An order-sensitive SHA-256 over labelled parts."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def _part(self, label: str, payload: bytes) -> Fingerprint:
        self._hash.update(f"{label}:{len(payload)}:".encode())
        self._hash.update(payload)
        return self

    def array(self, label: str, values: Any) -> Fingerprint:
        """A numeric array, by dtype, shape and little-endian bytes."""
        arr = np.ascontiguousarray(np.asarray(values))
        header = f"{arr.dtype.str}{arr.shape}"
        return self._part(label, header.encode() + arr.astype(arr.dtype.newbyteorder("<")).tobytes())

    def int64_chunks(self, label: str, values: np.ndarray, chunk: int = 1 << 24) -> Fingerprint:
        """``array(label, values.astype(int64))`` for a 1-D integer array (a memory map of uint16 or
        uint32 ids), hashed chunk by chunk: the same digest without an int64 copy of the corpus."""
        n = int(values.shape[0])
        header = f"{np.dtype('<i8').str}{(n,)}".encode()
        self._hash.update(f"{label}:{len(header) + 8 * n}:".encode())
        self._hash.update(header)
        for start in range(0, n, chunk):
            self._hash.update(np.asarray(values[start : start + chunk], dtype="<i8").tobytes())
        return self

    def tokenizer(self, tokenizer: Any) -> Fingerprint:
        """Vocabulary (token -> id), special tokens and chat template of a `transformers` tokenizer."""
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        meta = {
            "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
            "chat_template": getattr(tokenizer, "chat_template", None),
        }
        payload = json.dumps([vocab, meta], ensure_ascii=False, sort_keys=True).encode()
        return self._part("tokenizer", payload)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def sft_fingerprint(dataset: Any, tokenizer: Any) -> str:
    """An ``SFTDataset``: the tokenizer and every tokenised example (ids and prompt length), in order."""
    fp = Fingerprint().tokenizer(tokenizer)
    fp.array("tokens", dataset.tokens).array("offsets", dataset.offsets)
    return fp.array("prompt_lens", dataset.prompt_lens).hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    return Fingerprint().tokenizer(tokenizer).hexdigest()


def packed_fingerprint(dataset: Any, tokenizer: Any) -> str:
    """A ``PackedTokenDataset``: the tokenizer, the token stream (as int64) and its document ends.

    The same digest whether the stream is in memory (int64) or a token store's uint16/uint32 map,
    so checkpoints written before the store existed still resume. A store records the digest when
    it is built (``store_fingerprints``); it is reused when the tokenizer is the store's.
    """
    store = getattr(dataset, "store", None)
    if store is not None and store.manifest.get("tokenizer_fingerprint") == tokenizer_fingerprint(tokenizer):
        return store.manifest["packed_fingerprint"]
    return packed_digest(Fingerprint().tokenizer(tokenizer), dataset.stream, dataset.doc_ends)


def packed_digest(fp: Fingerprint, stream: np.ndarray, doc_ends: np.ndarray) -> str:
    return fp.int64_chunks("stream", stream).int64_chunks("doc_ends", doc_ends).hexdigest()


def store_fingerprints(tokenizer: Any):
    """A ``token_store.build_store`` fingerprint hook: the tokenizer's and the packed digest."""

    def hook(tokens: np.ndarray, doc_ends: np.ndarray) -> dict[str, str]:
        return {
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "packed_fingerprint": packed_digest(Fingerprint().tokenizer(tokenizer), tokens, doc_ends),
        }

    return hook
