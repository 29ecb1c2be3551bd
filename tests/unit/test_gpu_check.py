"""The GPU runbook (launch/gpu_check.py, `make gpu-check`) in its no-GPU mode: it prints the smoke
run's memory plan, then stops with exit 0 and the documented message. CUDA is hidden from the
child process, so this tests the same path on a GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_runbook_without_gpu_plans_then_stops_cleanly(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    env.pop("DS_ACCELERATOR", None)
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "launch/gpu_check.py", "--length", "256", "--micro-batch", "1"]
    proc = subprocess.run(
        [*command, "--workdir", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "[1/4] memory plan of the smoke run" in out
    assert "model: llada-8b-2layers (llada), position encoding mdlmpe" in out
    assert "memory plan per GPU (estimate): world 1, micro-batch 1 x L 256" in out
    assert "chunks of 1024 x V 126,464" in out  # LLaDA's head shape with the offline fixture tokenizer
    assert out.rstrip().endswith(
        "no GPU: stopping (steps 2-4 need a CUDA device; the plan above is what they check)"
    )
    smoke = tmp_path / "smoke"  # nothing was trained (the dry run may leave its tokenised-data cache)
    assert not (smoke / "checkpoints").exists() and not (smoke / "metrics.jsonl").exists()


def test_runbook_works_outside_a_checkout(tmp_path):
    """An installed package has no tests/ folder: the runbook builds its smoke inputs from the
    library. Run a copy of the script whose repository root holds nothing but launch/."""
    import shutil

    root = tmp_path / "installed"
    (root / "launch").mkdir(parents=True)
    shutil.copy2(REPO / "launch" / "gpu_check.py", root / "launch" / "gpu_check.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    env.pop("DS_ACCELERATOR", None)
    env.pop("WORLD_SIZE", None)
    command = [
        sys.executable, "launch/gpu_check.py", "--length", "128", "--micro-batch", "1",
        "--deepspeed", str(REPO / "ds_configs" / "zero3.json"), "--workdir", str(tmp_path / "work"),
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no GPU: stopping" in proc.stdout
