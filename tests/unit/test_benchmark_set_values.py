"""``launch/benchmark.py --set``: values the sampler or the adapter would refuse are refused by the
plan (dry run and real run), naming the key, before any model is resolved or loaded. Before, the dry
run printed "~0 forwards" for ``steps=0`` and the real run failed at the first model load."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is the optional 'eval' extra")
REPO = Path(__file__).resolve().parents[2]
MODELS = ["GSAI-ML/LLaDA-8B-Instruct", "GSAI-ML/LLaDA-8B-Base"]  # hub names: the dry run reads nothing


def _cli():
    spec = importlib.util.spec_from_file_location("benchmark_set_cli", REPO / "launch" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def offline(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


BAD = [
    (["gen_length=-5", "steps=0"], "--set gen_length=-5: must be >= 1"),
    (["steps=0"], "--set steps=0: must be >= 1"),
    (["gen_length=abc"], "--set gen_length='abc': expected a whole number"),
    (["algorithm=bogus"], "--set algorithm='bogus': unknown sampling algorithm"),
    (["top_p=5"], "--set top_p=5.0: must be in (0, 1]"),
    (["mc_num=0"], "--set mc_num=0: must be >= 1"),
    (["gen_length=5"], "(llada decoding with --set): gen_length=5 is not a multiple of block_length=256"),
    (["gen_length=4", "block_length=2", "steps=3"], "steps=3 must be a positive multiple of the 2 blocks"),
]


@pytest.mark.parametrize("values, message", BAD)
def test_dry_run_refuses_set_values_the_sampler_would_refuse(values, message, tmp_path, offline, capsys):
    rc = _cli().main([*MODELS, "--set", *values, "--dry-run", "--out", str(tmp_path / "t")])
    captured = capsys.readouterr()
    assert rc == 2 and message in captured.err, captured.err
    assert "forwards" not in captured.out  # no plan printed


@pytest.mark.parametrize("values, message", [BAD[0], BAD[6]])
def test_real_run_refuses_them_before_any_model_loads(
    values, message, tmp_path, offline, monkeypatch, capsys
):
    from mdlmpe_ds.evaluation.benchmark import cache, session

    monkeypatch.setattr(
        cache, "resolve_hub", lambda path, name=None, family=None: cache.describe_model(path, name, family)
    )

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(session, "_load", no_load)
    rc = _cli().main([*MODELS, "--set", *values, "--out", str(tmp_path / "t"), "--no_progress"])
    assert rc == 2 and message in capsys.readouterr().err


def test_good_set_values_still_plan(tmp_path, offline, capsys):
    rc = _cli().main(
        [*MODELS, "--set", "gen_length=4", "block_length=4", "steps=1", "mc_num=2", "--dry-run",
         "--out", str(tmp_path / "t")]
    )  # fmt: skip
    assert rc == 0 and "forwards" in capsys.readouterr().out
