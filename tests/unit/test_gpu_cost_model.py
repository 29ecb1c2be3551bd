"""benchmarks/gpu_cost: each term of the per-kernel GPU cost model moves the estimate the right way.

No GPU and, except the calibration and the recorded-compile check, no compiler: the model's
inputs for today's kernels come from the recorded sm_90 compile (benchmarks/gpu_cost/sm90_kernels.json).
Each term is checked on a small synthetic launch where its direction is unambiguous (less L2
bandwidth, deeper prefetch, same-address atomics, spills beyond L1, barriers), then on the real
designs: ranges ordered low <= central <= high, recompute counted, the command's output labelled
ESTIMATE, the calibration within its stated band.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from gpu_cost import designs, kernel_model, recorded, step  # noqa: E402
from gpu_cost.assumptions import ASSUMPTIONS, SCENARIOS, Assumption, Scenario  # noqa: E402
from gpu_cost.kernel_model import Launch, Resources, Work, launch_time  # noqa: E402

CENTRAL = Scenario("central")
ONE_CTA = Resources(warps=4, stages=1, registers=255, spill_bytes=0, shared_bytes=180 * 1024, barriers=0)


def _launch(res: Resources = ONE_CTA, **work) -> Launch:
    return Launch("k", res, Work(**work), programs=132 * 4, iters=64)


@pytest.fixture(scope="module")
def rec():
    return recorded.load()


def test_assumptions_have_sources_and_ordered_values():
    for a in ASSUMPTIONS.values():
        assert a.source and a.unit and a.low <= a.central <= a.high, a
        assert a.source in a.line()
    with pytest.raises(ValueError, match="low <= central <= high"):
        Assumption("x", 2.0, 1.0, 3.0, "u", "s")
    # The optimistic scenario takes the better end: the highest bandwidth, the lowest latency.
    assert Scenario("low")["l2_tbs"] == ASSUMPTIONS["l2_tbs"].high
    assert Scenario("low")["l2_latency"] == ASSUMPTIONS["l2_latency"].low
    with pytest.raises(ValueError, match="unknown"):
        Scenario("central", {"no_such_figure": 1.0})


def test_halving_l2_bandwidth_slows_an_l2_bound_kernel(rec):
    backward = designs.layer("current", 2048, CENTRAL, rec).timings[2]
    assert backward.name == "backward" and backward.bound == "l2"
    half = CENTRAL.with_(l2_tbs=CENTRAL["l2_tbs"] / 2)
    slower = designs.layer("current", 2048, half, rec).timings[2]
    assert slower.ms > 1.5 * backward.ms
    # A kernel with no L2 traffic does not care.
    fp32 = _launch(fp32=4000.0, issue=4000.0)
    assert launch_time(fp32, half).ms == pytest.approx(launch_time(fp32, CENTRAL).ms)


def test_more_prefetch_stages_hide_more_latency():
    # Short iterations at one CTA per SM: the L2 latency is exposed unless prefetched.
    times = [
        launch_time(_launch(dataclasses.replace(ONE_CTA, stages=s), fp32=200.0, l2_bytes=512.0), CENTRAL).ms
        for s in (1, 2, 3)
    ]
    assert times[0] > times[1] >= times[2]
    res = dataclasses.replace(ONE_CTA, stages=1)
    exposed = kernel_model.round_cycles(50.0, res, 1, CENTRAL) - 50.0
    assert exposed == pytest.approx(CENTRAL["l2_latency"])
    # Two resident CTAs hide one another's latency: the round is no longer than two iterations
    # plus what is left exposed.
    assert kernel_model.round_cycles(50.0, res, 2, CENTRAL) < 2 * (50.0 + exposed)


def test_same_address_atomics_serialise():
    base = dict(fp32=100.0, atomics=20000.0)
    spread = launch_time(_launch(**base, atomic_degree=1.0), CENTRAL).ms
    same = launch_time(_launch(**base, atomic_degree=16.0), CENTRAL).ms
    assert same > spread
    no_serial = CENTRAL.with_(atomic_serial=0.0)
    assert launch_time(_launch(**base, atomic_degree=16.0), no_serial).ms == pytest.approx(
        launch_time(_launch(**base, atomic_degree=1.0), no_serial).ms
    )


def test_spills_reach_l2_only_beyond_the_l1_left_after_shared_memory():
    small = dataclasses.replace(ONE_CTA, spill_bytes=16, shared_bytes=32 * 1024)
    assert kernel_model.spill_l2_share(small, 1, CENTRAL) == 0.0  # 8 KiB of spills in ~223 KiB
    big = dataclasses.replace(ONE_CTA, spill_bytes=2016)  # 252 KiB against ~75 KiB left
    share = kernel_model.spill_l2_share(big, 1, CENTRAL)
    assert 0.0 < share < CENTRAL["spill_miss"]
    fuller = dataclasses.replace(big, shared_bytes=200 * 1024)
    assert kernel_model.spill_l2_share(fuller, 1, CENTRAL) > share
    # The same accesses cost more where the spill stack does not fit L1 (they go on to L2).
    work = dict(fp32=100.0, spill_access_bytes=64 * 1024.0)
    fits = dataclasses.replace(big, spill_bytes=0)
    assert (
        launch_time(_launch(big, **work), CENTRAL).ms > 1.5 * launch_time(_launch(fits, **work), CENTRAL).ms
    )


def test_barriers_and_occupancy():
    plain = _launch(fp32=2000.0)
    barred = _launch(dataclasses.replace(ONE_CTA, barriers=100), fp32=2000.0)
    assert launch_time(barred, CENTRAL).ms > launch_time(plain, CENTRAL).ms
    assert kernel_model.ctas_per_sm(ONE_CTA) == 1  # 180 KiB of shared memory
    assert kernel_model.ctas_per_sm(dataclasses.replace(ONE_CTA, shared_bytes=100 * 1024)) == 2
    assert kernel_model.ctas_per_sm(dataclasses.replace(ONE_CTA, shared_bytes=0, registers=64)) == 8
    # More warps per scheduler overlap the pipes better.
    pipes = {"issue": 10.0, "fp32": 10.0, "alu": 0.0, "mufu": 0.0, "tensor": 8.0, "shared": 2.0, "l2": 5.0}
    assert kernel_model.overlapped(pipes, 2, CENTRAL) < kernel_model.overlapped(pipes, 1, CENTRAL)


def test_recompute_and_baselines():
    assert step.rest_of_step_ms(2048, CENTRAL, recompute=True) == pytest.approx(
        8 / 6 * step.rest_of_step_ms(2048, CENTRAL, recompute=False)
    )
    rope = step.rope_layer_ms("fa3", 2048, CENTRAL)
    assert rope["layer_ms"] == pytest.approx(2 * rope["forward_ms"] + rope["backward_ms"])
    assert 2.9 < step.rope_layer_ms("fa3", 4096, CENTRAL)["bwd_over_fwd"] < 3.5  # FA3: ~3.3
    fa3, fa2, mea = (step.rope_layer_ms(b, 2048, CENTRAL)["layer_ms"] for b in step.BASELINES)
    assert fa3 < fa2 < mea


@pytest.mark.parametrize("design", designs.DESIGNS)
def test_ranges_are_ordered(design, rec):
    for length in (1024, 2048, 4096):
        ms = {s: designs.layer(design, length, Scenario(s), rec).ms for s in SCENARIOS}
        assert ms["low"] <= ms["central"] <= ms["high"], (design, length, ms)
        for base in step.BASELINES:
            low, central, high = step.ratio_range(ms, base, length)
            assert 1.0 < low <= central <= high, (design, base, length)


def test_redesigns_rank_as_their_l2_and_fp32_work_says(rec):
    at = {d: designs.layer(d, 2048, CENTRAL, rec) for d in designs.DESIGNS}
    assert at["pair_bias_tc"].ms < at["pair_bias"].ms < at["current"].ms
    assert at["no_rewrite"].ms < at["current"].ms
    l2 = {d: sum(t.l2_gb for t in e.timings) for d, e in at.items()}
    assert l2["pair_bias"] < l2["current"] / 10  # alpha / beta no longer streamed per head group
    mem = {d: designs.extra_memory_gib(d, 4096, 4) for d in designs.DESIGNS}
    assert mem["current"] == pytest.approx(24.0) and mem["pair_bias"] == pytest.approx(8.0)


def test_command_prints_estimates_and_writes_json(tmp_path, capsys):
    import estimate_gpu

    out = tmp_path / "est.json"
    argv = ["--no-calibration", "--lengths", "2048", "--designs", "current", "pair_bias", "--json", str(out)]
    assert estimate_gpu.main(argv) == 0
    text = capsys.readouterr().out
    assert text.count("[ESTIMATE]") >= 4 and "l2_tbs" in text and "previous model" in text
    data = json.loads(out.read_text())
    assert data["label"] == "ESTIMATE" and {r["design"] for r in data["designs"]} >= {"current"}
    for row in data["designs"]:
        low, central, high = row["ratio_fa3"]
        assert low <= central <= high


def _compiler_or_skip():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: no compiler in this process")


def test_calibration_within_its_band():
    """Fitted at S = 2048 only, the model predicts the published TFLOP/s of the tutorial-style
    FA2 forward at the other lengths within 20%, and the fit is the assumption's stated value."""
    _compiler_or_skip()
    from gpu_cost import calibrate

    try:
        fitted = calibrate.fit_non_overlap()
    except Exception as err:  # no ptxas / cuobjdump for sm_90 in this triton
        pytest.skip(f"triton cannot compile for sm_90 here: {err}")
    assert fitted == pytest.approx(ASSUMPTIONS["non_overlap"].central, abs=0.02)
    rows = calibrate.calibration_rows(fitted)
    for row in rows:
        slow, central, fast = row["predicted"]
        assert slow <= central <= fast
        assert 0.8 <= row["ratio"] <= 1.2, row
    res, counts = calibrate.compile_setting(*calibrate.CENTRAL_SETTING)
    bm, bn = calibrate.CENTRAL_SETTING[:2]
    assert counts.tensor_macs["HGMMA"] * res.warps == pytest.approx(2 * bm * bn * calibrate.HEAD_DIM)


