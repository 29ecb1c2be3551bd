"""The H100 measurements (benchmarks/gpu_cost/measured_h100.json) and what the docs say of them:
the README's and docs/gpu.md's tables are generated from the record, the ranges the README quotes
are the record's, and the assembled step ratio is the formula its docstring states."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_cost import measured  # noqa: E402


@pytest.fixture(scope="module")
def record():
    return measured.load()


def test_docs_tables_are_generated_from_the_record(record):
    readme = (REPO / "README.md").read_text()
    gpu = (REPO / "docs" / "gpu.md").read_text()
    assert measured.step_table(record) in readme, (
        "README: rerun `python benchmarks/estimate_gpu.py --measured`"
    )
    assert measured.step_table(record) in gpu
    for table in (
        measured.kernel_table(record, 2048),
        measured.rope_table(record),
        measured.calibration_table(record),
    ):
        assert table in gpu, f"docs/gpu.md lacks this generated table:\n{table}"


def test_the_ranges_the_readme_quotes_are_the_records(record):
    """'4–15× a RoPE step', 'central estimates 1.7–2.0× below', 'kernels 1.0–3.3× below'."""
    readme = (REPO / "README.md").read_text()
    ns = measured.lengths(record)
    steps = [measured.measured_step_ratio(record, b, n) for b in measured.BACKENDS for n in ns]
    misses = [
        s / measured.model_step_ratio(b, n)[1]
        for s, (b, n) in zip(steps, [(b, n) for b in measured.BACKENDS for n in ns])
    ]
    kernels = [
        row["ratio"]
        for b in measured.BACKENDS
        for n in ns
        for row in measured.kernel_rows(record, b, n)
        if row["ratio"] is not None
    ]
    assert f"costs {min(steps):.0f}–{max(steps):.0f}× a RoPE step" in readme
    assert f"estimates are {min(misses):.1f}–{max(misses):.1f}× below" in readme
    assert f"kernels {min(kernels):.1f}–{max(kernels):.1f}× below" in readme


def test_assembled_ratio_is_the_stated_formula(record):
    """An independent restatement at L = 2048: 32 layers of (matmuls fwd + bwd + recompute +
    attention) plus the LM head; RoPE's and triton-pair's attention forward counted twice."""
    row = record["benchmark"]["lengths"]["2048"]
    ms, pair = row["ms"], row["kernels_ms"]["pair_bias"]
    lin = ms["linear_layer"] + ms["linear_layer_fwd"]
    rope = 32 * (lin + ms["rope_flash"] + ms["rope_flash_fwd"]) + ms["lm_head"]
    fused = 32 * (lin + ms["mdlmpe_triton"]) + ms["lm_head"]
    pair_step = 32 * (lin + ms["mdlmpe_triton_pair"] + pair["pair_forward"] + pair["attn_bias_fwd (sdpa)"])
    assert measured.measured_step_ratio(record, "triton", 2048) == pytest.approx(fused / rope, rel=1e-12)
    assert measured.measured_step_ratio(record, "triton-pair", 2048) == pytest.approx(
        (pair_step + ms["lm_head"]) / rope, rel=1e-12
    )


def test_kernel_rows_model_the_kernels_as_built(record):
    """triton-pair's model is the built kernels' (their grids: the key-side backward has one
    program per 16 keys, the query side one per 8 rows, the forward one per 8 x 16 tile; dBias
    waits on HBM), each kernel once as the benchmark timed it; every measured kernel of a backend
    has a model row, and the ranges are ordered."""
    from gpu_cost import pair_built, recorded
    from gpu_cost.assumptions import Scenario

    sc, rec = Scenario("central"), recorded.load()
    launches = {
        k: pair_built.built_launch(k, 2048, sc, rec, pair_built.MEASURED[k]) for k in pair_built.KERNELS
    }
    assert launches["pair_backward_k"].programs == 2048 // 16
    assert launches["pair_backward_q"].programs == 2048 // 8
    assert launches["pair_forward"].programs == (2048 // 8) * (2048 // 16)
    assert launches["pair_backward_k"].latency == "hbm_latency" and launches["pair_forward"].runs == 1
    for backend, (design, _) in measured.BACKENDS.items():
        timed = set(record["benchmark"]["lengths"]["2048"]["kernels_ms"][design])
        modelled = {r["kernel"] for r in measured.kernel_rows(record, backend, 2048)}
        assert timed <= modelled, f"{backend}: measured kernels without a model row: {timed - modelled}"
        for r in measured.kernel_rows(record, backend, 2048):
            assert r["model"][0] <= r["model"][1] <= r["model"][2]


def test_estimate_command_prints_the_measured_tables(record, capsys):
    import estimate_gpu

    assert estimate_gpu.main(["--measured"]) == 0
    out = capsys.readouterr().out
    assert measured.step_table(record) in out and measured.rope_table(record) in out
    for n in measured.lengths(record):
        assert measured.kernel_table(record, n) in out


def test_what_would_help_table_is_the_models():
    """docs/gpu.md's ESTIMATE of changes to the backward pair kernels is pair_built's output, and
    the reading beside it holds: a split alone does not help at L = 2048 (one CTA per SM), a split
    with a register cap does."""
    from gpu_cost import pair_built, recorded

    table = pair_built.changes_table(2048, recorded.load())
    assert table in (REPO / "docs" / "gpu.md").read_text()
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    key = [float(r[1]) for r in rows]
    assert key[1] == key[0] and key[3] < key[0] / 1.5
