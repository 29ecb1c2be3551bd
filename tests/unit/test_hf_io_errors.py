"""Damaged checkpoint files (an interrupted export or copy): the error names the file.

safetensors' own errors ("invalid header length", "incomplete metadata, file not fully covered")
and json's ("Expecting value: line 1 column 1") name no file, which leaves the user to guess which
of a directory's shards is broken.
"""

from __future__ import annotations

import re

import pytest
import torch

from mdlmpe_ds.evaluation.loading import load_model
from mdlmpe_ds.models import DiffusionLM, preset
from mdlmpe_ds.models.hf_config import CheckpointError
from mdlmpe_ds.models.hf_io import INDEX_NAME, load_pretrained, save_pretrained


def _save(path, sharded: bool) -> list:
    torch.manual_seed(0)
    config = preset("llada-tiny", position_encoding="rope")
    return save_pretrained(DiffusionLM(config), path, config, max_shard_bytes=40_000 if sharded else 1 << 30)


def _truncate(file, keep: int) -> None:
    """Keep the first ``keep`` bytes (``keep`` < 0: all but the last ``-keep``), as a cut-off copy."""
    file.write_bytes(file.read_bytes()[:keep])


@pytest.mark.parametrize("keep", [5, 100, -1000], ids=["header-length", "header", "data"])
def test_truncated_single_file_is_named(tmp_path, keep):
    _save(tmp_path, sharded=False)
    file = tmp_path / "model.safetensors"
    _truncate(file, keep)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(file))}: cannot read this safetensors file"):
        load_pretrained(tmp_path)
    # The inference loader (launch/generate.py, launch/evaluate.py) goes through the same reader.
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*truncated or corrupt"):
        load_model(tmp_path)


def test_truncated_shard_is_named(tmp_path):
    shards = [f for f in _save(tmp_path, sharded=True) if f.suffix == ".safetensors"]
    assert len(shards) > 3 and (tmp_path / INDEX_NAME).is_file()
    broken = shards[2]
    _truncate(broken, -100)
    with pytest.raises(
        CheckpointError, match=rf"{re.escape(str(broken))}: cannot read .*\({broken.stat().st_size} bytes\)"
    ):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["config.json", INDEX_NAME])
def test_truncated_json_is_named(tmp_path, name):
    _save(tmp_path, sharded=True)
    _truncate(tmp_path / name, 40)
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: not valid JSON"):
        load_pretrained(tmp_path)


def test_a_moved_tokenizer_directory_is_named(tmp_path):
    """A run's recorded tokenizer directory that was moved gave transformers' "Repo id must be in
    the form 'repo_name'" error; it is now named as a missing directory."""
    from mdlmpe_ds.evaluation.loading import load_tokenizer

    with pytest.raises(FileNotFoundError, match=r"the tokenizer directory .*moved_tok does not exist"):
        load_tokenizer(str(tmp_path / "moved_tok"))


def test_a_second_evaluation_keeps_the_first_ones_results(tmp_path):
    """launch/evaluate.py without --out wrote outputs/eval/perplexity.{md,json} over the previous
    evaluation's: they are kept beside it with their time."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "launch" / "evaluate.py"
    spec = importlib.util.spec_from_file_location("evaluate_cli", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    prefix = tmp_path / "perplexity"
    for suffix in (".md", ".json"):
        prefix.with_suffix(suffix).write_text("first" + suffix)
    cli.keep_earlier(prefix)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert len(kept) == 2 and all(name.startswith("perplexity-") for name in kept)
    assert {p.read_text() for p in tmp_path.iterdir()} == {"first.md", "first.json"}
    cli.keep_earlier(prefix)  # nothing there: nothing moved
    assert len(list(tmp_path.iterdir())) == 2
