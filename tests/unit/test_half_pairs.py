"""The fp16 pair-arithmetic probe (benchmarks/gpu_cost/half_pairs.py): its precision in the Triton
interpreter against the baselines it must not exceed, its sm_90 machine code against the shipped
pair forward's, and docs/gpu.md's tables generated from both."""

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


def test_fp16_pair_arithmetic_errs_less_than_the_bias_rounding_training_pays(rows):
    """On every case, up to q and k 10x the unit scale (|bias| up to 363, no fp16 overflow): the
    fp16 probe's bias is within 1e-3 of the fp32 path's (relative), under half the error of the
    bias's rounding to bf16 that training already pays; with that rounding, the output's error on
    the MDLMPE part stays within 1.3x the fp32 path's and below 0.5%. The fp32 path itself is the
    reference's to 1e-5 (the baseline is sound)."""
    assert len(rows) == 3 and max(r["bias_max"] for r in rows) > 300
    for r in rows:
        out = r["output_error"]
        assert r["mdlmpe_part"] > 0.15, r  # the MDLMPE part is a real share of the output
        assert out["fp32 pair path, bias fp32"] < 1e-5, r
        assert r["probe_bias_error"] < 1e-3 and r["probe_bias_error"] < 0.5 * r["bf16_rounding_error"], r
        assert out["fp16 pair path, bias bf16"] <= 1.3 * out["fp32 pair path, bias bf16 (training)"], r
        assert out["fp16 pair path, bias bf16"] < 5e-3, r


def test_fp16_probe_issues_packed_half_instructions_and_fewer_per_head():
    """sm_90 SASS: the probe's head loop runs its pair products as packed fp16 (HFMA2, HMUL2,
    HADD2), with at most 3/4 of the shipped forward's instructions per head, fewer loads, no more
    registers and no spill; the shipped forward has no packed half instruction."""
    loops = half_pairs.probe_loops()
    shipped, probe = (loops[k] for k in ("shipped (fp32 pair arithmetic)", "probe (fp16 pair arithmetic)"))
    assert shipped["head_loop"]["packed_half"] == 0 and probe["head_loop"]["packed_half"] >= 32
    assert probe["head_loop"]["instructions"] <= 0.75 * shipped["head_loop"]["instructions"]
    assert probe["head_loop"]["global_loads"] < shipped["head_loop"]["global_loads"]
    assert probe["registers"] <= shipped["registers"] and probe["spill_bytes"] == 0
    gpu = (REPO / "docs" / "gpu.md").read_text()
    assert half_pairs.loops_table(loops) in gpu, "docs/gpu.md: rerun python benchmarks/gpu_cost/half_pairs.py"
    now, then = probe["head_loop"]["instructions"], shipped["head_loop"]["instructions"]
    quoted = f"Its per-head loop has {now} instructions against {then} ({100 * (1 - now / then):.0f}% fewer)"
    assert quoted in " ".join(gpu.split())


def test_docs_precision_table_is_the_studys(rows):
    gpu = (REPO / "docs" / "gpu.md").read_text()
    assert half_pairs.precision_table(rows) in gpu, (
        "docs/gpu.md: rerun python benchmarks/gpu_cost/half_pairs.py"
    )

    def span(key: str) -> str:
        values = [100 * r["output_error"][key] for r in rows]
        return f"{min(values):.2f}–{max(values):.2f}%"

    fp16, fp32 = span("fp16 pair path, bias bf16"), span("fp32 pair path, bias bf16 (training)")
    assert f"part is {fp16} in fp16 against {fp32} in fp32" in " ".join(gpu.split())
