"""benchmarks/estimate_gpu.py: the SASS cost model reads real sm_90 machine code (no GPU needed).

Checks the parts that can be wrong without a GPU: the SASS parser and the loop finder on a real
cubin (a compiled plain flash-attention forward, seconds), the classifier and the tensor-core
MAC count, and that the estimate prints every assumption. Skips where triton cannot compile for
sm_90 here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SPEC = importlib.util.spec_from_file_location(
    "estimate_gpu", Path(__file__).resolve().parents[2] / "benchmarks" / "estimate_gpu.py"
)
est = importlib.util.module_from_spec(SPEC)
sys.modules["estimate_gpu"] = est  # dataclasses look their module up there
SPEC.loader.exec_module(est)


@pytest.fixture(scope="module")
def flash():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: no compiler in this process")
    try:
        return est.flash_cost(64, torch.bfloat16)
    except Exception as err:  # no ptxas / cuobjdump for sm_90 in this triton
        pytest.skip(f"triton cannot compile for sm_90 here: {err}")


def test_classifier_and_mma_shapes():
    assert est.classify("FFMA.FTZ") == "fp32" and est.classify("LDL.LU") == "spill"
    assert est.classify("MUFU.EX2") == "mufu" and est.classify("LOP3.LUT") == "alu"
    assert est.classify("HMMA.16816.F32.BF16") == "tensor" and est.classify("LDG.E.128") == "memory"
    macs, cycles = est._mma_macs("HMMA.16816.F32.BF16")
    assert macs == 16 * 8 * 16 and cycles == pytest.approx(macs / (2048 * 0.5))
    macs, _ = est._mma_macs("HGMMA.64x32x8.F32.TF32")
    assert macs == 64 * 32 * 8 / 4
    assert est._access_bytes("LDG.E.128") == 512 and est._access_bytes("STS.U16") == 64


def test_loop_finder_takes_the_widest_backward_branch():
    text = "\n".join(
        [
            "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
            "        /*0010*/                   FFMA R2, R3, R4, R5 ;",
            "        /*0020*/                   MUFU.EX2 R2, R2 ;",
            "        /*0030*/               @P0 BRA 0x20 ;",
            "        /*0040*/                   LDG.E R6, desc[UR4][R2.64] ;",
            "        /*0050*/              @!P1 BRA 0x10 ;",
            "        /*0060*/                   EXIT ;",
        ]
    )
    instrs = est.parse_sass(text)
    with pytest.raises(RuntimeError, match="trip count"):  # a nested loop must say how often it runs
        est.main_loop(instrs)
    body = est.main_loop(instrs, trips=3)  # the nested loop (0x20 .. 0x30) three times
    ops = [op for _, op, _ in body]
    assert ops[:5] == ["FFMA", "MUFU.EX2", "BRA", "LDG.E", "BRA"]
    assert sorted(ops[5:]) == sorted(["MUFU.EX2", "BRA"] * 2) and len(ops) == 9


def test_waves_and_phase_grid():
    # 255 registers x 128 threads: 2 programs per SM; 180 KB of shared memory: 1.
    assert est.resident_programs(255, 0, 4) == 2 and est.resident_programs(255, 180 * 1024, 4) == 1
    cost = est.LoopCost("k", {}, 0.0, 0.0, 0.0, cycles=10.0, bound="issue", resident=2)
    one_wave = est.kernel_seconds(cost, 4, 2 * est.H100["sms"], 1)
    assert est.kernel_seconds(cost, 4, 2 * est.H100["sms"] + 1, 1) == pytest.approx(2 * one_wave)
    from mdlmpe_ds.attention.triton.launch import launch_config

    config = launch_config(128, torch.bfloat16, 90)
    programs, tiles = est.phase_programs(2048, config)
    rows = 2048 // config.phase_tile
    assert tiles == rows * (rows + 1) // 2  # the upper half of the tile plane, diagonal included
    assert rows <= programs <= tiles


def test_flash_forward_costs_one_key_tile(flash):
    # QK^T and PV of a 128 x 64 tile at d_h 64: 2 * 128 * 64 * 64 MACs over 8 warps.
    assert flash.tensor_macs * est.FLASH_WARPS == pytest.approx(2 * 128 * 64 * 64)
    assert flash.counts["spill"] == 0 and flash.counts["mufu"] > 0 and flash.cycles > 0


def test_estimate_prints_every_assumption(flash):
    from mdlmpe_ds.attention.triton.launch import launch_config

    config = launch_config(128, torch.bfloat16, 90)
    costs = {k: flash for k in ("phase_forward", "forward", "backward", "phase_backward")}
    row = est.estimate(costs, config, flash, 2048, 2)
    assert row["step_ratio"] > 1 and row["rope_step_ms"] > row["rest_of_step_ms"] > 0
    # Every kernel is at least as slow as its pair-buffer traffic at the HBM bandwidth.
    plane = est.NUM_MDLMPE * 2048**2 * 4
    for k, planes in est.PAIR_PLANES.items():
        runs = est.RUNS_PER_LAYER.get(k, 1)
        assert row[f"{k}_ms"] >= 1e3 * runs * planes * plane / est.HBM_BYTES_PER_S * (1 - 1e-9)
    assert row["pair_hbm_gb"] == pytest.approx(12 * plane / 1e9)
    text = "\n".join(est.assumptions(config, torch.bfloat16))
    for needle in ("ESTIMATE", "SMs", "MFU", "backward", "tensor cores", "LLaDA-8B", "HBM", "waves"):
        assert needle in text
