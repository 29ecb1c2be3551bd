"""What one H100 measured (``measured_h100.json``), set beside the model's ESTIMATE of the same
quantities: per kernel, per MDLMPE layer, the RoPE side's rates, the calibration kernel, and the
LLaDA-8B step ratio assembled from the measured pieces; the launch-settings sweep
(``sweep_h100.json``, with the model's estimate at every fused setting) and Nsight Compute's
counters of every kernel (``counters_h100.json``, beside the model's binding term and L2 traffic).

The record comes from ``benchmarks/bench_attention_gpu.py`` (and ``--calibrate``) run on a lent
H100; its fields say which command, software and settings. The step ratio is *assembled*, not a
timed training step: 32 x (one layer's projections and SwiGLU fwd + bwd + their forward again,
the recompute of gradient checkpointing, + the attention) + the LM head, each measured alone:

- RoPE: SDPA flash fwd + bwd, plus its forward again (it sits inside the checkpointed layer);
- ``triton`` (the fused kernels): fwd + bwd once (``recompute.attention_outside_checkpoint``);
- ``triton-pair``: fwd + bwd, plus its forward again (pair kernel and biased SDPA forward: the
  layer checkpoint recomputes this backend, ``AttentionImpl.keeps_pair_tensors``);
- norms, embeddings, element-wise ops and the optimizer are left out on both sides (they would
  lower the ratio a little); the LM head is measured over every position (the run scores only the
  masked ones, so the real head is cheaper on both sides).

The model's side is computed here, now, from the same code ``estimate_gpu.py`` runs: the fused
kernels from their recorded compile; ``triton-pair`` as built and timed (``pair_built``: its own
grids, each kernel's compiled sm_90 resources), each kernel once per fwd + bwd as timed, and for
the step its forward once more (the recompute).
"""

from __future__ import annotations

import json
from pathlib import Path

from gpu_cost import designs, pair_built, recorded, step
from gpu_cost.assumptions import SCENARIOS, Scenario

RECORD = Path(__file__).with_name("measured_h100.json")
#: The launch-settings sweep (``benchmarks/sweep_launch_gpu.py``) and the Nsight Compute counters.
SWEEP = Path(__file__).with_name("sweep_h100.json")
COUNTERS = Path(__file__).with_name("counters_h100.json")
#: Backend name -> (the model's design, the benchmark's method name).
BACKENDS = {"triton": ("current", "mdlmpe_triton"), "triton-pair": ("pair_bias", "mdlmpe_triton_pair")}
#: Kernels of triton-pair that run again in the recompute of a checkpointed layer.
RECOMPUTED = ("pair_forward", "attn_bias_fwd (sdpa)")


def load(path: Path = RECORD) -> dict:
    return json.loads(path.read_text())


def lengths(record: dict) -> list[int]:
    return sorted(int(n) for n in record["benchmark"]["lengths"])


def layer_model(design: str, length: int) -> dict[str, designs.LayerEstimate]:
    """The model of the kernels as they run in the benchmark, per scenario (fwd + bwd)."""
    rec = recorded.load()
    if design == "pair_bias":
        return {s: pair_built.built_layer(length, Scenario(s), rec) for s in SCENARIOS}
    return {s: designs.layer(design, length, Scenario(s), rec) for s in SCENARIOS}


def kernel_rows(record: dict, backend: str, length: int) -> list[dict]:
    """Per kernel of ``backend`` at ``length``: measured ms (per fwd + bwd, batch 1), the model's
    (low, central, high) for the same runs, and measured / central."""
    design, _ = BACKENDS[backend]
    measured = record["benchmark"]["lengths"][str(length)]["kernels_ms"][design]
    model = layer_model(design, length)
    rows = []
    for timing in model["central"].timings:
        est = tuple(next(t.ms for t in model[s].timings if t.name == timing.name) for s in SCENARIOS)
        got = measured.get(timing.name)
        rows.append(
            dict(
                kernel=timing.name,
                measured=got,
                model=est,
                ratio=None if got is None else got / est[1],
                inside=None if got is None else est[0] <= got <= est[2],
            )
        )
    return rows