def test_recorded_compile_is_todays_kernels():
    """The recorded resources are those of today's kernels at the launcher's sm_90 settings (the
    compiles tests/unit/test_triton_resources.py makes too, so Triton's cache has them): after a
    kernel change, refresh the record with `python benchmarks/estimate_gpu.py --compile`."""
    _compiler_or_skip()
    import torch

    from mdlmpe_ds.attention.triton.aot import compile_cubin, resource_usage
    from mdlmpe_ds.attention.triton.launch import KERNELS

    stored = json.loads(recorded.RECORD.read_text())["default"]
    for kernel in KERNELS:
        try:
            compiled = compile_cubin(kernel, 128, torch.bfloat16, 90)
        except Exception as err:
            pytest.skip(f"triton cannot compile for sm_90 here: {err}")
        usage = resource_usage(compiled.asm["cubin"])
        fresh = dict(
            registers=usage["REG"], spill_bytes=usage["STACK"], shared_bytes=int(compiled.metadata.shared)
        )
        recorded_now = {k: stored[kernel]["resources"][k] for k in fresh}
        assert fresh == recorded_now, (
            f"{kernel}: recorded resources {recorded_now} are stale (compiled: {fresh}); run "
            "`python benchmarks/estimate_gpu.py --compile`"
        )


