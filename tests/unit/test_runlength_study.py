"""The run-length study's instruments: the task is what it claims, arms are matched, knockouts do
what they say, the decision rule is coded as the README states it, and --toy runs and resumes."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from mdlmpe_ds.experiments import runlength_report as report
from mdlmpe_ds.experiments.knockout import knockout, mdlmpe_off
from mdlmpe_ds.experiments.layout_probe import probe_layout
from mdlmpe_ds.experiments.runlength_arms import ARMS, build_arm
from mdlmpe_ds.experiments.runlength_data import GEOMETRIES, SEP, layout_blind_entropy, make_batch
from mdlmpe_ds.experiments.runlength_train import area_log_ce, updates_to

L64 = GEOMETRIES["L64-K8"]


def test_the_layout_gives_the_answer_under_run_masking():
    """At every scored token the masked stretch between visible tokens has the run's length (Bayes
    CE 0); SEPs are never masked; runs cut by the row end are never scored."""
    batch = make_batch(L64, "runs", 64, torch.Generator().manual_seed(0))
    scored = batch.scored
    assert scored.sum() > 500
    assert torch.equal(batch.gap[scored], batch.run_length[scored])
    assert torch.equal(batch.clean[scored], batch.run_length[scored])  # token L_k is id k
    assert bool((batch.ids[batch.clean == SEP] == SEP).all())
    for row in range(64):
        last_sep = int((batch.clean[row] == SEP).nonzero().max())
        if last_sep < L64.length - 1:  # the row ends inside a run
            assert not batch.scored[row, last_sep + 1 :].any()


def test_layout_blind_entropy_is_the_size_biased_entropy_of_scored_tokens():
    assert layout_blind_entropy(8) == pytest.approx(1.9368, abs=1e-4)
    batch = make_batch(L64, "runs", 512, torch.Generator().manual_seed(1))
    counts = Counter(batch.run_length[batch.scored].tolist())
    total = sum(counts.values())
    empirical = -sum(c / total * math.log(c / total) for c in counts.values())
    assert empirical == pytest.approx(layout_blind_entropy(8), abs=0.03)


def test_iid_control_scores_only_tokens_whose_run_shows_the_answer():
    batch = make_batch(L64, "iid", 32, torch.Generator().manual_seed(2))
    segment = torch.cumsum((batch.clean == SEP).long(), dim=1)
    visible_run = (batch.ids != L64.mask_id) & (batch.clean != SEP)
    for row, col in batch.scored.nonzero().tolist():
        same = segment[row] == segment[row, col]
        assert (visible_run[row] & same).any()
    assert not torch.equal(batch.gap[batch.scored], batch.run_length[batch.scored])  # partial runs


def test_every_arm_starts_from_the_same_backbone():
    rope, _ = build_arm("rope", L64, seed=3)
    reference = {n: p for n, p in rope.named_parameters()}
    for arm in ARMS:
        model, _ = build_arm(arm, L64, seed=3)
        backbone = [n for n, _ in model.named_parameters() if n in reference]
        assert len(backbone) == len(reference), arm
        for name in backbone:
            assert torch.equal(dict(model.named_parameters())[name], reference[name]), (arm, name)
    other, _ = build_arm("rope", L64, seed=4)
    assert not torch.equal(other.embed.tokens.weight, rope.embed.tokens.weight)


def test_mdlmpe_off_is_exactly_the_rope_backbone_and_is_restored():
    model, _ = build_arm("mdlmpe-strong-gate", L64, seed=5)
    rope, _ = build_arm("rope", L64, seed=5)
    with torch.no_grad():  # a trained-looking MDLMPE: nonzero phase output, open gate
        for layer in model.layers:
            layer.attn.phase.fc2.weight.normal_(0.0, 1.0)
    batch = make_batch(L64, "runs", 4, torch.Generator().manual_seed(6))
    before = model(batch.ids)
    assert (before - rope(batch.ids)).abs().max() > 1e-3
    with mdlmpe_off(model):
        torch.testing.assert_close(model(batch.ids), rope(batch.ids), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(model(batch.ids), before, atol=0, rtol=0)
    with knockout(model, "shuffle", seed=0):
        assert (model(batch.ids) - before).abs().max() > 1e-4  # the layout moved


def test_oracle_reads_the_gap():
    model, oracle = build_arm("oracle", L64, seed=7)
    rope, _ = build_arm("rope", L64, seed=7)
    batch = make_batch(L64, "runs", 2, torch.Generator().manual_seed(8))
    with pytest.raises(RuntimeError, match=r"set \.gap"):
        model(batch.ids)
    oracle.gap = batch.gap
    assert (model(batch.ids) - rope(batch.ids)).abs().max() > 1e-4
    assert "gap_oracle.table.weight" in dict(model.named_parameters())


def test_updates_to_threshold_and_area():
    history = [{"update": 0, "ce": 2.0}, {"update": 100, "ce": 1.0}, {"update": 200, "ce": 0.01}]
    assert updates_to(history, 0.1) == pytest.approx(150.0)  # log CE halfway between 1 and 0.01
    assert updates_to(history[:2], 0.1) == math.inf
    assert area_log_ce(history) == pytest.approx((math.log(2) + 2 * math.log(1.0) + math.log(0.01)) / 4)


def _arm(updates, area, shuffle=None, seeds=(0, 1, 2, 3, 4)):
    out = {"seeds": list(seeds), "updates_to": list(updates), "area_log_ce": list(area)}
    out["median_updates"] = report._median(out["updates_to"])
    if shuffle is not None:
        out["area_shuffle"] = list(shuffle)
    return out


@pytest.mark.parametrize(
    ("mdlmpe", "control", "oracle", "verdict"),
    [
        (_arm([50, 55, 60, 58, 400], [-2] * 5, [-0.5] * 5), 1.0, 30, "it works"),
        (_arm([50, 55, 60, 58, 400], [-2] * 5, [-1.9] * 5), 1.0, 30, "between"),  # lead not via layout
        (_arm([50, 55, 60, 58, 400], [-2] * 5, [-0.5] * 5), 0.5, 30, "between"),  # lead on the control
        (_arm([300, 320, 280, 310, 290], [-1] * 5, [-0.9] * 5), 1.0, 30, "it does not work"),
        (_arm([300, 320, 280, 310, 290], [-1] * 5, [-0.9] * 5), 1.0, 200, "does not decide"),
    ],
)
def test_decision_rule_as_written_in_the_readme(mdlmpe, control, oracle, verdict):
    rope = _arm([280, 300, 290, 310, 320], [-1] * 5)
    task = {"rope": rope, "mdlmpe": mdlmpe, "oracle": _arm([oracle] * 5, [-3] * 5)}
    iid = {"rope": _arm([100] * 5, [-1] * 5), "mdlmpe": _arm([100 * control] * 5, [-1] * 5)}
    assert verdict in report.decide(task, iid)["verdict"]


def test_probe_baselines_bracket_the_feature():
    """The probe decodes the oracle's feature almost perfectly and the prior sits at the
    layout-blind entropy, so its reading of A is between two checked ends."""
    results = {(r["probe"], r["inputs"]): r for r in probe_layout(L64, rows=96)}
    assert results[("linear", "gap one-hot (oracle)")]["recovered"] > 0.9
    assert results[("prior", "none")]["ce"] == pytest.approx(layout_blind_entropy(8), abs=0.1)


def test_toy_study_runs_reports_and_reuses(tmp_path, capsys):
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "launch" / "runlength_study.py"
    main = runpy.run_path(str(script))["main"]
    assert main(["--toy", "--out", str(tmp_path), "--workers", "1"]) == 0
    first = capsys.readouterr().out
    assert "9 to train" in first and "Verdict (L16-K3)" in first and "layout-blind" in first
    for name in ("runlength.md", "runlength.json", "runlength.png"):
        assert (tmp_path / name).is_file()
    assert main(["--toy", "--out", str(tmp_path), "--workers", "1"]) == 0
    assert "9 reused, 0 to train" in capsys.readouterr().out


def test_compiled_study_attention_trains_the_dense_runs_numbers(monkeypatch):
    """--attention compiled (the default of the full study) only changes how MDLMPE attention is
    computed: a toy run gives the dense run's history, knockouts included, and each run records
    which one made it (and was built with it). An unknown name is refused before anything is built."""
    from mdlmpe_ds.experiments import runlength_train
    from mdlmpe_ds.experiments.runlength_train import RunSettings, train_run

    backends = []

    def recording_build_arm(*args, **kwargs):
        model, oracle = build_arm(*args, **kwargs)
        backends.append({(m.impl.backend, m.impl.compile) for m in model.modules() if hasattr(m, "impl")})
        return model, oracle

    monkeypatch.setattr(runlength_train, "build_arm", recording_build_arm)
    settings = RunSettings(updates=3, batch=4, warmup=1, eval_at=(0, 3), eval_rows=8, eval_batch=8)
    dense = train_run("L16-K3", "runs", "mdlmpe", 0, settings, "dense")
    compiled = train_run("L16-K3", "runs", "mdlmpe", 0, settings, "compiled")
    assert backends == [{("dense", False)}, {("blocked", True)}]
    assert (dense["attention"], compiled["attention"]) == ("dense", "compiled")
    for a, b in zip(dense["history"], compiled["history"], strict=True):
        assert a.keys() == b.keys() and {"shuffle", "constant", "off"} <= a.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert dense["history"][-1]["ce"] != dense["history"][0]["ce"]  # it trained
    with pytest.raises(ValueError, match="unknown study attention 'fast'"):
        build_arm("mdlmpe", L64, 0, attention="fast")


def test_learning_rate_warms_up_then_decays_to_its_floor():
    from mdlmpe_ds.experiments.runlength_train import RunSettings, lr_factor

    s = RunSettings()
    assert lr_factor(0, s) == pytest.approx(1 / s.warmup)
    assert lr_factor(s.warmup, s) == pytest.approx(1.0)
    assert lr_factor(s.updates, s) == pytest.approx(s.min_lr_ratio)
    values = [lr_factor(u, s) for u in range(s.warmup, s.updates + 1)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_toy_refuses_the_flags_it_would_override(tmp_path, capsys):
    """`--toy --geometries L64-K8` trained and reported L16-K3 without a word; now the flags --toy
    fixes are refused by name, values equal to the toy's are accepted, and --seeds applies."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "launch" / "runlength_study.py"
    cli = runpy.run_path(str(script))
    with pytest.raises(SystemExit) as exc:
        argv = ["--toy", "--geometries", "L64-K8", "--attention", "compiled", "--report-only"]
        cli["main"]([*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert (
        "--toy trains L16-K3 with dense attention, so it cannot take --geometries L64-K8, --attention "
        "compiled: drop them, or drop --toy for the full-size study"
    ) in capsys.readouterr().err
    parser = cli["build_parser"]()
    args = parser.parse_args(["--toy", "--geometries", "L16-K3", "--seeds", "3", "4"])
    assert cli["resolve_toy"](parser, args) == cli["TOY_SETTINGS"]
    assert (args.geometries, args.attention, args.seeds) == (["L16-K3"], "dense", [3, 4])
    args = parser.parse_args(["--attention", "dense"])
    cli["resolve_toy"](parser, args)
    assert (args.geometries, args.attention, args.seeds) == (["L64-K8", "L128-K16"], "dense", [0, 1, 2, 3, 4])
