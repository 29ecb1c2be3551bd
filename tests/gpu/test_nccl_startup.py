"""A real NCCL run on CUDA devices: launch/sft.py on up to 2 GPUs, a few updates.

Before host-tensor collectives moved to gloo groups (mdlmpe_ds/distributed/collectives.py), every GPU run
died at its first data fingerprint or update sum: an all_gather / all_reduce of a CPU float64
tensor on the NCCL default group ("No backend type associated with device type cpu"), also on one
GPU. tests/dist/test_host_collectives.py checks the same on the CPU with a mimic of NCCL's device
rule; this is the real thing, where a GPU is lent. Skipped without CUDA.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
from sft_fixtures import make_chat, make_tokenizer
from sft_runs import BASE_ARGS, REPO, check, command, env, metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_sft_trains_on_nccl(tmp_path):
    ranks = min(2, torch.cuda.device_count())
    data = [
        "--tokenizer",
        str(make_tokenizer(tmp_path / "tok")),
        "--dataset",
        str(make_chat(tmp_path / "c.jsonl")),
    ]
    out = tmp_path / "out"
    args = [*data, *BASE_ARGS, "--max_steps", "2", "--save_every", "2", "--output_dir", str(out)]
    environment = env()
    environment.pop("DS_ACCELERATOR")  # DeepSpeed picks CUDA itself; "cpu" would train on the CPU
    proc = subprocess.run(
        command(args, ranks), env=environment, capture_output=True, text=True, timeout=600, cwd=REPO
    )
    check(proc, f"{ranks}-GPU SFT run on NCCL")
    assert sorted(metrics(out)) == [1, 2]
    assert len(list((out / "data_cache").glob("sft-*.npz"))) == 1