def test_gpu_benchmark_prints_the_models_side_and_skips_without_a_gpu(capsys):
    """bench_attention_gpu.py measures what the model predicts (per kernel, layer, step ratio with
    recompute) and prints the model beside it; without a GPU --model-only prints the model's side
    and a plain run stops cleanly (exit 2, nothing measured)."""
    import bench_attention_gpu as bench
    import torch

    assert bench.main(["--model-only", "--lengths", "2048"]) == 0
    text = capsys.readouterr().out
    for name in ("phase_forward", "forward", "backward", "phase_backward", "step ratio"):
        assert name in text
    assert "ESTIMATE" in text
    modelled = {
        *bench.model_estimates(2048, 1)["kernels"],
        *bench.model_estimates(2048, 1, "triton-pair")["kernels"],
    }
    assert set(bench.KERNEL_NAMES.values()) <= modelled  # every kernel it times has a model figure
    if not torch.cuda.is_available():
        assert bench.main(["--lengths", "2048"]) == 2


def test_a_kernel_over_the_shared_memory_limit_cannot_launch():
    over = dataclasses.replace(ONE_CTA, shared_bytes=kernel_model.SHARED_PER_CTA_LIMIT + 1)
    with pytest.raises(ValueError, match="cannot launch"):
        launch_time(_launch(over, fp32=1.0), CENTRAL)


def test_a_pair_kernels_compiled_resources_replace_the_assumed_ones(rec):
    """Design (a)'s estimate takes the resources of whatever pair kernel exists: a spill stack
    beyond L1 or more barriers make it slower; a malformed resource string is refused."""
    assumed = designs.layer("pair_bias", 2048, CENTRAL, rec).ms
    given = designs.parse_resources("8,2,255,400,196608,2")
    assert given.spill_bytes == 400 and given.source.startswith("given")
    assert designs.layer("pair_bias", 2048, CENTRAL, rec, pair_resources=given).ms > 1.1 * assumed
    barriers = dataclasses.replace(designs.ASSUMED_PAIR_RESOURCES, barriers=40)
    assert designs.layer("pair_bias", 2048, CENTRAL, rec, pair_resources=barriers).ms > assumed
    with pytest.raises(ValueError, match="warps,stages"):
        designs.parse_resources("8,2,255")