def measured_step_ratio(record: dict, backend: str, length: int) -> float:
    """The assembled LLaDA-8B step ratio MDLMPE / RoPE (module docstring), batch 1."""
    row = record["benchmark"]["lengths"][str(length)]
    return assembled_step_ratio(row["ms"], row["kernels_ms"], backend)


def linear_ms(ms: dict[str, float]) -> float:
    """One layer's projections and SwiGLU per step: fwd + bwd, and their forward again (the
    checkpoint's recompute)."""
    return ms["linear_layer"] + ms["linear_layer_fwd"]


def step_ms(ms: dict[str, float], attention: float) -> float:
    """The assembled LLaDA-8B step (the module docstring's sum) with ``attention`` ms per layer."""
    return step.LLADA["layers"] * (linear_ms(ms) + attention) + ms["lm_head"]


def rope_step_ms(ms: dict[str, float]) -> float:
    """The RoPE step: SDPA flash fwd + bwd and its forward again, inside the checkpoint."""
    return step_ms(ms, ms["rope_flash"] + ms["rope_flash_fwd"])


def assembled_step_ratio(ms: dict[str, float], kernels_ms: dict[str, dict], backend: str) -> float:
    """The step ratio from one length's measured pieces (the module docstring's sum): ``ms`` per
    benchmark method, ``kernels_ms`` per design and kernel (``bench_attention_gpu.kernel_times``)."""
    design, method = BACKENDS[backend]
    attention = ms[method] + sum(kernels_ms[design][k] for k in RECOMPUTED if backend == "triton-pair")
    return step_ms(ms, attention) / rope_step_ms(ms)


def model_step_ratio(backend: str, length: int) -> tuple[float, float, float]:
    """The model's (low, central, high) step ratio against the SDPA flash baseline."""
    design, _ = BACKENDS[backend]
    model = layer_model(design, length)
    layer = {s: model[s].ms for s in SCENARIOS}
    if backend == "triton-pair":  # the checkpoint recomputes its forward
        for s in SCENARIOS:
            layer[s] += sum(t.ms for t in model[s].timings if t.name in RECOMPUTED)
    return step.ratio_range(layer, "sdpa_flash", length)


def rope_side(record: dict, length: int) -> dict[str, tuple[float, tuple[float, ...]]]:
    """``rope_rates`` of the record's measurements at ``length`` (batch 1)."""
    return rope_rates(record["benchmark"]["lengths"][str(length)]["ms"], length)


def rope_rates(ms: dict[str, float], length: int, batch: int = 1) -> dict[str, tuple[float, tuple]]:
    """Measured value and the model's (low, central, high) assumption of the RoPE side, from one
    length's ``ms`` per benchmark method: SDPA flash forward and backward TFLOP/s, the
    memory-efficient path with a padding bias (fwd + bwd TFLOP/s), and the MFU of one layer's
    matmuls (fwd + bwd)."""
    flops = step.attention_flops(length, batch)
    hidden, ffn = step.LLADA["hidden"], step.LLADA["ffn"]
    linear_flops = 6 * (4 * hidden**2 + 3 * hidden * ffn) * length * batch
    ratio = step.BWD_FLOPS_RATIO
    scenarios = [Scenario(s) for s in SCENARIOS]
    return {
        "SDPA flash forward, TFLOP/s": (
            flops / (ms["rope_flash_fwd"] * 1e9),
            tuple(sc["fa2_fwd"] for sc in scenarios),
        ),
        "SDPA flash backward, TFLOP/s": (
            ratio * flops / ((ms["rope_flash"] - ms["rope_flash_fwd"]) * 1e9),
            tuple(sc["fa2_bwd"] for sc in scenarios),
        ),
        "SDPA memory-efficient with a padding bias, fwd + bwd TFLOP/s": (
            (1 + ratio) * flops / (ms["rope_padded_mea"] * 1e9),
            tuple((1 + ratio) / (1 / sc["mea_fwd"] + ratio / sc["mea_bwd"]) for sc in scenarios),
        ),
        "MFU of a layer's matmuls": (
            linear_flops / (ms["linear_layer"] * 1e-3) / step.DENSE_BF16_FLOPS,
            tuple(sc["mfu"] for sc in scenarios),
        ),
    }


