"""Non-finite updates are skipped and counted, several in a row stop the run with a clear message;
resuming on another world size; loss falls on the real chat data with the real Qwen2.5 tokenizer."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys

import pytest
from sft_runs import BASE_ARGS, REPO, check, launch, metrics

pytestmark = pytest.mark.dist


@pytest.fixture
def data(sft_data):  # tests/dist/conftest.py
    return sft_data


def test_nonfinite_skipped_then_stop(data, tmp_path):
    out = tmp_path / "nan"
    # NaN loss at updates 1 (isolated) and 3, 4, 5 (three in a row = the limit) -> stop after update 6.
    # The save due at update 2 (1-based; non-finite) waits for the finite update 3.
    proc = launch(
        [
            *data,
            *BASE_ARGS,
            "--output_dir",
            str(out),
            "--save_every",
            "2",
            "--max_consecutive_nonfinite",
            "3",
        ],
        faults={"nan_updates": [1, 3, 4, 5]},
    )
    assert proc.returncode != 0  # the workers exit 3; torchrun reports the failure as 1
    # No save at a non-finite update (4, 6): the run stops naming the last finite checkpoint.
    assert "3 consecutive non-finite updates" in proc.stderr and "last good checkpoint:" in proc.stderr
    assert "step_000003" in proc.stderr
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == ["step_000003"]
    rows = metrics(out)
    assert [rows[s]["train/update_applied"] for s in range(1, 7)] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert [rows[s]["train/nonfinite_skipped"] for s in range(1, 7)] == [0.0, 1.0, 1.0, 2.0, 3.0, 4.0]
    # A skipped update does not advance the lr schedule (DeepSpeed skips the scheduler with the step).
    assert rows[3]["train/lr"] == rows[2]["train/lr"] and rows[5]["train/lr"] == rows[4]["train/lr"]


def test_resume_on_another_world_size(sft_straight, data, tmp_path):
    """2 ranks -> 1 rank: a clear error that says how to convert, then DeepSpeed's universal
    checkpoint conversion and a 1-rank resume that finishes the schedule. The 2-rank checkpoint is
    the shared straight run's update-4 save (tests/dist/conftest.py: same arguments), copied."""
    out = tmp_path / "w2"
    shutil.copytree(sft_straight / "checkpoints" / "step_000004", out / "checkpoints" / "step_000004")
    proc = launch([*data, *BASE_ARGS, "--output_dir", str(out), "--resume", "auto"], nproc=1)
    assert proc.returncode != 0
    assert "written by 2 ranks but this run has 1" in proc.stderr and "to-universal" in proc.stderr
    step4 = out / "checkpoints" / "step_000004"
    convert = subprocess.run(
        [sys.executable, str(REPO / "launch" / "convert_checkpoint.py"), "to-universal", str(step4)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert convert.returncode == 0, convert.stderr[-3000:]
    # sealed like a checkpoint: its own COMPLETE and manifest, no scratch or DeepSpeed tmp/ left
    from mdlmpe_ds.training import checkpoint as ckpt

    copy = step4 / ckpt.DS_UNIVERSAL_TAG
    assert ckpt.universal_problems(step4) == [] and ckpt.is_complete(copy)
    assert not (copy / "tmp").exists() and not (step4 / ckpt.UNIVERSAL_SCRATCH).exists()
    resumed = launch([*data, *BASE_ARGS, "--output_dir", str(out), "--resume", "auto"], nproc=1)
    check(resumed, "1-rank resume from the universal copy")
    assert "resuming a 2-rank checkpoint on 1 ranks" in resumed.stdout
    rows = metrics(out, first=5)  # a fresh output_dir: its history starts at the checkpoint
    assert max(rows) == 8 and all(math.isfinite(rows[s]["train/loss"]) for s in range(5, 9))
    # The lr schedule continues where the 2-rank run stopped (restored scheduler state): update
    # index 4 of warmup 2 + cosine over 8 at peak 3e-3 (BASE_ARGS), not a restarted warmup.
    from mdlmpe_ds.distributed.engine import warmup_cosine

    assert rows[5]["train/lr"] == pytest.approx(3e-3 * warmup_cosine(2, 8, True, 0.1)(4), rel=1e-12)


def test_loss_falls_on_real_chat_data(tmp_path):
    """The embedded default's data path: real Qwen2.5 tokenizer (151k vocab), chatterbot dialogues."""
    out = tmp_path / "real"
    proc = launch(
        [
            "--max_len",
            "64",
            "--micro_batch_size",
            "2",
            "--max_steps",
            "12",
            "--save_every",
            "12",
            "--lr",
            "5e-3",
            "--warmup_steps",
            "1",
            "--output_dir",
            str(out),
        ],
        timeout=300,
    )
    check(proc, "real-data run")
    nll = [metrics(out)[s]["train/nll"] for s in range(1, 13)]
    # Untrained: ~ln(151680) = 11.9 nats per masked token; the unigram statistics alone are learnt
    # within a few updates at this rate.
    assert sum(nll[:3]) / 3 > 11.0
    assert sum(nll[-3:]) / 3 < sum(nll[:3]) / 3 - 0.4, nll  # seen: 11.89 -> 11.15; untrained stays flat


@pytest.mark.parametrize("context", ["blocked", "full"])
def test_block_diffusion_sft_trains_one_block_per_example(data, tmp_path, context):
    """train.block_size / block_context select block-diffusion SFT (issue 6): each example puts only
    its active block in the loss, so an update never has more than block_size x examples loss tokens."""
    out = tmp_path / context
    args = [*data, *BASE_ARGS, "--output_dir", str(out), "--max_steps", "4", "--save_every", "4"]
    check(launch([*args, "--block_size", "1", "--block_context", context]), f"block SFT ({context})")
    rows = metrics(out)
    examples_per_update = 2 * 2 * 2  # micro x grad_accum x world
    masked = [rows[s]["train/masked_tokens"] for s in range(1, 5)]
    assert all(0 <= m <= 1 * examples_per_update for m in masked), masked
    assert sum(masked) > 0 and all(math.isfinite(rows[s]["train/loss"]) for s in range(1, 5))
