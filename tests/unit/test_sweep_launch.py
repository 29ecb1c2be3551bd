"""The launch-settings sweep (benchmarks/sweep_launch_gpu.py) without a GPU: every candidate is a
setting the launchers accept, a backend's candidates compute the same function (checked in the
Triton interpreter at a tiny shape, as the sweep checks them on the GPU), the agreement check
fails on a wrong gradient, and the scripts refuse to run without CUDA."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import sweep_launch_gpu as sweep  # noqa: E402


def test_every_candidate_is_a_setting_the_launchers_take():
    from mdlmpe_ds.attention.triton.backend import triton_attention
    from mdlmpe_ds.attention.triton.launch import HALF_PAIR_KERNELS, PAIR_KERNELS, pair_kernel_settings

    for name, settings in sweep.PAIR_CANDIDATES.items():
        config = sweep.pair_config(settings)
        for kernel in PAIR_KERNELS:
            own = pair_kernel_settings(config, kernel)
            assert own.tile_m * own.tile_n >= 16 and own.num_warps * 32 * own.max_registers <= 65536, name
    assert sweep.pair_config(sweep.PAIR_CANDIDATES["per_kernel_half"]).half_pairs == HALF_PAIR_KERNELS
    accepted = set(inspect.signature(triton_attention).parameters)
    for name, settings in sweep.FUSED_CANDIDATES.items():
        assert set(settings) <= accepted, name
    assert set(sweep.DEFAULT_CANDIDATE.values()) <= set(sweep.PAIR_CANDIDATES) | set(sweep.FUSED_CANDIDATES)


CHILD = """
import sys
sys.path.insert(0, {bench!r})
import sweep_launch_gpu as s
out = {{}}
for backend, names in (("triton-pair", ("per_kernel", "8x16w4")), ("triton", ("t64g1w8", "t32g2w4"))):
    first = None
    for name in names:
        table = s.PAIR_CANDIDATES if backend == "triton-pair" else s.FUSED_CANDIDATES
        step = s.layer_step(backend, table[name], 19, device="cpu", heads=2)
        step()
        snap = step.snapshot()
        if first is None:
            first = snap
        else:
            out[backend] = s.agreement(snap, first)
            broken = dict(snap, dq=snap["dq"] * 1.1)
            out[backend + " broken"] = s.agreement(broken, first)
print(repr(out))
"""


def test_a_backends_candidates_compute_the_same_function():
    """Two settings of each backend in the interpreter (L = 19: every tile ragged), seeded the same:
    outputs and gradients agree to bf16 rounding; a dq off by 10% is flagged."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    code = CHILD.format(bench=str(REPO / "benchmarks"))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = eval(proc.stdout.strip().splitlines()[-1])  # a dict of floats printed by the child
    for backend in ("triton-pair", "triton"):
        errors = out[backend]
        assert set(errors) >= {"out", "dq", "dk", "dv", "dfc1.weight", "dfc2.weight"}
        assert max(errors[n] for n in ("out", "dq", "dk", "dv")) < 2e-2, (backend, errors)
        assert out[backend + " broken"]["dq"] > 0.05, backend


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_the_gpu_scripts_stop_without_a_gpu(capsys):
    import profile_kernels_gpu

    assert sweep.main(["--length", "64"]) == 2
    assert profile_kernels_gpu.main(["--length", "64"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
