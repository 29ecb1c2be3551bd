"""The integrity checks of a token store (data/token_store.py), by content rather than by name.

Content, not names: opening checks the data files against the manifest's sampled content hash
(SHA-256 over 64 chunks of 64 KiB spread evenly over each file, plus its size: 4 MiB read per file
whatever the corpus size, so every rank can afford it at every start) and the manifest against the
SHA-256 recorded in ``COMPLETE``. A ``tokens.bin`` overwritten at the same size by another corpus, or
an edited manifest, is then reported by file name (``open_or_build`` rebuilds such a store) instead
of being trained on, or of surfacing later as a checkpoint "trained on other data". The full hash
is the packed fingerprint, computed once over every token at build (reading a 100 GB store in
full costs minutes per rank, too much for every open); a change confined to bytes between the
sampled chunks is caught only by that fingerprint, when the store is rebuilt.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"
TOKENS, DOC_ENDS, MANIFEST = "tokens.bin", "doc_ends.npy", "manifest.json"
SAMPLE_CHUNKS, SAMPLE_BYTES = 64, 1 << 16  # the sampled content hash (module doc)
MANIFEST_HASH = "manifest_sha256"


class StoreError(RuntimeError):
    """A store that cannot be used as it is (incomplete, damaged, other format); names the file."""


class StoreChangedError(StoreError):
    """A complete store whose files no longer match what was built (edited, overwritten, damaged):
    ``open_or_build`` builds it again."""


def sampled_content_hash(file: Path, chunks: int = SAMPLE_CHUNKS, chunk_bytes: int = SAMPLE_BYTES) -> str:
    """SHA-256 over the size of ``file`` and ``chunks`` chunks of ``chunk_bytes`` at offsets spread
    evenly from its start to its end (the whole file when smaller than that)."""
    size = file.stat().st_size
    h = hashlib.sha256(f"{size}:{chunks}:{chunk_bytes}:".encode())
    last = max(0, size - chunk_bytes)
    starts = sorted({last * k // max(1, chunks - 1) for k in range(chunks)})
    with open(file, "rb") as fh:
        for start in starts:
            fh.seek(start)
            h.update(fh.read(chunk_bytes))
    return h.hexdigest()


def content_sample(path: Path) -> dict[str, Any]:
    return {
        "chunks": SAMPLE_CHUNKS,
        "chunk_bytes": SAMPLE_BYTES,
        "files": {name: sampled_content_hash(path / name) for name in (TOKENS, DOC_ENDS)},
    }


def check_manifest(path: Path, raw: bytes) -> None:
    """The manifest's bytes against the SHA-256 ``COMPLETE`` recorded (older stores have none)."""
    for line in (path / COMPLETE).read_text(encoding="utf-8").splitlines():
        key, _, want = line.partition(" ")
        if key == MANIFEST_HASH and hashlib.sha256(raw).hexdigest() != want:
            raise StoreChangedError(
                f"token store manifest edited or damaged: {path / MANIFEST} (its SHA-256 is not the one "
                f"recorded in {path / COMPLETE} when the store was built)"
            )


def check_content(path: Path, manifest: dict[str, Any]) -> None:
    """The data files against the manifest's sampled hash (older stores have none)."""
    sample = manifest.get("content_sample")
    if not sample:
        return
    for name, want in sample["files"].items():
        got = sampled_content_hash(path / name, int(sample["chunks"]), int(sample["chunk_bytes"]))
        if got != want:
            raise StoreChangedError(
                f"token store file changed since it was built: {path / name} (its sampled content hash "
                f"differs from the one in {path / MANIFEST}; overwritten or damaged)"
            )


def complete_marker(num_tokens: int, manifest_text: str) -> str:
    """What ``COMPLETE`` holds: the token count and the manifest's SHA-256 (checked by ``check_manifest``)."""
    return f"{num_tokens}\n{MANIFEST_HASH} {hashlib.sha256(manifest_text.encode()).hexdigest()}\n"
