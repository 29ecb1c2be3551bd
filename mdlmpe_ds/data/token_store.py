"""A tokenised corpus on disk, memory-mapped read-only by every rank (the pretraining token store).

Layout of a store directory::

    tokens.bin     every document's token ids followed by the separator id, back to back; uint16
                   when every id fits (vocabulary <= 65,536), else uint32; no header
    doc_ends.npy   int64 [num_docs], the exclusive end offset of each document's separator
    manifest.json  format version, dtype, counts, separator id, the tokenizer's fingerprint, the
                   source (corpus, split, held-out slice, detokenizer, shard order), the packed
                   fingerprint that checkpoints record, and a sampled content hash of both data files
    COMPLETE       written last: the token count and the manifest's SHA-256; a directory without
                   it is never read

Opening checks the data files and the manifest by content (data/store_integrity.py), so a store
overwritten or edited in place is reported by file name and rebuilt instead of being trained on.

The token sequence is exactly the in-memory stream of ``PackedTokenDataset`` (same documents, same
separators), so windows cut from the store are the same tokens and keep the same indices, and the
index-keyed corruption draws do not change. Every rank maps the files read-only (``tokens``,
``doc_ends``); training windows are read with ``pread`` (``TokenStore.read``) so that the pages a
rank has read stay in the shared page cache and out of its resident memory.

Building is crash-safe: the store is written into a staging directory next to its final place and
renamed into place after ``COMPLETE``; a builder holds an exclusive ``flock`` on ``<name>.lock``
meanwhile. A build killed at any point (SIGKILL included) leaves only a staging directory (or, from
a foreign tool, a store without ``COMPLETE``); the next builder removes it and builds again. Several
nodes sharing the folder may build at once: the first rename wins and the others use that copy.
Memory while building is bounded by the write buffer, whatever the corpus size.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mdlmpe_ds import stop_request
from mdlmpe_ds.data.store_integrity import (
    COMPLETE,
    DOC_ENDS,
    MANIFEST,
    TOKENS,
    StoreChangedError,
    StoreError,
    check_content,
    check_manifest,
    complete_marker,
    content_sample,
)
from mdlmpe_ds.run_lock import pid_alive

STORE_VERSION = 1
_FLUSH_TOKENS = 1 << 22  # write buffer: 4M ids (16 MB as uint32)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id < ``vocab_size`` fits in 16 bits, else uint32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / COMPLETE).is_file()


@dataclass
class TokenStore:
    """An opened, complete store: ``tokens`` (read-only memmap [T]) and ``doc_ends`` (memmap [D])."""

    path: Path
    manifest: dict[str, Any]
    tokens: np.ndarray
    doc_ends: np.ndarray
    _fd: int | None = None

    @property
    def separator_id(self) -> int:
        return int(self.manifest["separator_id"])

    def read(self, start: int, count: int) -> np.ndarray:
        """Ids ``[start, start + count)`` as a new int64 array [count], read with ``pread``.

        Same values as ``tokens[start:start + count]``, but the bytes go through the page cache
        only, never into this process's mapping: a rank's resident memory stays flat however much
        of the corpus it has read (touched pages of a map count in its RSS until evicted).
        """
        if not 0 <= start <= start + count <= self.tokens.shape[0]:
            raise IndexError(f"{self.path / TOKENS}: ids [{start}, {start + count}) out of range")
        if self._fd is None:
            self._fd = os.open(self.path / TOKENS, os.O_RDONLY)
        dtype = self.tokens.dtype
        raw = os.pread(self._fd, count * dtype.itemsize, start * dtype.itemsize)
        return np.frombuffer(raw, dtype=dtype).astype(np.int64)

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)

    @classmethod
    def open(cls, path: str | os.PathLike) -> TokenStore:
        """Map a complete store read-only, after checking its files against its manifest."""
        path = Path(path)
        if not is_complete(path):
            raise StoreError(f"token store {path} is incomplete (no {COMPLETE} marker): an interrupted build")
        try:
            raw = (path / MANIFEST).read_bytes()
            manifest = json.loads(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise StoreChangedError(f"token store manifest {path / MANIFEST} is unreadable: {err}") from err
        check_manifest(path, raw)  # before any count in it is believed
        if manifest.get("version") != STORE_VERSION:
            raise StoreError(
                f"{path / MANIFEST}: store format {manifest.get('version')!r}, "
                f"this code reads {STORE_VERSION}"
            )
        dtype = np.dtype(manifest["dtype"])
        n_tokens, n_docs = int(manifest["num_tokens"]), int(manifest["num_documents"])
        size = (path / TOKENS).stat().st_size if (path / TOKENS).is_file() else -1
        if size != n_tokens * dtype.itemsize:
            raise StoreChangedError(
                f"{path / TOKENS}: {size} bytes, the manifest says {n_tokens} {dtype.name} ids "
                f"({n_tokens * dtype.itemsize} bytes)"
            )
        # np.memmap refuses an empty file; a store always holds >= 1 document.
        tokens = np.memmap(path / TOKENS, dtype=dtype, mode="r", shape=(n_tokens,))
        try:
            doc_ends = np.load(path / DOC_ENDS, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            raise StoreChangedError(f"{path / DOC_ENDS} is unreadable: {err}") from err
        last = int(doc_ends[-1]) if doc_ends.size else None
        if doc_ends.shape != (n_docs,) or last != n_tokens:
            raise StoreChangedError(
                f"{path / DOC_ENDS}: shape {doc_ends.shape} ending at {last}, "
                f"the manifest says {n_docs} documents over {n_tokens} tokens"
            )
        check_content(path, manifest)
        return cls(path, manifest, tokens, doc_ends)


class _Writer:
    """Appends documents to ``tokens.bin`` and their ends to a raw int64 file, in bounded memory."""

    def __init__(self, staging: Path, dtype: np.dtype, separator_id: int) -> None:
        self.dtype, self.separator_id = dtype, separator_id
        self.limit = np.iinfo(dtype).max
        if not 0 <= separator_id <= self.limit:
            raise ValueError(f"separator id {separator_id} does not fit in {dtype.name}")
        self.tokens = open(staging / TOKENS, "wb")  # noqa: SIM115 (closed by close())
        self.ends = open(staging / "doc_ends.raw", "wb")  # noqa: SIM115
        self.pieces: list[np.ndarray] = []
        self.end_list: list[int] = []
        self.buffered = 0
        self.num_tokens = 0
        self.num_docs = 0

    def add(self, doc: Sequence[int]) -> None:
        arr = np.asarray(doc, dtype=np.int64)  # [n]
        if arr.ndim != 1:
            raise ValueError(f"document {self.num_docs} is not a flat token list (shape {arr.shape})")
        if arr.size == 0:
            return
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high > self.limit:
            bad = low if low < 0 else high
            raise ValueError(f"document {self.num_docs}: token id {bad} does not fit in {self.dtype.name}")
        self.pieces += [arr.astype(self.dtype), np.array([self.separator_id], dtype=self.dtype)]
        self.num_tokens += arr.size + 1
        self.num_docs += 1
        self.end_list.append(self.num_tokens)
        self.buffered += arr.size + 1
        if self.buffered >= _FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if self.pieces:
            self.tokens.write(np.concatenate(self.pieces).tobytes())
            self.ends.write(np.asarray(self.end_list, dtype="<i8").tobytes())
        self.pieces, self.end_list, self.buffered = [], [], 0

    def close(self) -> None:
        self.flush()
        for fh in (self.tokens, self.ends):
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()


def _finish_doc_ends(staging: Path, num_docs: int) -> None:
    """``doc_ends.raw`` (int64 little-endian) -> ``doc_ends.npy``, copied in chunks."""
    raw = staging / "doc_ends.raw"
    src = np.memmap(raw, dtype="<i8", mode="r", shape=(num_docs,))
    out = np.lib.format.open_memmap(staging / DOC_ENDS, mode="w+", dtype=np.int64, shape=(num_docs,))
    for start in range(0, num_docs, _FLUSH_TOKENS):
        out[start : start + _FLUSH_TOKENS] = src[start : start + _FLUSH_TOKENS]
    out.flush()
    del out, src
    raw.unlink()


def _staging_prefix(path: Path) -> str:
    return f".{path.name}.staging-"


def _remove_stale(path: Path) -> list[Path]:
    """Remove what interrupted builds of ``path`` left: this host's staging directories whose
    process is gone, and a store directory without ``COMPLETE``. Call holding the build lock."""
    removed = []
    host = socket.gethostname()
    for staging in path.parent.glob(_staging_prefix(path) + "*"):
        owner = staging.name[len(_staging_prefix(path)) :]
        owner_host, _, pid = owner.rpartition("-")
        if owner_host == host and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(staging)
    if path.exists() and not is_complete(path):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _set_aside(path: Path) -> None:
    """Move a changed store out of the way (a rename: readers that have it open keep their files),
    then delete it. Call holding the build lock."""
    aside = path.parent / f".{path.name}.changed-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_store(
    path: str | os.PathLike,
    documents: Iterable[Sequence[int]],
    *,
    separator_id: int,
    vocab_size: int,
    manifest: dict[str, Any] | None = None,
    fingerprint: Callable[[np.ndarray, np.ndarray], dict[str, Any]] | None = None,
) -> TokenStore:
    """Write ``documents`` (token id lists, empty ones skipped) as the store ``path`` and open it.

    ``manifest``: extra entries recorded (source, split, tokenizer...). ``fingerprint(tokens,
    doc_ends)`` is called on the finished (staged) arrays and its entries join the manifest, so
    readers need not hash the corpus again. Raises if ``path`` is already a complete store.
    """
    path = Path(path)
    if is_complete(path):
        raise FileExistsError(f"token store {path} already exists")
    dtype = token_dtype(vocab_size)
    staging = path.parent / f"{_staging_prefix(path)}{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        start = time.perf_counter()
        writer = _Writer(staging, dtype, separator_id)
        try:
            for doc in documents:
                stop_request.poll(f"building the token store {path} (document {writer.num_docs})")
                writer.add(doc)
        finally:
            writer.close()
        if writer.num_docs == 0:
            raise ValueError(f"token store {path}: no non-empty documents")
        _finish_doc_ends(staging, writer.num_docs)
        meta = {
            **(manifest or {}),
            "version": STORE_VERSION,
            "dtype": dtype.name,
            "num_tokens": writer.num_tokens,
            "num_documents": writer.num_docs,
            "separator_id": separator_id,
            "vocab_size": vocab_size,
            "build_seconds": round(time.perf_counter() - start, 3),
            "built_on": socket.gethostname(),
        }
        if fingerprint is not None:
            tokens = np.memmap(staging / TOKENS, dtype=dtype, mode="r", shape=(writer.num_tokens,))
            ends = np.load(staging / DOC_ENDS, mmap_mode="r")
            meta.update(fingerprint(tokens, ends))
            del tokens, ends
        meta["content_sample"] = content_sample(staging)
        text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
        (staging / MANIFEST).write_text(text, encoding="utf-8")
        with open(staging / COMPLETE, "w") as fh:
            fh.write(complete_marker(writer.num_tokens, text))
            fh.flush()
            os.fsync(fh.fileno())
        try:
            staging.rename(path)
        except OSError:
            if not is_complete(path):  # not a lost race against another node: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return TokenStore.open(path)


def open_or_build(
    path: str | os.PathLike,
    documents: Callable[[], Iterable[Sequence[int]]],
    *,
    separator_id: int,
    vocab_size: int,
    manifest: dict[str, Any] | None = None,
    fingerprint: Callable[[np.ndarray, np.ndarray], dict[str, Any]] | None = None,
    log: Callable[[str], None] | None = None,
) -> TokenStore:
    """The store at ``path``: opened when complete, else (under the build lock) the leftovers of an
    interrupted build removed and ``documents()`` built into it. A resume opens it again. A complete
    store whose files changed since its build (``StoreChangedError``: the file is named in the log)
    is removed and built again."""
    path = Path(path)
    say = log or (lambda _message: None)
    if is_complete(path):
        try:
            return TokenStore.open(path)
        except StoreChangedError as err:
            say(f"{err}: building it again")
    with _build_lock(path):
        if is_complete(path):  # built by another process while this one waited for the lock
            try:
                return TokenStore.open(path)
            except StoreChangedError:
                _set_aside(path)
        for stale in _remove_stale(path):
            say(f"token store: removed {stale}, left by an interrupted build")
        store = build_store(
            path, documents(), separator_id=separator_id, vocab_size=vocab_size, manifest=manifest,
            fingerprint=fingerprint,
        )  # fmt: skip
    if log is not None:
        m = store.manifest
        log(
            f"token store {path}: {m['num_tokens']:,} tokens ({m['dtype']}), "
            f"{m['num_documents']:,} documents, built in {m['build_seconds']:.1f}s"
        )
    return store
