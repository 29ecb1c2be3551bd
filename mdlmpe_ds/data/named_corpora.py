"""The paper's pretraining and zero-shot corpora by name, as hub datasets with their standard splits.

=================  ==================================  =====================  ==============
name               hub dataset (config)                splits (train / eval)  detokenizer
=================  ==================================  =====================  ==============
``openwebtext``    Skylion007/openwebtext              train minus held-out   none
                                                       / held-out slice
``wikitext-2``     Salesforce/wikitext (wikitext-2-    train / test           wikitext
                   raw-v1)
``wikitext-103``   Salesforce/wikitext (wikitext-103-  train / test           wikitext
                   raw-v1)
``lm1b``           billion-word-benchmark/lm1b         train / test           lm1b
                   (plain_text, parquet export)
``text8``          afmck/text8                         train / test           none
``ptb``            the Mikolov PTB prepared offline    train / test           ptb
                   (data/assets.py, same sentences as
                   the hub's ptb_text_only)
=================  ==================================  =====================  ==============

OpenWebText has only a ``train`` split on the hub: its first ``OWT_HELDOUT`` documents are held
out, so ``--dataset openwebtext`` trains on the rest and ``--validation openwebtext`` scores the
held-out slice (MDLM holds out the *last* 100K instead; the first ones can be read from a stream
without reading the whole corpus). The slice is recorded in the token store's manifest.

A bare name picks the split of its role (training: ``train``; validation / evaluation: ``test``,
the zero-shot split); ``name@split`` names one (``wikitext-103@validation`` is the split MDLM's
zero-shot numbers used for WikiText and PTB).

Detokenizers (the rules of the MDLM / SEDD zero-shot evaluation code, reimplemented here): the
corpora were distributed word-tokenised (``don 't``, `` @-@ ``, `` , ``); before a subword
tokenizer sees them the spacing is undone, so that perplexities are per token of ordinary text.

Every row of a hub split is one document (empty rows dropped). Large corpora (``openwebtext``,
``lm1b``'s train split) are read with ``datasets`` streaming: shards in the dataset's own order,
never shuffled, in bounded memory. ``MDLMPE_DS_HUB_DATASETS=DIR`` resolves ``org/name`` to the
local directory ``DIR/org/name`` laid out like the hub repository (README ``configs`` and parquet
files), read by the same ``datasets.load_dataset`` call: how the tests and offline machines use
them.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUB_DATASETS_ENV = "MDLMPE_DS_HUB_DATASETS"
OWT_HELDOUT = 100_000
ROLES = ("train", "eval")


# ------------------------------------------------------------------------------------ detokenizers
def _apply(rules: list[tuple[re.Pattern | str, str]], text: str) -> str:
    for pattern, repl in rules:
        text = pattern.sub(repl, text) if isinstance(pattern, re.Pattern) else text.replace(pattern, repl)
    return text


_WIKITEXT: list[tuple[re.Pattern | str, str]] = [
    ("s '", "s'"),  # plural possessive
    (re.compile(r"/' [0-9]/"), r"/'[0-9]/"),
    (" @-@ ", "-"),  # WikiText's escaped separators inside numbers and compounds
    (" @,@ ", ","),
    (" @.@ ", "."),
    *[(f" {p} ", f"{p} ") for p in (":", ";", ".", "!", "?", ",")],  # no space before punctuation
    (re.compile(r"\(\s*([^\)]*?)\s*\)"), r"(\1)"),  # no space inside brackets and quotes
    (re.compile(r"\[\s*([^\]]*?)\s*\]"), r"[\1]"),
    (re.compile(r"{\s*([^}]*?)\s*}"), r"{\1}"),
    (re.compile(r"\"\s*([^\"]*?)\s*\""), r'"\1"'),
    (re.compile(r"'\s*([^']*?)\s*'"), r"'\1'"),
    ("= = = =", "===="),  # section markers
    ("= = =", "==="),
    ("= =", "=="),
    (" \u00b0 ", "\u00b0"),
    (" \n", "\n"),
    ("\n ", "\n"),
    (" N ", " 1 "),
    (" 's", "'s"),
]


def wikitext_detokenize(text: str) -> str:
    """WikiText raw -> ordinary spacing (``@-@`` joins, punctuation and bracket spacing, headings)."""
    return _apply(_WIKITEXT, text)


def ptb_detokenize(text: str) -> str:
    """PTB -> ordinary spacing: clitics joined, ``\\/`` unescaped, the number token ``N`` read as
    ``1``, ``<unk>`` as ``?``."""
    for pattern, repl in ((" 's", "'s"), ("s ' ", "s' "), (" n't", "n't"), (" \n ", "\n"), ("\\/", "/")):
        text = text.replace(pattern, repl)
    for _ in range(10):  # " N N " needs a pass per overlapping occurrence
        text = text.replace(" N ", " 1 ")
    for pattern, repl in (("$ 1", "$1"), ("# 1", "#1"), ("<unk>", "?")):
        text = text.replace(pattern, repl)
    return text


_LM1B: list[tuple[re.Pattern | str, str]] = [
    ("http : / / ", "http://"),
    ("https : / / ", "https://"),
    (re.compile(r" '(\w+)"), r"'\1"),  # clitics
    (re.compile(r" (\w+) \. "), r" \1. "),
    (re.compile(r" (\w+) \.$"), r" \1."),
    (" ? ", "? "),
    (re.compile(r" \?$"), "?"),
    (" ! ", "! "),
    (re.compile(r" \!$"), "!"),
    (" , ", ", "),
    (" : ", ": "),
    (" ; ", "; "),
    (" / ", "/"),
    (re.compile(r"\" ([^\"]+) \""), r'"\1"'),
    (re.compile(r"' ([^']+) '"), r"'\1'"),
    (re.compile(r"\( ([^\(\)]+) \)"), r"(\1)"),
    (re.compile(r"\[ ([^\[\]]+) \]"), r"[\1]"),
    ("$ ", "$"),
    ("\u00a3 ", "\u00a3"),
]


def lm1b_detokenize(text: str) -> str:
    """LM1B -> ordinary spacing (URLs, clitics, punctuation, quotes, brackets, currency)."""
    return _apply(_LM1B, text)


DETOKENIZERS: dict[str, Callable[[str], str]] = {
    "wikitext": wikitext_detokenize,
    "ptb": ptb_detokenize,
    "lm1b": lm1b_detokenize,
}


# ------------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class HubCorpus:
    repo: str
    config: str | None
    splits: tuple[str, ...]  # the splits the dataset has
    eval_split: str  # a bare name's split when scoring (validation / evaluation)
    detokenizer: str | None = None
    text_column: str = "text"
    revision: str | None = None
    heldout: int = 0  # the first `heldout` rows of `train` are the evaluation slice (no eval split)
    streaming: bool = False  # read with datasets streaming (corpora too big to download first)


HUB_CORPORA: dict[str, HubCorpus] = {
    "openwebtext": HubCorpus(
        "Skylion007/openwebtext", None, ("train",), "train", heldout=OWT_HELDOUT, streaming=True
    ),
    "wikitext-2": HubCorpus(
        "Salesforce/wikitext", "wikitext-2-raw-v1", ("train", "validation", "test"), "test", "wikitext"
    ),
    "wikitext-103": HubCorpus(
        "Salesforce/wikitext", "wikitext-103-raw-v1", ("train", "validation", "test"), "test", "wikitext"
    ),
    "lm1b": HubCorpus(
        "billion-word-benchmark/lm1b",
        "plain_text",
        ("train", "test"),
        "test",
        "lm1b",
        revision="refs/convert/parquet",
        streaming=True,
    ),
    "text8": HubCorpus("afmck/text8", None, ("train", "validation", "test"), "test"),
}


def parse_name(spec: str) -> tuple[str, str | None]:
    """``"wikitext-103@validation"`` -> ``("wikitext-103", "validation")``; no ``@``: no split."""
    name, _, split = spec.partition("@")
    return name, (split or None)


def is_hub_corpus(spec: str) -> bool:
    return parse_name(spec)[0] in HUB_CORPORA


def resolve_repo(repo: str) -> tuple[str, bool]:
    """``(path for datasets.load_dataset, local)``: ``$MDLMPE_DS_HUB_DATASETS/repo`` when the
    variable is set (it must exist: no silent fall-back to the network), else the hub id."""
    root = os.environ.get(HUB_DATASETS_ENV)
    if not root:
        return repo, False
    local = Path(root) / repo
    if not local.is_dir():
        raise FileNotFoundError(
            f"{HUB_DATASETS_ENV}={root}: no local copy of hub dataset {repo!r} "
            f"(expected the directory {local})"
        )
    return str(local), True


@dataclass(frozen=True)
class Selection:
    """What one named corpus spec reads: a split of a hub dataset, rows [start, stop)."""

    name: str
    corpus: HubCorpus
    split: str
    start: int
    stop: int | None

    def describe(self) -> dict[str, Any]:
        c = self.corpus
        return {
            "corpus": self.name,
            "repo": c.repo,
            "config": c.config,
            "revision": c.revision,
            "split": self.split,
            "rows": [self.start, self.stop],
            "heldout": {"first_rows": c.heldout, "of_split": "train"} if c.heldout else None,
            "detokenizer": c.detokenizer,
            "text_column": c.text_column,
        }


def select(spec: str, role: str) -> Selection:
    """The split and rows that ``spec`` means in ``role`` (``train`` or ``eval``)."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}; expected one of {ROLES}")
    name, split = parse_name(spec)
    corpus = HUB_CORPORA[name]
    if split is not None and split not in (*corpus.splits, "heldout"):
        raise ValueError(f"corpus {name!r} has no split {split!r} (splits: {', '.join(corpus.splits)})")
    if corpus.heldout:
        heldout = split == "heldout" or (split is None and role == "eval")
        if heldout:
            return Selection(name, corpus, "train", 0, corpus.heldout)
        return Selection(name, corpus, "train", corpus.heldout, None)
    chosen = split or ("train" if role == "train" else corpus.eval_split)
    return Selection(name, corpus, chosen, 0, None)


