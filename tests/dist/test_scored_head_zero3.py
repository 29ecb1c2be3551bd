"""The scored-positions LM head under real ZeRO-3 (2 CPU ranks, gloo).

Each head chunk gathers the partitioned head weight through DeepSpeed's module hooks (in forward and
again in its backward recompute), a collective: the ranks must run as many chunks although their
scored counts differ (``group_chunk_count``; without it gloo aborts with a collective size mismatch).

1. ``scored_head_worker.py``: full-logits loss vs chunks of 5 rows, 2 updates, per-rank counts
   13 vs 6 and 4 vs 0 -- the same losses and every parameter's full gradient. Tolerance: the paths
   differ in how the head's GEMM is blocked and summed (fp32, ~1e-7 relative per element); 1e-5 of
   each parameter's largest gradient element.
2. The SFT launcher with the head in chunks of 5 vs one chunk (lr 1e-9, so the weights stay equal
   and every update compares the same model): same losses, and grad norms within 1e-6 (fp32: the
   chunks only change how the head's gradient sums are blocked, ~1e-8 measured). A chunk's gradient
   lost or counted twice would move the norm by tens of percent. With one chunk the gradients equal
   the full-logits path's bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sft_fixtures import make_chat, make_tokenizer
from sft_runs import BASE_ARGS, check, env, free_port, launch, metrics

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("scored_head_worker.py")
STEPS = 4


def _worker(mode: str, out: Path) -> dict:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        str(WORKER), mode, str(out),
    ]  # fmt: skip
    proc = subprocess.run(command, env=env(), capture_output=True, text=True, timeout=240, cwd=os.getcwd())
    check(proc, f"scored head worker ({mode})")
    return torch.load(out)


def test_chunked_head_gradients_equal_full_logits_under_zero3(tmp_path):
    full, chunked = _worker("full", tmp_path / "full.pt"), _worker("chunked", tmp_path / "chunked.pt")
    assert chunked["losses"] == pytest.approx(full["losses"], rel=1e-6)
    for name, grad in full["grads"].items():
        scale = float(grad.abs().max()) or 1.0
        err = float((chunked["grads"][name] - grad).abs().max())
        assert err <= 1e-5 * scale, f"{name}: max |chunked - full| {err:.3g} vs largest element {scale:.3g}"


def test_sft_run_with_many_head_chunks_matches_one_chunk(tmp_path):
    data = [
        "--tokenizer", str(make_tokenizer(tmp_path / "tokenizer")),
        "--dataset", str(make_chat(tmp_path / "chat.jsonl")),
    ]  # fmt: skip
    args = [*data, *BASE_ARGS, "--max_steps", str(STEPS), "--save_every", "100", "--lr", "1e-9"]
    runs = {}
    for name, chunk in (("one", "100000"), ("many", "5")):
        out = tmp_path / name
        proc = launch([*args, "--output_dir", str(out)], {"MDLMPE_DS_HEAD_CHUNK": chunk})
        check(proc, f"run with head chunk {chunk}")
        runs[name] = metrics(out)
    assert sorted(runs["one"]) == sorted(runs["many"]) == list(range(1, STEPS + 1))
    assert sum(runs["one"][step]["train/masked_tokens"] for step in runs["one"]) > 4 * 2 * 5  # many chunks
    for step in range(1, STEPS + 1):
        one, many = runs["one"][step], runs["many"][step]
        assert many["train/loss"] == pytest.approx(one["train/loss"], rel=1e-6), f"update {step}"
        assert many["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-6), f"update {step}"
