"""benchmarks/gpu_cost/sass.py: the SASS counts the cost model reads from real sm_90 machine code.

Checks the parts that can be wrong without a GPU: the SASS parser and the loop finder (on a
hand-written listing and on a real cubin: our FlashAttention-2-style forward, compiled for
sm_90 in seconds), the classifier and the tensor-core MAC count, and the phase kernels' grid.
The compile test skips where triton cannot compile for sm_90 here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gpu_cost import designs, sass


@pytest.fixture(scope="module")
def flash():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: no compiler in this process")
    from gpu_cost import calibrate

    try:
        return calibrate.compile_setting(128, 64, 3, 4)
    except Exception as err:  # no ptxas / cuobjdump for sm_90 in this triton
        pytest.skip(f"triton cannot compile for sm_90 here: {err}")


def test_classifier_and_mma_shapes():
    assert sass.classify("FFMA.FTZ") == "fp32" and sass.classify("LDL.LU") == "spill"
    assert sass.classify("MUFU.EX2") == "mufu" and sass.classify("LOP3.LUT") == "alu"
    assert sass.classify("HMMA.16816.F32.BF16") == "tensor" and sass.classify("LDG.E.128") == "memory"
    assert sass.mma_macs("HMMA.16816.F32.BF16") == ("HMMA", "BF16", 16 * 8 * 16)
    assert sass.mma_macs("HGMMA.64x32x8.F32.TF32") == ("HGMMA", "TF32", 64 * 32 * 8 / 4)
    assert sass.access_bytes("LDG.E.128") == 512 and sass.access_bytes("STS.U16") == 64


def test_loop_finder_takes_the_widest_backward_branch():
    text = "\n".join(
        [
            "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
            "        /*0010*/                   FFMA R2, R3, R4, R5 ;",
            "        /*0020*/                   MUFU.EX2 R2, R2 ;",
            "        /*0030*/               @P0 BRA 0x20 ;",
            "        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;",
            "        /*0050*/              @!P1 BRA 0x10 ;",
            "        /*0060*/                   EXIT ;",
        ]
    )
    instrs = sass.parse_sass(text)
    with pytest.raises(RuntimeError, match="trip count"):  # a nested loop must say how often it runs
        sass.main_loop(instrs)
    body = sass.main_loop(instrs, trips=3)  # the nested loop (0x20 .. 0x30) three times
    ops = [op for _, op, _ in body]
    assert ops[:5] == ["FFMA", "MUFU.EX2", "BRA", "BAR.SYNC.DEFER_BLOCKING", "BRA"]
    assert sorted(ops[5:]) == sorted(["MUFU.EX2", "BRA"] * 2) and len(ops) == 9
    counts = sass.loop_counts(text, trips=3)
    assert counts.barriers == 1 and counts.outside == 2  # MOV before the loop, EXIT after it


def test_phase_grid_covers_the_upper_half_of_the_tile_plane():
    programs, iters = designs.phase_grid(2048)
    rows = 2048 // designs.PHASE_TILE
    assert programs * iters == pytest.approx(rows * (rows + 1) / 2)  # diagonal included
    assert rows <= programs <= rows * (rows + 1) / 2


def test_flash_forward_costs_one_key_tile(flash):
    res, counts = flash
    # QK^T and PV of a 128 x 64 tile at d_h 128 over the CTA's warps, on warpgroup MMAs.
    assert counts.tensor_macs["HGMMA"] * res.warps == pytest.approx(2 * 128 * 64 * 128)
    assert counts.counts["spill"] == 0 and counts.counts["mufu"] > 0 and counts.outside > 0
    assert res.source == "AOT sm_90" and 0 < res.shared_bytes <= 232_448