def hub_rows(
    path: str,
    config: str | None,
    split: str,
    *,
    revision: str | None = None,
    streaming: bool = False,
) -> Iterator[dict]:
    """The rows of one split of a ``datasets`` dataset, in the dataset's order (shards in order,
    never shuffled). Streaming reads shard by shard; otherwise the split is downloaded and
    memory-mapped as Arrow first. Either way the rows come one at a time, in bounded memory."""
    import datasets

    ds = datasets.load_dataset(path, config, split=split, revision=revision, streaming=streaming)
    yield from ds


def selection_texts(
    sel: Selection, *, streaming: bool | None = None, max_documents: int | None = None
) -> Iterator[str]:
    """The documents of ``sel``: rows' text, detokenized, empty ones dropped; ``max_documents``
    keeps the first ones."""
    c = sel.corpus
    path, local = resolve_repo(c.repo)
    rows = hub_rows(
        path, c.config, sel.split, revision=None if local else c.revision,
        streaming=c.streaming if streaming is None else streaming,
    )  # fmt: skip
    detok = DETOKENIZERS[c.detokenizer] if c.detokenizer else None
    texts = _texts(itertools.islice(rows, sel.start, sel.stop), c.text_column, f"{sel.name} ({c.repo})")
    texts = (detok(t) if detok else t for t in texts if t and t.strip())
    return itertools.islice(texts, max_documents) if max_documents is not None else texts


def _texts(rows, column: str, what: str) -> Iterator[str]:
    for index, row in enumerate(rows):
        if column not in row:
            raise KeyError(f"{what}: row {index} has no column {column!r} ({sorted(row)})")
        yield row[column]
