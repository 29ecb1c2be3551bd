"""Content fingerprints of training data, stored in every checkpoint so that a resume on other data
(a re-tokenised corpus, an edited file of the same size, another tokenizer) is caught.

SHA-256 over the token arrays as the model sees them, plus the tokenizer's vocabulary, special
tokens and chat template: hashing the tokenised form catches every change that matters to training
and nothing that does not (file timestamps, JSON formatting).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np


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


def packed_fingerprint(dataset: Any, tokenizer: Any) -> str:
    """A ``PackedDataset``: the tokenizer, the token stream and its document boundaries."""
    fp = Fingerprint().tokenizer(tokenizer)
    return fp.array("stream", dataset.stream).array("doc_ends", dataset.doc_ends).hexdigest()