def step_table(record: dict) -> str:
    """The README's table: assembled measured step ratio beside the model's ESTIMATE."""
    ns = lengths(record)
    head = "| LLaDA-8B step ÷ RoPE step (SDPA flash), micro-batch 1, bf16, checkpointing on | " + " | ".join(
        f"L = {n}" for n in ns
    )
    lines = [head + " |", "|---" * (len(ns) + 1) + "|"]
    for backend in BACKENDS:
        got = " | ".join(f"{measured_step_ratio(record, backend, n):.2f}×" for n in ns)
        lines.append(f"| `{backend}`, measured on one H100 (assembled) | {got} |")
        est = " | ".join("{1:.2f}× ({0:.2f}–{2:.2f})".format(*model_step_ratio(backend, n)) for n in ns)
        lines.append(f"| `{backend}`, the model's ESTIMATE, central (low–high) | {est} |")
    return "\n".join(lines)


def kernel_table(record: dict, length: int) -> str:
    """docs/gpu.md's per-kernel table at ``length``: measured, the model, measured / central."""
    lines = [
        "| backend | kernel | measured ms | model ESTIMATE ms, central (low–high) | measured ÷ central |",
        "|---|---|---|---|---|",
    ]
    for backend in BACKENDS:
        for row in kernel_rows(record, backend, length):
            if row["measured"] is None:
                continue
            low, central, high = row["model"]
            lines.append(
                f"| `{backend}` | {row['kernel']} | {row['measured']:.2f} | "
                f"{central:.2f} ({low:.2f}–{high:.2f}) | {row['ratio']:.1f} |"
            )
    return "\n".join(lines)


def rope_table(record: dict) -> str:
    """docs/gpu.md's table of the RoPE side: measured against the model's assumption."""
    ns = lengths(record)
    lines = [
        "| quantity | " + " | ".join(f"L = {n}" for n in ns) + " | assumed low / central / high |",
        "|---" * (len(ns) + 2) + "|",
    ]
    sides = {n: rope_side(record, n) for n in ns}
    for name, (_, assumed) in sides[ns[0]].items():
        fmt = ".2f" if name.startswith("MFU") else ".0f"
        got = " | ".join(format(sides[n][name][0], fmt) for n in ns)
        lines.append(f"| {name} | {got} | " + " / ".join(format(a, fmt) for a in assumed) + " |")
    return "\n".join(lines)


def calibration_table(record: dict) -> str:
    """docs/gpu.md's table: the calibration kernel measured on the H100 against the published
    figure the model was fitted to."""
    rows = record["calibration"]["rows"]
    return "\n".join(
        [
            "| S | " + " | ".join(str(r["length"]) for r in rows) + " |",
            "|---" * (len(rows) + 1) + "|",
            "| published (PR 2391), TFLOP/s | " + " | ".join(f"{r['published']:.0f}" for r in rows) + " |",
            "| measured, tutorial's central setting | "
            + " | ".join(f"{r['central']:.0f}" for r in rows)
            + " |",
            "| measured, fastest setting of its space | "
            + " | ".join(f"{r['best']:.0f}" for r in rows)
            + " |",
            "| measured central ÷ published | "
            + " | ".join(f"{r['central'] / r['published']:.2f}" for r in rows)
            + " |",
        ]
    )


def previous(record: dict) -> dict:
    """The record's "previous" benchmark (the settings before the sweep) in the shape of a record,
    for the functions that read one (``measured_step_ratio``)."""
    return {"benchmark": {"lengths": record["previous"]["lengths"]}}


