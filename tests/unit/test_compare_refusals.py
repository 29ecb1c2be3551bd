"""launch/compare_pe.py refuses, before the first training, what would waste all of them (probe
round): a forwarded --output_dir / --seed / --position_encoding that compare's own flags silently
replaced, a repeated seed scored as a second sample, and a misspelled corpus or an evaluation window
longer than the runs, both found only after all the trainings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def compare_pe(monkeypatch):
    """The launcher, with training and scoring replaced by failures: every refusal must come first."""
    from mdlmpe_ds.experiments import compare

    monkeypatch.setattr(compare, "train_all", lambda *a, **k: pytest.fail("a run was trained"))
    monkeypatch.setattr(compare, "evaluate_all", lambda *a, **k: pytest.fail("a run was scored"))
    spec = importlib.util.spec_from_file_location(
        "launch_compare_pe_refusals", REPO / "launch" / "compare_pe.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _refusal(compare_pe, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        compare_pe.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "forwarded, expected",
    [
        (["--output_dir", "mine"], "train.output_dir (--output_dir mine): use compare's --out"),
        (["--train.seed", "7"], "train.seed (--seed 7): use compare's --seeds"),
        (
            ["--position_encoding", "rope"],
            "model.position_encoding (--position_encoding rope): use compare's --encodings",
        ),
        (["--resume", "never"], "--resume never: compare resumes every run itself (--resume auto)"),
    ],
)
def test_keys_compare_sets_itself_are_refused_when_forwarded(
    compare_pe, capsys, tmp_path, forwarded, expected
):
    argv = ["--encodings", "rope", "--seeds", "0", "--out", str(tmp_path), "--dry-run", *forwarded]
    err = _refusal(compare_pe, argv, capsys)
    assert "compare sets these itself for every run: " in err and expected in err


def test_a_repeated_seed_or_encoding_is_refused(compare_pe, capsys, tmp_path):
    """--seeds 0 0 trained one run and scored it twice: mean ± std over n=2 of one model."""
    err = _refusal(compare_pe, ["--encodings", "rope", "--seeds", "0", "0", "--out", str(tmp_path)], capsys)
    assert "--seeds 0 0: 0 given more than once; each value is one matched run" in err
    err = _refusal(
        compare_pe, ["--encodings", "rope", "mdlmpe", "rope", "--seeds", "1", "--out", str(tmp_path)], capsys
    )
    assert "--encodings rope mdlmpe rope: rope given more than once" in err


def test_a_misspelled_corpus_or_a_too_long_window_is_refused_before_training(compare_pe, capsys, tmp_path):
    base = ["--encodings", "rope", "--seeds", "0", "--out", str(tmp_path)]
    err = _refusal(compare_pe, [*base, "--corpora", "ptb", "shakespeare-heldou"], capsys)
    assert "--corpora: corpus 'shakespeare-heldou' is not a named corpus" in err
    assert "Did you mean 'shakespeare-heldout'" in err
    err = _refusal(compare_pe, [*base, "--seq_len", "4096"], capsys)  # the demo trains max_len 128
    assert "--seq_len 4096 is longer than the runs' training length 128 (data.max_len)" in err
    assert "use --seq_len 128 or less" in err
    # The limit is the length the runs will train with, as launch/pretrain.py reads the flags.
    assert compare_pe.main([*base, "--seq_len", "256", "--max_len", "512", "--dry-run"]) == 0


def test_a_valid_command_still_plans(compare_pe, capsys, tmp_path):
    argv = [
        "--encodings",
        "rope",
        "--seeds",
        "0",
        "1",
        "--seq_len",
        "64",
        "--out",
        str(tmp_path),
        "--dry-run",
    ]
    assert compare_pe.main(argv) == 0
    assert "[compare] rope seed 1:" in capsys.readouterr().out
