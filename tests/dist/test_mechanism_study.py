"""launch/mechanism_study.py end to end at toy size (2 two-rank ZeRO-3 pretraining runs on the
``mix`` corruption, paired layout evaluation, knockouts, report): interrupted after one update
and resumed by the same command, then run again: finished runs and evaluations are reused and
the report is the same.

Data: the real Botchan novel (offline assets) with a 400-piece SentencePiece tokenizer.
Cost: ~1.5 min on 2 shared cores (three tiny launches, 4 windows x 2 draws scored).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sft_runs import DS_CONFIG, REPO, check, env

pytestmark = pytest.mark.dist


def test_mechanism_study_toy_end_to_end_and_rerun_reuses_runs(assets, tmp_path):
    from mdlmpe_ds.runs.pretrain_run import sentencepiece_for_corpus

    corpus = str(assets("botchan").botchan)
    tok = sentencepiece_for_corpus(corpus, 400, cache_root=tmp_path / "tok")
    out = tmp_path / "mech"
    args = [
        sys.executable, str(REPO / "launch" / "mechanism_study.py"), "--toy", "--seeds", "0",
        "--out", str(out), "--deepspeed", str(DS_CONFIG), "--corpus", corpus,
        "--tokenizer", str(tok), "--dataset", corpus, "--validation", corpus,
    ]  # fmt: skip
    # Interrupted: the first run stops after update 1 (a checkpoint, no summary), the study fails
    # naming what to do; the same command then resumes that run and trains the other.
    stopped = subprocess.run(
        [*args, "--stop_at", "1"], env=env(), capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert stopped.returncode != 0 and "run the same command again" in stopped.stderr
    rope_run = out / "runs" / "rope-seed0"
    assert (rope_run / "checkpoints" / "step_000001").is_dir() and not (rope_run / "summary.json").exists()
    first = subprocess.run(args, env=env(), capture_output=True, text=True, timeout=400, cwd=REPO)
    check(first, "mechanism_study --toy")
    assert "resumed from" in (rope_run / "train.log").read_text()
    report = json.loads((out / "mechanism.json").read_text())
    summary = report["summary"]
    assert summary["layouts"] == ["iid", "semi_ar", "spans"] and summary["seeds"] == [0]
    for encoding in ("rope", "mdlmpe"):
        run = out / "runs" / f"{encoding}-seed0"
        saved = json.loads(next((run / "checkpoints").glob("step_*/config.json")).read_text())
        assert saved["run_config"]["train"]["corruption"] == "mix"  # trained on the mix layout
        assert saved["model_config"]["position_encoding"] == encoding
    # The same windows and masks for both models: equal token counts per layout.
    for layout in summary["layouts"]:
        counts = {summary["nll"][e][layout][0]["tokens"] for e in ("rope", "mdlmpe")}
        assert len(counts) == 1 and counts.pop() > 0
    paired = summary["mdlmpe_minus_rope"]["iid"]
    assert paired["mean"] != 0.0 and paired["paired_se_of_mean"] > 0
    for mode in ("shuffle", "constant", "off", "context"):
        assert set(summary["knockout"][mode]) == set(summary["layouts"])
    assert summary["rope_knockout_max_abs_delta"] == 0.0  # RoPE: nothing to knock out, exactly
    assert set(summary["rope_context"]) == set(summary["layouts"])
    # Reference lines on the same windows and masks; the clean-neighbour bigram beats the unigram.
    for layout in summary["layouts"]:
        uni, bi = (summary["reference"][name][layout]["nll"] for name in ("unigram", "bigram"))
        assert 0 < bi < uni, (layout, uni, bi)
    md = (out / "mechanism.md").read_text()
    assert "# Does MDLMPE use the mask layout?" in md and "| semi_ar |" in md
    assert "| reference: unigram |" in md and "Context knockout on the RoPE models" in md
    assert (out / "mechanism.png").read_bytes()[:4] == b"\x89PNG"
    assert any((out / "data_cache").glob("store-*/COMPLETE"))  # the scored corpus, tokenised once
    # The failed call's time counts too: the report's wall time (taken before the report is written)
    # adds the second call's to the first's.
    calls = json.loads((out / "wall_time.json").read_text())["calls"]
    assert len(calls) == 2 and min(calls) > 0
    assert calls[0] < report["meta"]["wall_time_s"] <= sum(calls)

    again = subprocess.run(args, env=env(), capture_output=True, text=True, timeout=200, cwd=REPO)
    check(again, "mechanism_study --toy re-run")
    assert again.stdout.count("finished earlier, reusing") == 2
    assert again.stdout.count("scores reused") == 2
    assert json.loads((out / "mechanism.json").read_text())["summary"] == summary
