"""Design (b)'s forward and query-side cores written in Triton (benchmarks/gpu_cost/tc_probe.py):
they compute E, dq and d delta in the interpreter, and their sm_90 machine code is what docs/gpu.md
says ("Design (b) in Triton")."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

pytest.importorskip("triton")

from gpu_cost import tc_probe  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return tc_probe.probe_rows()


def test_the_probes_compute_the_correction_and_its_gradients():
    """Against fp64 references on poisoned outputs (a NaN left unwritten fails): within the rounding
    of alpha, beta to fp16 (a flipped sign of S gives 2.0, of dq's (-k2, k1) 1.9)."""
    errors = tc_probe.interpreter_errors()
    assert set(errors) == {"forward bias", "query side dq", "query side d delta"}
    assert all(e < 1e-3 for e in errors.values()), errors


def test_only_a_chunk_of_pairs_fits_and_it_gains_little_over_the_shipped_kernel(rows):
    """alpha, beta of 16 or 32 pairs held through the head loop spill; 8 pairs fit without a spill
    and issue fewer instructions per (head, i, j, pair) than the shipped fp16 pair_forward, and the
    chunked pass (alpha, beta through an L1 scratch: an ESTIMATE) stays within 20% of it."""
    by_pairs = {r["pairs"]: r for r in rows if r["kernel"] == "forward"}
    assert by_pairs[32]["spill_bytes"] > 1024 and by_pairs[32]["head_loop"]["spill"] > 0
    assert by_pairs[16]["spill_bytes"] > 0
    eight = by_pairs[8]
    assert eight["spill_bytes"] == 0 and eight["k_slots"] == 16
    assert eight["per_element"] < tc_probe.SHIPPED["fp16"] / tc_probe.SHIPPED_ELEMENTS
    estimate = tc_probe.chunked_estimate(rows)
    ratio = estimate["(b), chunks of 8 pairs"] / estimate["shipped, fp16"]
    assert 0.8 < ratio < 1.0, estimate


def test_the_query_side_spills_and_gains_under_a_third_in_its_head_loop(rows):
    """(b)'s query side holds the d delta sums of its pairs through the head loop as well: every
    build spills, and the best issues 60-90% of the shipped fp16 pair_backward_q's instructions
    per (head, i, j, pair), before its chunks re-read dBias and the operands."""
    query = [r for r in rows if r["kernel"] == "query side"]
    assert query and all(r["spill_bytes"] > 0 for r in query)
    best = min(r["per_element"] for r in query)
    shipped = tc_probe.SHIPPED_QUERY_SIDE["fp16"] / tc_probe.SHIPPED_ELEMENTS
    assert 0.6 < best / shipped < 0.9, (best, shipped)


def test_the_shipped_figures_and_the_docs_table_are_the_recorded_ones(rows):
    """SHIPPED is the half-pairs table's pair_forward head loop (checked against a fresh compile by
    test_half_pairs.py); docs/gpu.md holds this compile's table."""
    doc = (REPO / "docs" / "gpu.md").read_text()
    for kernel, shipped in (
        ("pair_forward", tc_probe.SHIPPED),
        ("pair_backward_q", tc_probe.SHIPPED_QUERY_SIDE),
    ):
        for name, count in shipped.items():
            assert re.search(rf"^\| {kernel} \| {name} \| \d+ \| \d+ \| {count} \|", doc, re.M), (
                kernel,
                name,
            )
    assert tc_probe.table(rows) in doc, tc_probe.table(rows)
    estimate = tc_probe.chunked_estimate(rows)
    said = "0.31 instructions per element, against 0.46 (fp32) and\n  0.35 (fp16) shipped"
    assert said == (
        f"{estimate['(b), chunks of 8 pairs']:.2f} instructions per element, against "
        f"{estimate['shipped, fp32']:.2f} (fp32) and\n  {estimate['shipped, fp16']:.2f} (fp16) shipped"
    )
    assert said in doc and f"warp-instructions per pass | {tc_probe.SHIPPED_PASS:,}" not in doc
    assert f"→ {tc_probe.SHIPPED_PASS:,} |" in doc  # the rework table's pair_forward pass
