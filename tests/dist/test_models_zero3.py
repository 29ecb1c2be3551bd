"""A tiny MDLMPE model built under deepspeed.zero.Init in a 2-process CPU run loads a saved
directory one tensor at a time and gives the unpartitioned model's logits (worker script beside)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mdlmpe_ds.attention import AttentionImpl
from mdlmpe_ds.models import DiffusionLM, preset
from mdlmpe_ds.models.hf_io import save_pretrained

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("zero3_models_worker.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_zero3_partitioned_load_matches_unpartitioned(tmp_path):
    torch.manual_seed(0)
    config = preset("dream-tiny", position_encoding="mdlmpe")
    model = DiffusionLM(config, impl=AttentionImpl(backend="blocked", query_block=4)).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.phase.fc2.weight.normal_(std=1.0)
    save_pretrained(model, tmp_path / "mdlmpe", config, max_shard_bytes=50_000)
    rope = DiffusionLM(preset("dream-tiny"))
    save_pretrained(rope, tmp_path / "rope", rope.config)
    ids = torch.randint(0, 500, (2, 12))
    ids[:, ::3] = config.mask_token_id
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 8:] = False
    with torch.no_grad():
        logits = model(ids, valid)
    torch.save(
        {"ids": ids, "valid": valid, "logits": logits, "backbone_params": model.num_backbone_parameters()},
        tmp_path / "expected.pt",
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        str(WORKER),
        str(tmp_path / "mdlmpe"),
        str(tmp_path / "rope"),
        str(tmp_path / "expected.pt"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "rank 0 OK" in output and "rank 1 OK" in output, output[-4000:]