def before_after_table(record: dict) -> str:
    """docs/gpu.md's table: one layer's MDLMPE attention (fwd + bwd, ms) and the assembled step
    ratio at the launch settings before the sweep (``record["previous"]``) and now."""
    ns = lengths(record)
    lines = [
        "| backend | quantity | " + " | ".join(f"L = {n}" for n in ns) + " |",
        "|---" * (len(ns) + 2) + "|",
    ]
    then = previous(record)
    for backend, (_, method) in BACKENDS.items():
        for label, rec in (("before", then), ("now", record)):
            ms = " | ".join(f"{rec['benchmark']['lengths'][str(n)]['ms'][method]:.1f}" for n in ns)
            lines.append(f"| `{backend}` | layer ms, {label} | {ms} |")
        for label, rec in (("before", then), ("now", record)):
            got = " | ".join(f"{measured_step_ratio(rec, backend, n):.2f}×" for n in ns)
            lines.append(f"| `{backend}` | step ratio, {label} | {got} |")
    return "\n".join(lines)


#: The kernels each backend's sweep table shows, in launch order.
SWEEP_KERNELS = {
    "triton": ("forward", "backward"),
    "triton-pair": ("pair_forward", "pair_backward_q", "pair_backward_k"),
}


def sweep_runs(sweep: dict, backend: str) -> dict[str, dict]:
    """{setting: run} of ``backend`` in the sweep record, every setting that ran (the confirming
    run of a setting replaces the sweep's)."""
    runs = {}
    for part in ("sweep", "confirm"):
        for key, run in sweep[part]["runs"].items():
            if key.startswith(backend + "/") and "kernels_ms" in run:
                runs[key.split("/", 1)[1]] = run
    return runs


def sweep_table(sweep: dict, backend: str) -> str:
    """docs/gpu.md's table of the launch-settings sweep for ``backend``: every setting that ran,
    fastest layer first, ms per kernel and per layer (fwd + bwd at the sweep's length)."""
    kernels = SWEEP_KERNELS[backend]
    ordered = sorted(sweep_runs(sweep, backend).items(), key=lambda item: item[1]["layer_ms"])
    lines = ["| setting | layer ms | " + " | ".join(kernels) + " |", "|---" * (len(kernels) + 2) + "|"]
    for name, run in ordered:
        cells = " | ".join(f"{run['kernels_ms'][k]:.2f}" for k in kernels)
        lines.append(f"| {name} | {run['layer_ms']:.1f} | {cells} |")
    return "\n".join(lines)


#: Counter columns of docs/gpu.md's table: (record key, header).
COUNTER_COLUMNS = (
    ("warps_per_scheduler", "warps / scheduler"),
    ("issue_active_pct", "issue active %"),
    ("fma_pipe_pct", "FMA pipe %"),
    ("l1tex_pct", "L1 %"),
    ("l2_pct", "L2 %"),
    ("l2_gb", "L2 GB"),
)


def counter_rows(counters: dict, length: int = 2048) -> list[dict]:
    """Per kernel, at the current settings: the counters, and the model's ESTIMATE (central) of
    the same launch: its time, its binding term and its L2 traffic."""
    rec = recorded.load()
    sc = Scenario("central")
    model = {t.name: t for t in designs.layer("current", length, sc, rec).timings}
    model.update({t.name: t for t in pair_built.built_layer(length, sc, rec).timings})
    out = []
    for kernel, got in counters["current"].items():
        est = model[kernel]
        runs = 2 if kernel == "phase_forward" else 1  # the model's phase_forward is both launches
        out.append(
            dict(
                kernel=kernel, got=got, model_ms=est.ms / runs, bound=est.bound, model_l2_gb=est.l2_gb / runs
            )
        )
    return out


