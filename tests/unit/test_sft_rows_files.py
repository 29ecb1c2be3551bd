"""Which files an SFT source reads: a directory's files are all read or refused by name (never left
out by `datasets`' format vote or split patterns), a single file has no split to choose, and a run
whose examples are dropped or cut for length says how many, how long they are and which flag to
change. Real `datasets`, real files in tmp_path, the smoke word-level tokenizer."""

from __future__ import annotations

import json
import logging

import pytest

from mdlmpe_ds.config.cli import build_config
from mdlmpe_ds.data.sft_encode import build_sft_dataset
from mdlmpe_ds.data.sft_rows import SFTDataError
from mdlmpe_ds.data.smoke import make_chat, make_tokenizer

ROW = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi !"}]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tokenizer(tmp_path_factory.mktemp("tok")))


def _jsonl(path, rows: int):
    path.write_text((json.dumps(ROW) + "\n") * rows)
    return path


def _build(source, tokenizer, **kw):
    return build_sft_dataset(str(source), tokenizer, "dream", max_len=64, **kw)


def test_a_directory_of_jsonl_and_parquet_reads_both_and_names_them(tmp_path, tokenizer, caplog):
    """`datasets` kept only the parquet file (its format vote) and said nothing: 2 of 5 rows."""
    import datasets

    data = tmp_path / "mixed"
    data.mkdir()
    _jsonl(data / "a.jsonl", 3)
    datasets.Dataset.from_list([ROW, ROW]).to_parquet(str(data / "b.parquet"))
    (data / "notes.md").write_text("how these chats were collected\n")
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="mdlmpe_ds.data.sft_encode"):
        built, stats = _build(data, tokenizer, cache_dir=cache)
    assert stats.rows == 5 and len(built) == 5
    assert (
        "split 'train' reads 2 files: a.jsonl, b.parquet; not .json/.jsonl/.parquet (not read): "
        in caplog.text
    )
    assert "(not read): 1 file: notes.md" in caplog.text
    _jsonl(data / "a.jsonl", 4)  # the jsonl is keyed too: an edit is another cache entry
    again, _ = _build(data, tokenizer, cache_dir=cache)
    assert len(again) == 6 and len(list(cache.glob("sft-*.npz"))) == 2


def test_a_file_that_no_split_takes_is_refused_by_name(tmp_path, tokenizer, caplog):
    """train.jsonl + more_chats.jsonl + test.jsonl: `datasets` read train.jsonl alone for train."""
    data = tmp_path / "splits"
    data.mkdir()
    for name, rows in (("train.jsonl", 2), ("more_chats.jsonl", 3), ("test.jsonl", 1)):
        _jsonl(data / name, rows)
    with pytest.raises(
        SFTDataError, match=r"splits: more_chats\.jsonl belongs to no split: .*\(test, train\)"
    ):
        _build(data, tokenizer)
    (data / "more_chats.jsonl").rename(data / "train_more_chats.jsonl")
    with caplog.at_level(logging.INFO, logger="mdlmpe_ds.data.sft_encode"):
        built, _ = _build(data, tokenizer)
    assert len(built) == 5
    assert (
        "reads 2 files: train.jsonl, train_more_chats.jsonl; split 'test' (not read): 1 file: test.jsonl"
        in (caplog.text)
    )
    test, _ = _build(data, tokenizer, split="test")
    assert len(test) == 1


def test_a_csv_of_rows_in_the_directory_is_refused_by_name(tmp_path, tokenizer):
    """A minority format was dropped by `datasets`' vote; this reader cannot take it, so it says so."""
    data = tmp_path / "with_csv"
    data.mkdir()
    _jsonl(data / "a.jsonl", 2)
    _jsonl(data / "b.jsonl", 2)
    (data / "extra.csv").write_text("prompt,response\nhello,hi\n")
    with pytest.raises(SFTDataError, match=r"unsupported SFT file type in the directory: extra\.csv"):
        _build(data, tokenizer)


def test_a_save_to_disk_folder_is_refused_with_the_conversion_that_works(tmp_path, tokenizer):
    """A `datasets` save_to_disk folder (Arrow shards) is refused, and the command the message
    gives turns it into a parquet file that trains."""
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_list([ROW] * 3).save_to_disk(str(saved))
    with pytest.raises(SFTDataError, match=r"\.arrow.*save_to_disk folder") as err:
        _build(saved, tokenizer)
    command = str(err.value).split('python -c "')[1].split('"')[0]
    exec(command)  # what the message tells the user to run
    assert len(_build(tmp_path / "saved.parquet", tokenizer)[0]) == 3


def test_a_split_other_than_train_on_one_file_is_refused(tmp_path, tokenizer):
    """--dataset_split validation on chat.jsonl trained on the whole file."""
    chat = _jsonl(tmp_path / "chat.jsonl", 2)
    with pytest.raises(
        SFTDataError, match=r"chat\.jsonl: --dataset_split 'validation' \(data\.split\) cannot"
    ):
        _build(chat, tokenizer, split="validation")
    assert len(_build(chat, tokenizer, split="train")[0]) == 2


def _run_data(tmp_path, tokenizer, max_len: int):
    """The SFT run's data step on the smoke chat file (48 rows, 10 of them two-turn) at ``max_len``."""
    from mdlmpe_ds.runs.sft_run import build_sft_data

    chat = make_chat(tmp_path / "chat.jsonl", rows=48)
    args = ["--dataset", str(chat), "--max_len", str(max_len), "--output_dir", str(tmp_path / "out")]
    return build_sft_data(build_config(None, args), str(chat), tokenizer, "dream")


def test_every_example_too_long_names_the_counts_lengths_and_flag(tmp_path, tokenizer):
    with pytest.raises(ValueError) as err:
        _run_data(tmp_path, tokenizer, 8)
    message = str(err.value)
    assert "no usable SFT examples: all 48 examples (48 rows) were dropped as too long" in message
    assert "prompts alone fill --max_len 8" in message
    assert "the longest example is 39 tokens, the median 26" in message
    assert "raise --max_len (data.max_len, now 8; 39 keeps every example whole)" in message


def test_a_large_share_dropped_or_cut_is_a_warning_with_the_counts(tmp_path, tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="mdlmpe_ds.runs.sft_run"):
        short, _ = _run_data(tmp_path / "short", tokenizer, 24)
        fits, _ = _run_data(tmp_path / "long", tokenizer, 64)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # none at max_len 64, where every example fits whole
    assert "48 rows -> 38 examples (19 truncated, 10 dropped as too long" in warnings[0]
    assert "10 of 48 examples dropped: the prompt alone fills --max_len 24" in warnings[0]
    assert (
        "19 of 48 answers cut at --max_len 24 (to as few as 3 answer tokens), without their end of turn"
        in (warnings[0])
    )
    assert "the longest example is 39 tokens, the median 26: raise --max_len" in warnings[0]
    assert (len(short), len(fits)) == (38, 48)
