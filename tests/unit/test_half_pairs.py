"""The fp16 pair-arithmetic probe (benchmarks/gpu_cost/half_pairs.py): the triton-pair kernels run
with PAIR_DT fp16 in the Triton interpreter against the baselines they must not exceed, their
sm_90 machine code against the shipped (fp32) build, and docs/gpu.md's tables from both."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_cost import half_pairs  # noqa: E402

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def rows():
    return half_pairs.precision_rows()


@pytest.fixture(scope="module")
def loops():
    return half_pairs.probe_loops()


def test_fp16_pair_arithmetic_against_what_training_already_pays(rows):
    """Forward: the fp16 bias is within 1e-3 of the fp32 kernels' (relative), under half the error
    of its rounding to bf16 that training pays, also with |bias| > 300 (no overflow). Backward:
    with dBias scaled by a power of two, every gradient (q, k, the phase MLP) is within 1.5x the
    error the fp32 kernels take from dBias in bf16; unscaled, a dBias below fp16's normal range
    (cases 2 and 3) costs over 10x that: the fp16 backward needs the scaling."""
    assert len(rows) == 3 and max(r["bias_max"] for r in rows) > 300
    for r in rows:
        forward = r["forward"]
        assert (
            forward["fp16 bias error"] < 1e-3
            and forward["fp16 bias error"] < 0.5 * forward["bias rounding to bf16"]
        )
        for name, got in r["backward"].items():
            baseline = got["fp32, dBias in bf16 (training)"]
            assert 1e-4 < baseline < 1e-2, (r["case"], name, got)  # a sound, non-trivial baseline
            assert got["fp16, dBias scaled"] <= 1.5 * baseline, (r["case"], name, got)
    for r in rows[1:]:
        assert r["dbias_max"] < 6.1e-5  # below fp16's normal range
        assert all(got["fp16"] > 10 * got["fp32, dBias in bf16 (training)"] for got in r["backward"].values())


def test_fp16_pays_in_the_forward_and_the_query_side(loops):
    """sm_90 SASS, per head and warp: the fp16 forward runs its products as packed half precision
    with at most 3/4 of the fp32 build's instructions, fewer loads and registers and no spill; the
    query side (its cross-lane sums over keys in fp32) issues fewer, the key side more: exactly
    ``HALF_PAIR_KERNELS`` gain. The fp32 builds have no packed half instruction: they are the
    default kernels."""
    from mdlmpe_ds.attention.triton.launch import HALF_PAIR_KERNELS

    forward = loops["pair_forward"]
    assert forward["fp16"]["head_loop"]["packed_half"] >= 32
    assert forward["fp16"]["head_loop"]["instructions"] <= 0.75 * forward["fp32"]["head_loop"]["instructions"]
    assert forward["fp16"]["head_loop"]["global_loads"] < forward["fp32"]["head_loop"]["global_loads"]
    assert forward["fp16"]["registers"] < forward["fp32"]["registers"] and forward["fp16"]["spill_bytes"] == 0
    gains = []
    for kernel, builds in loops.items():
        fp32, fp16 = (builds[k]["head_loop"] for k in ("fp32", "fp16"))
        assert fp16["packed_half"] > 0, kernel
        if fp16["instructions"] < fp32["instructions"]:
            gains.append(kernel)
    assert tuple(gains) == HALF_PAIR_KERNELS
    assert (
        loops["pair_backward_q"]["fp16"]["head_loop"]["shuffles"]
        == loops["pair_backward_q"]["fp32"]["head_loop"]["shuffles"]
    )
    assert all(builds["fp32"]["head_loop"]["packed_half"] == 0 for builds in loops.values())


def test_the_guard_sends_the_large_case_to_fp32_and_the_step_estimate(rows, loops):
    """The range guard lets the training-scale cases run in fp16 and sends the q, k x 30 case to
    fp32 (worst-case bound; that case was fine in fp16). The step ESTIMATE with the fp16 kernels is
    below today's at every length, by less than 15%."""
    assert [r["guard_fits"] for r in rows] == [True, True, False]
    for length, (today, half) in half_pairs.step_estimates(loops).items():
        assert 0.85 * today < half < today, length


def test_docs_tables_are_the_probes(rows, loops):
    gpu = (REPO / "docs" / "gpu.md").read_text()
    hint = "docs/gpu.md: rerun python benchmarks/gpu_cost/half_pairs.py"
    assert half_pairs.precision_table(rows) in gpu, hint
    assert half_pairs.loops_table(loops) in gpu, hint
    assert half_pairs.step_table(half_pairs.step_estimates(loops)) in gpu, hint
    f32, f16 = (loops["pair_forward"][k]["head_loop"]["instructions"] for k in ("fp32", "fp16"))
    assert f"{f16} instructions per head against {f32} ({100 * (1 - f16 / f32):.0f}% fewer)" in " ".join(
        gpu.split()
    )
