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
    sweep, counters = measured.load(measured.SWEEP), measured.load(measured.COUNTERS)
    for table in (
        measured.kernel_table(record, 2048),
        measured.rope_table(record),
        measured.calibration_table(record),
        measured.before_after_table(record),
        measured.sweep_table(sweep, "triton"),
        measured.sweep_table(sweep, "triton-pair"),
        measured.counter_table(counters),
        measured.sweep_model_table(sweep),
        measured.rework_table(record),
        measured.floor_table(record),
    ):
        assert table in gpu, f"docs/gpu.md lacks this generated table:\n{table}"


def test_the_ranges_the_readme_quotes_are_the_records(record):
    """'costs 3–11× a RoPE step', 'central step ratios are 1.1–1.6× below', 'kernels 0.8–3.3× off'
    (the README's words, line breaks read as spaces)."""
    readme = " ".join((REPO / "README.md").read_text().split())
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
    assert f"central step ratios are {min(misses):.1f}–{max(misses):.1f}× below" in readme
    assert f"its kernels {min(kernels):.1f}–{max(kernels):.1f}× off" in readme


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
    """triton-pair's model is the built kernels' at the launcher's settings (each kernel its own
    tile and the launch rule's splits: the forward one program per 16 x 8 tile, the query side one
    per 16 rows and key split, the key side one per 8 keys and row split; dBias waits on HBM),
    each kernel once as the benchmark timed it; every measured kernel of a backend has a model
    row, and the ranges are ordered."""
    from gpu_cost import pair_built, recorded
    from gpu_cost.assumptions import Scenario

    sc, rec = Scenario("central"), recorded.load()
    splits = pair_built.launch_splits(2048, int(sc["sms"]))
    assert splits == {"pair_forward": 1, "pair_backward_q": 4, "pair_backward_k": 3}  # launch docstring
    launches = {k: pair_built.built_launch(k, 2048, sc, rec, splits[k]) for k in pair_built.KERNELS}
    assert launches["pair_backward_k"].programs == (2048 // 8) * 3
    assert launches["pair_backward_q"].programs == (2048 // 16) * 4
    assert launches["pair_forward"].programs == (2048 // 16) * (2048 // 8)
    assert launches["pair_backward_k"].latency == "hbm_latency" and launches["pair_forward"].runs == 1
    assert {k: (r.warps, r.registers) for k, r in pair_built.BUILT.items()} == {
        "pair_forward": (8, 106),
        "pair_backward_q": (8, 255),
        "pair_backward_k": (8, 128),
    }
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


def test_the_launchers_defaults_are_the_sweeps_fastest():
    """The settings the launchers pick on sm_90 are the ones the H100 sweep measured fastest, each
    kernel its own: the fused backward (the layer's largest kernel) at its minimum and the layer
    within 2% of the fastest setting (2 stages: 1% faster, within the noise of repeats); the
    pair forward and query side at 16 x 8 / 8 warps, each within 5% of its kernel's fastest
    setting; the key side's 32 x 8 at its kernel's minimum."""
    import torch
    from sweep_launch_gpu import FUSED_CANDIDATES, PAIR_CANDIDATES

    from mdlmpe_ds.attention.triton.launch import (
        PairLaunchConfig,
        launch_config,
        pair_kernel_settings,
        pair_launch_config,
    )

    sweep = measured.load(measured.SWEEP)
    fused = measured.sweep_runs(sweep, "triton")
    config = launch_config(128, torch.bfloat16, 90)
    default = next(
        n
        for n, s in FUSED_CANDIDATES.items()
        if (
            s["block_size"],
            s["heads_per_program"],
            s["num_warps"],
            s["num_stages"],
            s.get("max_registers", 255),
        )
        == (config.tile, config.heads_per_program, config.num_warps, config.num_stages, config.max_registers)
    )
    backward = {n: r["kernels_ms"]["backward"] for n, r in fused.items() if n != default}
    assert fused[default]["kernels_ms"]["backward"] <= 1.01 * min(backward.values())
    assert fused[default]["layer_ms"] <= 1.02 * min(r["layer_ms"] for r in fused.values())

    pair = measured.sweep_runs(sweep, "triton-pair")
    uniform = {n: r for n, r in pair.items() if "tile_m" in PAIR_CANDIDATES[n]}
    settings = pair_launch_config(128, torch.bfloat16, 90)
    for kernel, slack in (("pair_forward", 1.05), ("pair_backward_q", 1.05), ("pair_backward_k", 1.0)):
        own = pair_kernel_settings(settings, kernel)
        times = {n: r["kernels_ms"][kernel] for n, r in uniform.items()}
        same = [
            t
            for n, t in times.items()
            if pair_kernel_settings(PairLaunchConfig.uniform(**PAIR_CANDIDATES[n]), kernel) == own
        ]
        assert same, f"{kernel}: the sweep has no run at the launcher's {own}"
        assert min(same) <= slack * min(times.values()), kernel
    # the per-kernel default, run as a whole, is the fastest pair layer
    assert pair["per_kernel"]["layer_ms"] == min(r["layer_ms"] for r in pair.values())


def test_the_new_defaults_agree_with_the_old_and_are_faster():
    """The confirming run: on the same inputs, the old and new settings give the same output and
    gradients up to bf16 rounding, and the new ones are faster."""
    runs = measured.load(measured.SWEEP)["confirm"]["runs"]
    for new, old in (("triton-pair/per_kernel", "triton-pair/8x16w8"), ("triton/t64g1w8", "triton/t64g2w4")):
        assert runs[new]["layer_ms"] < 0.85 * runs[old]["layer_ms"]
        errors = runs[old]["max_rel_err_vs_new_default"]
        assert set(errors) >= {"out", "dq", "dk", "dv"} and max(errors.values()) < 5e-3, (old, errors)


def test_the_readme_quotes_the_sweep_and_the_counters(record):
    """The README's before/after layer times and step ratio at L = 2048 are the record's, and its
    reading of the counters (warps per scheduler, L2 and FMA-pipe ranges) is the counters'."""
    readme = " ".join((REPO / "README.md").read_text().split())
    then, now = record["previous"]["lengths"]["2048"]["ms"], record["benchmark"]["lengths"]["2048"]["ms"]
    for method in ("mdlmpe_triton", "mdlmpe_triton_pair"):
        assert f"from {then[method]:.1f} to {now[method]:.1f} ms" in readme, method
    before = measured.measured_step_ratio(measured.previous(record), "triton", 2048)
    assert f"from {before:.2f}× to {measured.measured_step_ratio(record, 'triton', 2048):.2f}×" in readme
    current = measured.load(measured.COUNTERS)["current"].values()
    warps = [k["warps_per_scheduler"] for k in current]
    l2, fma = [k["l2_pct"] for k in current], [k["fma_pipe_pct"] for k in current]
    assert f"with {round(min(warps))}–{round(max(warps))} warps per scheduler" in readme
    assert f"L2 at {round(min(l2))}–{round(max(l2))}% of its peak" in readme
    assert f"the FMA pipe at {round(min(fma))}–{round(max(fma))}%" in readme
    assert all(k["top_stalls"][0][0] == "long_scoreboard" for k in current)  # "waits on memory latency"


def test_the_model_is_held_against_every_swept_setting():
    """Each fused sweep setting has its own sm_90 compile in the record (so the model's row is that
    setting's, not the default's), the rows cover every setting that ran, and the README quotes
    the rank correlation the table prints."""
    from gpu_cost import recorded
    from sweep_launch_gpu import FUSED_CANDIDATES

    sweep = measured.load(measured.SWEEP)
    compiled = recorded.load(recorded.SWEEP_RECORD)
    assert set(compiled) == set(FUSED_CANDIDATES)
    warps = {n: compiled[n]["backward"][0].warps for n in compiled}
    assert warps == {n: s["num_warps"] for n, s in FUSED_CANDIDATES.items()}
    rows = measured.sweep_model_rows(sweep)
    ran = {
        key.split("/", 1)[1]
        for part in ("sweep", "confirm")
        for key, run in sweep[part]["runs"].items()
        if key.startswith("triton/") and "error" not in run
    }
    assert {r["setting"] for r in rows} == ran and len(rows) == len(ran) == 15
    rho = measured.spearman([r["measured"]["backward"] for r in rows], [r["model"]["backward"] for r in rows])
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"rank correlation of {rho:.2f} with the measurements" in readme
    assert measured.spearman([1, 2, 3], [1, 2, 3]) == 1.0 and measured.spearman([1, 2, 3], [3, 2, 1]) == -1.0


def test_the_rework_estimate_and_its_quotes(record, monkeypatch):
    """The head-loop rework's ESTIMATE (``measured.rework_step_ratio``) scales only the pair
    kernels: with today's instruction counts set to the timed build's it returns the measured
    ratio, and it falls with them. The README quotes its numbers from the records."""
    from gpu_cost import pair_built

    got, estimate = measured.rework_step_ratio(record, 2048)
    assert got == measured.measured_step_ratio(record, "triton-pair", 2048)
    assert estimate < got
    monkeypatch.setattr(pair_built, "TODAY_EXECUTED", dict(pair_built.MEASURED_BUILD_EXECUTED))
    assert measured.rework_step_ratio(record, 2048)[1] == pytest.approx(got, rel=1e-12)
    monkeypatch.undo()
    readme = " ".join((REPO / "README.md").read_text().split())
    before, now = (
        pair_built.MEASURED_BUILD_LOOPS["pair_forward"][0],
        pair_built.TODAY_LOOPS["pair_forward"][0],
    )
    assert f"(forward {before['instructions']} → {now['instructions']} per warp)" in readme
    assert f"block barriers per head {before['barriers']} → {now['barriers']} in the forward" in readme
    assert f"would move from {got:.2f}× to {estimate:.2f}×, an ESTIMATE" in readme
    cuts = [
        1 - pair_built.TODAY_EXECUTED[k] / pair_built.MEASURED_BUILD_EXECUTED[k] for k in pair_built.KERNELS
    ]
    method = " ".join((REPO / "docs" / "method.md").read_text().split())
    assert f"{100 * min(cuts):.0f}–{100 * max(cuts):.0f}% fewer instructions per program" in method


def test_the_pair_arithmetic_floor_and_what_the_targets_ask(record):
    """The floor from first principles (31 FP32 operations per head, i, j, pair and step at 132 SMs
    x 128 lanes x 1.755 GHz), its step ratio equal to the step assembly of the measured pieces with
    the pair kernels at the floor, the share each target needs giving exactly the target there,
    and the figures docs/gpu.md and the README quote."""
    assert measured.STEP_PAIR_FP32 == 31
    floor = measured.pair_fp32_floor_ms(2048)
    assert floor == pytest.approx(1e3 * 31 * 32 * 2048**2 * 32 / (132 * 128 * 1.755e9))
    assert measured.pair_fp32_floor_ms(4096) == pytest.approx(4 * floor)
    rows = {(r["length"], r["arrangement"].split()[0]): r for r in measured.floor_rows(record)}
    for (length, kind), r in rows.items():
        got = record["benchmark"]["lengths"][str(length)]
        ms, kernels = dict(got["ms"]), {d: dict(k) for d, k in got["kernels_ms"].items()}
        for share, ratio in ((1.0, r["floor_ratio"]), (r["target_share"], r["target"])):
            pair_ms = r["floor_ms"] / share
            if kind == "pair":  # the biased SDPA as measured; both pair forwards in pair_ms
                sdpa = kernels["pair_bias"]
                ms["mdlmpe_triton_pair"] = (
                    sdpa["attn_bias_fwd (sdpa)"] + sdpa["attn_bias_bwd (sdpa)"] + pair_ms
                )
                sdpa["pair_forward"] = 0.0
                assert measured.assembled_step_ratio(ms, kernels, "triton-pair") == pytest.approx(ratio)
            else:  # RoPE flash's fwd + bwd for the attention part
                ms["mdlmpe_triton"] = ms["rope_flash"] + pair_ms
                assert measured.assembled_step_ratio(ms, kernels, "triton") == pytest.approx(ratio)
    assert all(r["moonshot_share"] > 1 for r in rows.values())  # no FP32 design reaches the moonshot
    gpu = " ".join((REPO / "docs" / "gpu.md").read_text().split())
    readme = " ".join((REPO / "README.md").read_text().split())
    ratio = {key: f"{r['floor_ratio']:.2f}×" for key, r in rows.items()}
    shares = [r["target_share"] for r in rows.values()]
    today = [r["today_share"] for r in rows.values()]
    half = [r["target_share"] / 2 for r in rows.values()]

    def span(values: list[float]) -> str:
        return f"{100 * min(values):.0f}–{100 * max(values):.0f}%"

    fused, pair = ratio[2048, "fused"], ratio[2048, "pair"]
    quoted = [
        f"the step alone is {fused} (fused) and {pair} (pair + SDPA bias) at L = 2048, "
        f"{ratio[4096, 'fused']} and {ratio[4096, 'pair']} at 4096",
        f"The targets need {span(shares)} of the FP32 peak",
        f"Today's kernels reach {span(today)}",
        f"At twice the FP32 rate the targets need {span(half)}",
    ]
    for text in quoted:
        assert text in gpu, text
    assert (
        f"the step would still be {fused} (fused) to {pair} (pair + SDPA bias) at L = 2048, so the "
        f"targets need {span(shares)} of the FP32 peak on the pair arithmetic, where today's kernels "
        f"reach {span(today)}"
    ) in readme
