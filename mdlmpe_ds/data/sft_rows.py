"""SFT chat rows: read a local json/jsonl/parquet file or a hub dataset row by row (naming the
file, line and byte offset of what cannot be read), and validate each row into messages
(``row_messages``) and (prompt turns, response) pairs (``conversation_pairs``). The row formats
are described in data/sft_encode.py; tokenising and caching are there too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal, NamedTuple

from mdlmpe_ds.data.chat_templates import Message
from mdlmpe_ds.hub.resolve import split_dataset_name

ROLES = ("system", "user", "assistant")
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
LOGGED_BAD_LINES = 20  # skipped undecodable lines named in the log; the rest are only counted


class SFTDataError(ValueError):
    """A malformed SFT row; the message names the source and the 0-based row index."""


class Malformed(Exception):
    """Internal: the reason a row is malformed, before the source/row prefix is known."""


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def _local_format(source: str) -> str | None:
    """'json' / 'parquet' for a local file source, None for a hub name. Missing file -> error."""
    path = Path(source)
    fmt = LOCAL_FORMATS.get(path.suffix.lower())
    if fmt is None:
        if path.is_file():
            raise ValueError(
                f"{source}: unsupported SFT file type {path.suffix!r}; use .json, .jsonl or .parquet"
            )
        return None
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file not found: {source}")
    return fmt


def load_sft_rows(source: str | Path, split: str = "train") -> Any:
    """The raw rows of ``source`` as a ``datasets.Dataset``.

    ``source`` is a local ``.json``/``.jsonl``/``.parquet`` file (``FileNotFoundError`` naming the path
    if it is missing), a local dataset directory, or a hub dataset name (e.g.
    ``allenai/tulu-3-sft-mixture``, ``HuggingFaceTB/smoltalk``; needs network or a populated cache).
    """
    import datasets  # imported here: loading it is slow and only data preparation needs it

    source = str(source)
    fmt = _local_format(source)
    if fmt is not None:
        return datasets.load_dataset(fmt, data_files={split: source}, split=split)

    name, config = split_dataset_name(source)  # "HuggingFaceTB/smoltalk:all" names config "all"
    return datasets.load_dataset(name, config, split=split)


class BadLine(NamedTuple):
    """Internal: a unit of a local JSON file that cannot become a row (bytes that are not UTF-8, text
    that is not JSON). ``build_sft_dataset`` fails on it naming the file, row and line, or, with
    ``skip_malformed``, skips and counts it under ``kind`` like any malformed row."""

    line: int | None  # 1-based line of the file (None: a row of a JSON array, whose line is unknown)
    kind: str  # the skip reason counted in SFTDataStats.skip_reasons
    detail: str  # the rest of the error message, e.g. "is not valid JSON (Expecting value: ...)"


_UTF8_BOM = b"\xef\xbb\xbf"


def _json_rows(path: str) -> Iterator[Any]:
    """Rows of a local .json / .jsonl file, parsed here rather than by ``datasets``.

    ``datasets`` (pyarrow) fails a whole file on one line that is not JSON, names no line for bytes
    that are not UTF-8 (and may only fail later, while rows are iterated), and cannot skip either.
    Parsing here names the line, lets ``skip_malformed`` skip exactly that line, streams (memory
    does not grow with the file) and writes no Arrow copy of the file to the datasets cache.

    - JSON Lines (.jsonl, or a .json whose first character is not '['): each non-blank line is
      one row; a line that is not UTF-8 or not JSON is yielded as a ``BadLine``. Lines are split
      on b"\\n" only (JSON strings may hold U+2028 and friends, which ``str.splitlines`` splits on).
    - A JSON array: one document, parsed whole. If it is not valid JSON it cannot be cut into rows,
      so that is an error even with ``skip_malformed``. Bytes that are not UTF-8 are decoded with
      ``surrogateescape`` so the rest parses, and each row holding such bytes is a ``BadLine``.
    """
    with open(path, "rb") as f:
        lines = enumerate(f, start=1)
        offset = 0  # byte offset of the current line in the file
        for line_no, raw in lines:  # up to the first non-blank line, which tells the layout
            if line_no == 1 and raw.startswith(_UTF8_BOM):
                offset, raw = len(_UTF8_BOM), raw[len(_UTF8_BOM) :]
            if raw.strip():
                break
            offset += len(raw)
        else:
            return  # only blank lines: no rows
        if raw.lstrip().startswith(b"["):
            yield from _json_array_rows(path, raw + f.read(), line_no, offset)
            return
        first = _json_line(raw, line_no, offset)
        if isinstance(first, BadLine) and raw.lstrip().startswith(b"{"):
            _refuse_one_object(path, raw + f.read())
        yield first
        offset += len(raw)
        for line_no, raw in lines:
            if raw.strip():
                yield _json_line(raw, line_no, offset)
            offset += len(raw)


def first_json_problem(path: str | Path) -> str | None:
    """The first reason a local .json / .jsonl file cannot be read as rows ("line 3 is not valid
    JSON (column 1: ...)"), or None: for naming the line where ``datasets`` fails a whole file
    with "An error occurred while generating the dataset" (pretraining corpora)."""
    try:
        for row in _json_rows(str(path)):
            if isinstance(row, BadLine):
                return f"{'a row' if row.line is None else f'line {row.line}'} {row.detail}"
    except SFTDataError as err:
        return str(err).removeprefix(f"{path}: ")
    return None


def _refuse_one_object(path: str, data: bytes) -> None:
    """A JSON Lines file whose first line is not JSON may be one pretty-printed object: say so
    (naming a key that holds the rows, if one does) instead of "row 0 is not valid JSON"."""
    try:
        whole = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return  # not one object either: the first line's own error stands
    if not isinstance(whole, dict):
        return
    lists = [k for k, v in whole.items() if isinstance(v, list) and v and isinstance(v[0], dict)]
    hint = f" (its key {lists[0]!r} holds a list of objects: write those out, one per line)" if lists else ""
    raise SFTDataError(
        f"{path}: one JSON object spread over several lines, not rows{hint}. A .json/.jsonl SFT file "
        "holds one row per line (JSON Lines) or an array of rows ([{...}, {...}])"
    )


def _json_line(raw: bytes, line_no: int, offset: int) -> Any:
    """One JSON Lines row from the bytes of line ``line_no`` (starting at byte ``offset``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"byte 0x{raw[e.start]:02x} at byte offset {offset + e.start} of the file"
        return BadLine(line_no, "not valid UTF-8", f"is not valid UTF-8 ({where})")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return BadLine(line_no, "not valid JSON", f"is not valid JSON (column {e.pos + 1}: {e.msg})")


def _json_array_rows(path: str, data: bytes, first_line: int, offset: int) -> Iterator[Any]:
    """The rows of a JSON array (``data``: the file's bytes from line ``first_line``, byte ``offset``)."""
    bad_utf8 = None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        bad_utf8 = f"byte 0x{data[e.start]:02x} at line {line}, byte offset {offset + e.start} of the file"
        text = data.decode("utf-8", errors="surrogateescape")  # invalid bytes -> lone surrogates
        # (rows holding one are found after parsing: their JSON text is not valid Unicode)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        note = f"; it also holds bytes that are not UTF-8 (first: {bad_utf8})" if bad_utf8 else ""
        raise SFTDataError(
            f"{path}: not valid JSON (line {first_line + e.lineno - 1}, column {e.colno}: {e.msg}){note}"
        ) from None
    if not isinstance(rows, list):
        raise SFTDataError(f"{path}: a JSON file starting with '[' must be an array of rows")
    for row in rows:
        if bad_utf8 is not None and _not_unicode(json.dumps(row, ensure_ascii=False)):
            detail = f"holds bytes that are not valid UTF-8 (the file's first: {bad_utf8})"
            yield BadLine(None, "not valid UTF-8", detail)
        else:
            yield row


class Located(NamedTuple):
    """One raw row and where it came from: the file (or hub name) and its 0-based row there."""

    origin: str
    index: int
    row: Any


DEFAULT_SPLIT = "train"  # the split of a single file; --dataset_split's default
#: Row formats this reader does not take: a directory file of one of these is refused by name, since
#: it most likely holds training rows. Other files (notes.md, LICENSE) are named in the log as not read.
UNREAD_ROW_FORMATS = (".csv", ".tsv", ".arrow", ".feather", ".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4")
NAMED_FILES = 20  # files named one by one in the log line of a directory; the rest are counted


class LocalFiles(NamedTuple):
    """The local files a source names for one split, and what else a directory holds: the log line
    names them all, so no file of the directory is left out without a word."""

    source: str
    split: str
    files: list[Path]  # read, in this order
    other_splits: dict[str, list[Path]]  # a directory's files of the other splits
    not_read: list[Path]  # a directory's files that are not SFT data (notes, licences)

    def describe(self) -> str:
        """One log line: the files read, then those of other splits and those not read."""
        root = Path(self.source) if Path(self.source).is_dir() else Path(self.source).parent
        parts = [f"split {self.split!r} reads {_named(self.files, root)}"]
        parts += [f"split {s!r} (not read): {_named(f, root)}" for s, f in sorted(self.other_splits.items())]
        if self.not_read:
            parts.append(f"not .json/.jsonl/.parquet (not read): {_named(self.not_read, root)}")
        return f"SFT data {self.source}: " + "; ".join(parts)


def _named(paths: Sequence[Path], root: Path) -> str:
    """'3 files: a.jsonl, b.jsonl, c.parquet' relative to ``root``, the first ``NAMED_FILES`` named."""
    names = [str(p.relative_to(root)) if p.is_relative_to(root) else str(p) for p in paths]
    more = f", and {len(names) - NAMED_FILES} more" if len(names) > NAMED_FILES else ""
    return f"{len(names)} file{'s' * (len(names) != 1)}: {', '.join(names[:NAMED_FILES])}{more}"


def _has_card_configs(directory: str) -> bool:
    """True when the directory's README (or .huggingface.yaml) lists ``configs``: that listing is the
    author's explicit choice of files per config and split, and is followed as ``datasets`` reads it."""
    import datasets

    module = datasets.load.dataset_module_factory(directory)
    return bool(module.builder_configs_parameters.metadata_configs)


def _card_splits(directory: str, config: str | None) -> dict[str, list[Path]]:
    """split -> files of a directory whose card lists configs (or a config is named), as ``datasets``
    resolves them (every data format the patterns match; none is dropped for another)."""
    import datasets

    data_files = datasets.load_dataset_builder(directory, config).config.data_files or {}
    return {str(k): sorted(Path(f) for f in v) for k, v in data_files.items()}


def _pattern_splits(directory: str) -> tuple[dict[str, list[Path]], list[Path]]:
    """(split -> files, every file) of a directory without a card's configs, by ``datasets``' own
    split-name patterns (train*/test*/validation* names or folders, data/train-00000-of-00001.*;
    every file is train when no name says a split).

    Why not the builder's ``data_files``: ``datasets`` then keeps only the directory's most common
    format, so a.jsonl beside b.parquet was never read and nothing said so."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    resolve = partial(DataFilesDict.from_patterns, base_path=directory)
    splits = resolve(get_data_patterns(directory))
    every = resolve({"all": ["**"]})["all"]
    return {str(k): sorted(Path(f) for f in v) for k, v in splits.items()}, sorted(Path(f) for f in every)


def _readable(path: Path) -> bool:
    return path.suffix.lower() in LOCAL_FORMATS


def _row_format(path: Path) -> bool:
    return path.suffix.lower() in UNREAD_ROW_FORMATS


def _unassigned(directory: str, splits: dict[str, list[Path]], every: list[Path]) -> list[Path]:
    """The directory's files that no split takes (notes, licences: named in the log as not read).
    A file of rows among them (more_chats.jsonl beside train.jsonl and test.jsonl) no run would ever
    read, so it is refused by name rather than trained without."""
    assigned = {f for files in splits.values() for f in files}
    unassigned = [f for f in every if f not in assigned]
    orphans = [f for f in unassigned if _readable(f) or _row_format(f)]
    if orphans:
        names = ", ".join(str(f.relative_to(directory)) for f in orphans)
        one = len(orphans) == 1
        raise SFTDataError(
            f"{directory}: {names} {'belongs' if one else 'belong'} to no split: the other files' "
            f"names set the splits ({', '.join(sorted(splits))}), so no run would read "
            f"{'it' if one else 'them'}. Rename each to carry its split (e.g. train_more_chats.jsonl) "
            "or move it out of the directory"
        )
    return unassigned


def _saved_dataset_hint(directory: Path) -> str:
    """How to convert a ``datasets`` ``save_to_disk`` folder (Arrow shards beside state.json and
    dataset_info.json), which users often have at hand, into files this reader takes."""
    if not ((directory / "state.json").is_file() and (directory / "dataset_info.json").is_file()):
        return ""
    return (
        f'. It is a datasets save_to_disk folder: write it as parquet, e.g. python -c "import datasets; '
        f"datasets.load_from_disk('{directory}').to_parquet('{directory}.parquet')\", and pass that file"
    )


def local_data_files(directory: str | Path, split: str, config: str | None = None) -> LocalFiles:
    """The files of ``split`` (of ``config``) in a local dataset directory, and what else it holds.

    The split follows ``datasets``: a card's (README) ``configs`` listing, else its split-name
    patterns (every file trains when no name says a split). Unlike ``datasets``, no file is dropped
    without a word: every .json/.jsonl/.parquet file of the split is read whatever the others'
    format; a file of rows that no split takes, or of a format this reader does not take, is refused
    by name; other files (notes.md) are named in the log line (``LocalFiles.describe``).

    Why not ``datasets.load_dataset(directory)``: its JSON reader coerces a row whose field has
    another type than the shard's first rows (a content of 5 among strings) by JSON-encoding the
    whole shard's values, so every row of that shard trains on quoted text, and a line that is not
    JSON fails the build naming no file or line. Read file by file here, a bad row is named."""
    directory = Path(directory).expanduser().resolve().as_posix()
    try:
        if config is not None or _has_card_configs(directory):
            splits, every = _card_splits(directory, config), []
        else:
            splits, every = _pattern_splits(directory)
    except (FileNotFoundError, ValueError) as e:
        raise SFTDataError(f"{directory}: not a readable dataset directory ({e})") from None
    if split not in splits:
        found = ", ".join(sorted(splits)) or "none"
        raise SFTDataError(
            f"{directory}: no files of split {split!r} in the directory (splits found: {found})"
        )
    unassigned = _unassigned(directory, splits, every)
    chosen = splits[split]
    refused = [p for p in chosen if _row_format(p) or not any(map(_readable, chosen))]
    if refused:
        names = ", ".join(str(p.relative_to(directory)) for p in refused)
        raise SFTDataError(
            f"{directory}: unsupported SFT file type in the directory: {names} "
            "(use .json, .jsonl or .parquet files, or move these out of the directory)"
            + _saved_dataset_hint(Path(directory))
        )
    others = {s: files for s, files in splits.items() if s != split}
    not_read = sorted([p for p in chosen if not _readable(p)] + unassigned)
    return LocalFiles(directory, split, [p for p in chosen if _readable(p)], others, not_read)


def local_selection(source: str | Path, split: str) -> LocalFiles | None:
    """What ``source`` names for ``split``: a .json/.jsonl/.parquet file itself, or a local directory's
    files (``local_data_files``; "DIR:all" names config "all" of it); None for a hub dataset.

    A single file has no splits: a ``split`` other than the default is refused naming the file and
    the flag, since reading the whole file as "validation" would train on rows the user meant to
    hold out (``datasets`` would call any split of one file by the name asked)."""
    source = str(source)
    name, config = split_dataset_name(source)
    if Path(name).is_dir():
        return local_data_files(name, split, config)
    if _local_format(source) is None:
        return None
    if split != DEFAULT_SPLIT:
        raise SFTDataError(
            f"{source}: --dataset_split {split!r} (data.split) cannot apply to a single file: it has "
            f"no splits, all its rows are split {DEFAULT_SPLIT!r}. Leave --dataset_split at "
            f"{DEFAULT_SPLIT!r} to train on this file, or name a directory whose file names carry "
            f"the split (e.g. {split}.jsonl) or a hub dataset with that split"
        )
    return LocalFiles(source, split, [Path(source)], {}, [])


def local_files(source: str | Path, split: str) -> list[Path] | None:
    """The local files read for ``split`` of ``source`` (``local_selection``); None for a hub dataset."""
    selection = local_selection(source, split)
    return None if selection is None else selection.files


def iter_rows(source: str | Path, split: str, files: Sequence[Path] | None = None) -> Iterator[Located]:
    """Rows of ``source`` with their origin: local JSON files through ``_json_rows``, local parquet
    through ``datasets`` one file at a time, a local directory file by file (``local_data_files``),
    a hub dataset through ``datasets``. ``files``: ``local_files(source, split)`` when the caller
    already has it (the files it keyed its cache by are then exactly the files read).

    A local file of 0 bytes is an error naming it (``datasets`` gives "generator raised
    StopIteration" for it)."""
    source = str(source)
    files = local_files(source, split) if files is None else files
    if files is None:
        for index, row in enumerate(load_sft_rows(source, split)):
            yield Located(source, index, row)
        return
    for path in map(str, files):
        if os.path.getsize(path) == 0:
            raise SFTDataError(f"{path}: the file is empty (0 bytes)")
        if _local_format(path) == "json":
            rows: Iterator[Any] = _json_rows(path)
        else:
            _check_parquet(path)
            rows = iter(load_sft_rows(path, split))
        for index, row in enumerate(rows):
            yield Located(path, index, row)


def _check_parquet(path: str) -> None:
    """Read a local parquet file's footer before ``datasets`` does: it reports a truncated file
    without naming it, and fails on a file with no rows ("BatchSize must be greater than 0")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError) as e:
        raise SFTDataError(f"{path}: not a readable parquet file, truncated or corrupt? ({e})") from e
    if rows == 0:
        raise SFTDataError(f"{path}: no rows (the parquet file holds none)")


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _type_name(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def _not_unicode(text: str) -> bool:
    """True for a string holding a lone surrogate: JSON allows escapes such as "\\ud800", but no
    tokenizer takes them (a TypeError naming no row)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_LONE_SURROGATE = "is not valid Unicode (a lone surrogate such as \\ud800)"


def row_messages(row: Any) -> list[Message]:
    """The validated ``messages`` of one row (``prompt``/``response`` rows are converted).

    Raises ``Malformed`` with the reason: missing keys, unknown roles, non-string content, an empty
    assistant turn, a dialogue that does not end with an assistant turn.
    """
    if not isinstance(row, dict):
        raise Malformed(f"row is {_type_name(row)}, expected an object")
    if row.get("messages") is not None:
        raw = row["messages"]
        if not isinstance(raw, list):
            raise Malformed(f"'messages' is {_type_name(raw)}, expected a list")
        if not raw:
            raise Malformed("'messages' is empty")
        messages = []
        for k, m in enumerate(raw):
            if not isinstance(m, dict):
                raise Malformed(f"message {k} is {_type_name(m)}, expected an object with role and content")
            role, content = m.get("role"), m.get("content")
            if role is None:
                raise Malformed(f"message {k} has no 'role'")
            if not isinstance(role, str) or role not in ROLES:
                expected = ", ".join(ROLES)
                raise Malformed(f"message {k} has unknown role {role!r} (expected one of {expected})")
            if content is None:
                raise Malformed(f"message {k} ({role}) has no 'content'")
            if not isinstance(content, str):
                raise Malformed(f"message {k} ({role}) content is {_type_name(content)}, expected a string")
            if _not_unicode(content):
                raise Malformed(f"message {k} ({role}) content {_LONE_SURROGATE}")
            if role == "assistant" and not content.strip():
                raise Malformed(f"message {k} (assistant) is empty")
            messages.append({"role": role, "content": content})
        if messages[-1]["role"] != "assistant":
            last = messages[-1]["role"]
            raise Malformed(f"last message is {last!r}, expected an assistant turn to train on")
        return messages
    if row.get("prompt") is not None or row.get("response") is not None:
        prompt, response, system = row.get("prompt"), row.get("response"), row.get("system")
        for key, value in (("prompt", prompt), ("response", response)):
            if not isinstance(value, str):
                raise Malformed(f"'{key}' is {_type_name(value)}, expected a string")
        if not response.strip():
            raise Malformed("'response' is empty")
        if system is not None and not isinstance(system, str):
            raise Malformed(f"'system' is {_type_name(system)}, expected a string")
        for key, value in (("prompt", prompt), ("response", response), ("system", system or "")):
            if _not_unicode(value):
                raise Malformed(f"'{key}' {_LONE_SURROGATE}")
        messages = [{"role": "system", "content": system}] if system else []
        return [*messages, {"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    raise Malformed(f"row has neither 'messages' nor 'prompt'/'response' (keys: {sorted(row)})")


MULTITURN = ("last", "expand", "sample")


def conversation_pairs(
    messages: Sequence[Message], multiturn: Literal["last", "expand", "sample"] = "last", draw: int = 0
) -> list[tuple[list[Message], Message]]:
    """(earlier turns, assistant turn) pairs to train on: the last one, one per assistant turn, or
    the one at assistant turn ``draw % (number of assistant turns)`` for ``"sample"``."""
    if multiturn == "last":
        return [(list(messages[:-1]), messages[-1])]
    pairs = [(list(messages[:k]), m) for k, m in enumerate(messages) if m["role"] == "assistant"]
    if multiturn == "expand":
        return pairs
    if multiturn == "sample":
        return [pairs[draw % len(pairs)]]
    raise ValueError(f"multiturn must be one of {MULTITURN}, got {multiturn!r}")
