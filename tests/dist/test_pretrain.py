"""2-process ZeRO-3 pretraining on the CPU through the real DeepSpeed engine (launch/pretrain.py):
straight == interrupted (losses, lr, validation perplexity), validation in TensorBoard, the run's
summary; and the one-command comparison (launch/compare_pe.py) end to end, re-run to show that
finished runs and evaluations are reused.

Data: the real Botchan novel (offline assets) with a 400-piece SentencePiece tokenizer trained on it.
Cost: 3 two-rank launches plus one comparison of 2 one-rank runs, ~2 min on 2 shared cores.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sft_runs import DS_CONFIG, REPO, check, env, free_port, metrics

pytestmark = pytest.mark.dist

PRETRAIN = REPO / "launch" / "pretrain.py"
N = 6  # updates


@pytest.fixture(scope="module")
def data(assets, tmp_path_factory):
    from mdlmpe_ds.runs.pretrain_run import sentencepiece_for_corpus

    corpus = assets("botchan").botchan
    tok = sentencepiece_for_corpus(str(corpus), 400, cache_root=tmp_path_factory.mktemp("tok"))
    return [
        "--dataset", str(corpus), "--validation", str(corpus), "--tokenizer", str(tok),
        "--text_split", "paragraph", "--max_len", "32", "--micro_batch_size", "2", "--grad_accum", "2",
        "--max_steps", str(N), "--save_every", "3", "--eval_every", "3", "--eval_sequences", "4",
        "--eval_samples", "2", "--lr", "3e-3", "--warmup_steps", "1", "--seed", "7",
    ]  # fmt: skip


def launch(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        str(PRETRAIN), "--deepspeed", str(DS_CONFIG), *args,
    ]  # fmt: skip
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data):
    out = tmp_path_factory.mktemp("pretrain_straight")
    check(launch([*data, "--output_dir", str(out)]), "straight pretraining run")
    return out


def test_straight_equals_interrupted(straight, data, tmp_path):
    out = tmp_path / "interrupted"
    out.mkdir()
    (out / "summary.json").write_text('{"finished": true}')  # stale: a run that starts removes it
    check(launch([*data, "--output_dir", str(out), "--stop_at", "3"]), "first half")
    assert max(metrics(out)) == 3 and not (out / "summary.json").exists()  # stopped early: no summary
    check(launch([*data, "--output_dir", str(out), "--resume", "auto"]), "resumed half")
    a, b = metrics(straight), metrics(out)
    assert sorted(a) == sorted(b) == list(range(1, N + 1))
    for step in range(1, N + 1):
        for key in ("train/loss", "train/lr", "train/grad_norm", "train/masked_tokens"):
            # fp32, one thread per rank: the resumed run repeats the straight run bit for bit.
            assert b[step][key] == a[step][key], f"update {step} {key}: {a[step][key]!r} vs {b[step][key]!r}"
    for step in (3, 6):  # validation draws are fixed: the resumed model scores like the straight one
        assert b[step]["val/ppl"] == a[step]["val/ppl"]
    assert a[1]["train/loss"] != a[2]["train/loss"]  # real, varying losses (not a constant)


def test_validation_perplexity_is_logged_and_summarised(straight):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(straight / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("val/ppl")] == [3, 6]
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, N + 1))
    ppl = [e.value for e in acc.Scalars("val/ppl")]
    assert all(1.0 < p < 2 * 448 for p in ppl)  # between certainty and ~uniform over the vocabulary
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["total_updates"] == N
    assert summary["validation"]["val/ppl"] == pytest.approx(ppl[-1], rel=1e-6)
    # Masks do not depend on the model: every token was maskable (no prompt), so the loss saw
    # masked tokens at every update.
    assert all(row["train/masked_tokens"] > 0 for row in metrics(straight).values())


def test_compare_pe_end_to_end_and_rerun_reuses_results(data, tmp_path):
    out = tmp_path / "compare"
    at = data.index("--seed")
    data = data[:at] + data[at + 2 :]  # compare sets every run's seed itself (--seeds): it refuses --seed
    args = [
        sys.executable, str(REPO / "launch" / "compare_pe.py"), "--encodings", "rope", "mdlmpe",
        "--seeds", "0", "--out", str(out), "--deepspeed", str(DS_CONFIG), "--corpora", "botchan",
        "--score_windows", "4", "--score_draws", "4", *data, "--max_steps", "2", "--save_every", "2",
    ]  # fmt: skip
    first = subprocess.run(args, env=env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    check(first, "compare_pe")
    report = json.loads((out / "compare.json").read_text())
    assert set(report["table"]) == {"rope", "mdlmpe"}
    cells = [report["table"][e]["botchan"] for e in ("rope", "mdlmpe")]
    assert cells[0]["tokens"] == cells[1]["tokens"] == 4 * 32  # the same windows for both encodings
    assert cells[0]["mean"] != cells[1]["mean"]
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "| rope |" in (out / "compare.md").read_text()
    for encoding in ("rope", "mdlmpe"):
        run = out / "runs" / f"{encoding}-seed0"
        saved = json.loads(next((run / "checkpoints").glob("step_*/config.json")).read_text())
        assert saved["model_config"]["position_encoding"] == encoding
        assert saved["run_config"]["train"]["seed"] == 0  # matched runs share the seed
    again = subprocess.run(args, env=env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    check(again, "compare_pe re-run")
    assert again.stdout.count("finished earlier, reusing") == 2
    assert json.loads((out / "compare.json").read_text())["table"] == report["table"]