def counter_table(counters: dict) -> str:
    """docs/gpu.md's table: Nsight Compute's counters of each kernel beside the model's ESTIMATE
    of the same launch (L = 2048, the launchers' settings)."""
    head = " | ".join(h for _, h in COUNTER_COLUMNS)
    lines = [
        f"| kernel | ms | {head} | largest stall | model ms | model's binding term | model L2 GB |",
        "|---" * (len(COUNTER_COLUMNS) + 6) + "|",
    ]
    for row in counter_rows(counters):
        got = row["got"]
        cells = " | ".join(f"{got[k]:g}" for k, _ in COUNTER_COLUMNS)
        stall, warps = got["top_stalls"][0]
        lines.append(
            f"| {row['kernel']} | {got['ms']:.2f} | {cells} | {stall.replace('_', ' ')} ({warps:g}) | "
            f"{row['model_ms']:.2f} | {row['bound']} | {row['model_l2_gb']:.1f} |"
        )
    return "\n".join(lines)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (no ties in these timings)."""
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    return 1.0 - 6.0 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def sweep_model_rows(sweep: dict, length: int = 2048) -> list[dict]:
    """Per ``triton`` setting of the H100 sweep: the measured forward and backward ms beside the
    model's central ESTIMATE of the same kernels, each compiled at that setting
    (``recorded.SWEEP_RECORD``), fastest measured backward first."""
    from sweep_launch_gpu import FUSED_CANDIDATES

    base, compiled = recorded.load(), recorded.load(recorded.SWEEP_RECORD)
    sc = Scenario("central")
    rows = []
    runs = sweep_runs(sweep, "triton")
    for name, run in sorted(runs.items(), key=lambda item: item[1]["kernels_ms"]["backward"]):
        settings = FUSED_CANDIDATES[name]
        shape = (settings["block_size"], settings["heads_per_program"])
        rec = {"default": base["default"], name: compiled[name]}
        model = {t.name: t.ms for t in designs.current_layer(length, sc, rec, name, shape).timings}
        rows.append(
            dict(
                setting=name,
                measured={k: run["kernels_ms"][k] for k in ("forward", "backward")},
                model={k: model[k] for k in ("forward", "backward")},
            )
        )
    return rows


def sweep_model_table(sweep: dict) -> str:
    """docs/gpu.md's table: the model's ESTIMATE of the fused kernels at each swept setting beside
    the H100's measurement, and the rank correlation of the two."""
    rows = sweep_model_rows(sweep)
    lines = [
        "| setting | backward measured | backward model | forward measured | forward model |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        got, est = r["measured"], r["model"]
        lines.append(
            f"| {r['setting']} | {got['backward']:.1f} | {est['backward']:.1f} | "
            f"{got['forward']:.2f} | {est['forward']:.2f} |"
        )
    rho = {
        k: spearman([r["measured"][k] for r in rows], [r["model"][k] for r in rows])
        for k in ("backward", "forward")
    }
    lines.append(f"| rank correlation (Spearman) | | {rho['backward']:.2f} | | {rho['forward']:.2f} |")
    return "\n".join(lines)


def rework_rows(record: dict, length: int = 2048) -> list[dict]:
    """Per triton-pair kernel: the build the H100 timed against today's, by their sm_90 machine code
    (``pair_built``: per head and warp, over all pair chunks; warp-instructions per program pass),
    the measured ms, and the ESTIMATE of today's ms if a kernel's time scaled with the
    instructions it issues (its issue efficiency unchanged; fewer barriers would also shorten
    the latency the counters show it waiting on, which this does not count)."""
    kernels = record["benchmark"]["lengths"][str(length)]["kernels_ms"]["pair_bias"]
    rows = []
    for kernel, loops in pair_built.TODAY_LOOPS.items():
        then = pair_built.per_head(pair_built.MEASURED_BUILD_LOOPS[kernel])
        scale = pair_built.TODAY_EXECUTED[kernel] / pair_built.MEASURED_BUILD_EXECUTED[kernel]
        rows.append(
            dict(
                kernel=kernel,
                before=then,
                now=pair_built.per_head(loops),
                executed=(pair_built.MEASURED_BUILD_EXECUTED[kernel], pair_built.TODAY_EXECUTED[kernel]),
                ms=kernels[kernel],
                estimate_ms=kernels[kernel] * scale,
            )
        )
    return rows


def rework_step_ratio(record: dict, length: int = 2048) -> tuple[float, float]:
    """triton-pair's assembled step ratio as measured, and its ESTIMATE with each pair kernel's
    time scaled as in ``rework_rows`` (the recomputed forward too; SDPA unchanged)."""
    row = record["benchmark"]["lengths"][str(length)]
    kernels = {d: dict(k) for d, k in row["kernels_ms"].items()}
    ms = dict(row["ms"])
    for r in rework_rows(record, length):
        ms["mdlmpe_triton_pair"] += r["estimate_ms"] - r["ms"]
        kernels["pair_bias"][r["kernel"]] = r["estimate_ms"]
    return measured_step_ratio(record, "triton-pair", length), assembled_step_ratio(
        ms, kernels, "triton-pair"
    )


def rework_table(record: dict, length: int = 2048) -> str:
    """docs/gpu.md's table of the head-loop rework (``rework_rows``) at ``length``."""
    head = (
        f"| kernel (L = {length}) | per head and warp, both pair chunks: instructions / barriers / "
        "shared / shuffles, timed build → today | warp-instructions per pass | measured ms | "
        "ESTIMATE ms, issue-scaled |"
    )
    lines = [head, "|---|---|---|---|---|"]
    for r in rework_rows(record, length):
        b, n = r["before"], r["now"]
        loop = (
            f"{b['instructions']} / {b['barriers']} / {b['shared']} / {b['shuffles']} → "
            f"{n['instructions']} / {n['barriers']} / {n['shared']} / {n['shuffles']}"
        )
        executed = f"{r['executed'][0]:,} → {r['executed'][1]:,}"
        lines.append(f"| {r['kernel']} | {loop} | {executed} | {r['ms']:.2f} | {r['estimate_ms']:.2f} |")
    got, estimate = rework_step_ratio(record, length)
    lines.append(f"| step ratio (assembled) | | | {got:.2f}× | {estimate:.2f}× |")
    return "\n".join(lines)


#: The step-ratio targets of the cost issue (LLaDA-8B, all heads, bf16, micro-batch 1) and its
#: moonshot, by length.
TARGETS = {2048: (2.0, 1.6), 4096: (2.8, 2.0)}
#: The pair arithmetic's FP32 operations per (head, i, j, pair) in one training step, the fewest
#: today's formulas take (``designs.PAIR_FP32``): E in the forward (6) and once more (6: the
#: checkpoint's recompute for triton-pair, the backward's recompute inside the fused kernels),
#: the query side's dq and dE/d delta (13), the key side's dk (6).
STEP_PAIR_FP32 = 2 * designs.PAIR_FP32["pair_bias"]["pair_forward"] + sum(
    designs.PAIR_FP32["pair_bias"][k] for k in ("pair_backward_q", "pair_backward_k")
)
#: Per arrangement, from one length's measured ms and kernel ms: (what the attention costs beside
#: the pair arithmetic, per layer and step; what today's kernels of it take for the pair part).
#: Inside a flash kernel: RoPE flash's fwd + bwd once (the fused kernels stay outside the
#: checkpoint); today the fused kernels less that. Beside SDPA with an additive bias: its measured
#: forward twice (the checkpoint recomputes it) and backward once; today the pair kernels, the
#: forward twice.
FLOOR_ARRANGEMENTS = {
    "fused (pair maths inside a flash kernel)": (
        lambda ms, k: ms["rope_flash"],
        lambda ms, k: sum(k["current"].values()) - ms["rope_flash"],
    ),
    "pair + SDPA bias (triton-pair)": (
        lambda ms, k: 2 * k["pair_bias"]["attn_bias_fwd (sdpa)"] + k["pair_bias"]["attn_bias_bwd (sdpa)"],
        lambda ms, k: sum(
            k["pair_bias"][name] * (2 if name in RECOMPUTED else 1)
            for name in ("pair_forward", "pair_backward_q", "pair_backward_k")
        ),
    ),
}


def pair_fp32_floor_ms(length: int, sc: Scenario | None = None) -> float:
    """The pair arithmetic of one LLaDA-8B layer and step (``STEP_PAIR_FP32`` per head, i, j and
    pair) at the FP32 pipe's peak: every SM issuing an FP32 warp-instruction on every lane of every
    clock, nothing else (loads, reductions, the phase MLP, address arithmetic) costing a cycle."""
    sc = sc or Scenario("central")
    ops = STEP_PAIR_FP32 * step.LLADA["heads"] * length**2 * step.NUM_MDLMPE
    lanes_per_s = sc["sms"] * sc["fp32"] * 32 * sc.clock_hz
    return 1e3 * ops / lanes_per_s


def floor_rows(record: dict) -> list[dict]:
    """Per target length and arrangement: the pair arithmetic's FP32 floor, the step ratio with the
    pair kernels at that floor and everything else as measured (the RoPE step, the projections and
    LM head, the attention of the arrangement), and the share of FP32 peak the pair arithmetic
    must reach for the target and for the moonshot (over 1: not reachable in FP32); beside it,
    the share today's kernels reach (the floor over their measured time; the fused kernels' time
    less RoPE flash's, which their attention part is taken to cost)."""
    n = step.LLADA["layers"]
    rows = []
    for length, (target, moonshot) in TARGETS.items():
        row = record["benchmark"]["lengths"][str(length)]
        ms, kernels = row["ms"], row["kernels_ms"]
        rope = rope_step_ms(ms)
        floor = pair_fp32_floor_ms(length)
        for name, (attention, today) in FLOOR_ARRANGEMENTS.items():
            beside = attention(ms, kernels)
            # ms per layer the pair arithmetic may take for a step ratio: the FP32 share it needs
            room = {
                ratio: (ratio * rope - ms["lm_head"]) / n - linear_ms(ms) - beside
                for ratio in (target, moonshot)
            }
            needed = {ratio: floor / left if left > 0 else float("inf") for ratio, left in room.items()}
            today_ms = today(ms, kernels)
            rows.append(
                dict(
                    length=length,
                    arrangement=name,
                    floor_ms=floor,
                    floor_ratio=step_ms(ms, beside + floor) / rope,
                    target=target,
                    moonshot=moonshot,
                    target_share=needed[target],
                    moonshot_share=needed[moonshot],
                    today_ms=today_ms,
                    today_share=floor / today_ms,
                )
            )
    return rows


def floor_table(record: dict) -> str:
    """docs/gpu.md's table of ``floor_rows``."""
    lines = [
        "| L | arrangement | pair FP32 floor, ms per layer | step ratio at the floor | FP32 share "
        "for the target | for the moonshot | the same at twice the FP32 rate (packed 16-bit): target "
        "/ moonshot | today's pair kernels: ms, FP32 share |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def share(x: float) -> str:
        return f"{100 * x:.0f}%" if x <= 1 else f"{100 * x:.0f}%: not reachable"

    for r in floor_rows(record):
        lines.append(
            f"| {r['length']} | {r['arrangement']} | {r['floor_ms']:.2f} | {r['floor_ratio']:.2f}× | "
            f"{share(r['target_share'])} (≤ {r['target']}×) | {share(r['moonshot_share'])} "
            f"(≤ {r['moonshot']}×) | {share(r['target_share'] / 2)} / {share(r['moonshot_share'] / 2)} | "
            f"{r['today_ms']:.1f} ms, {100 * r['today_share']:.0f}% |"
        )
    return "\n".join(lines)
