"""ESTIMATED cost of MDLMPE attention on an H100, per kernel, from sm_90 machine code (no GPU).

The model (``benchmarks/gpu_cost``): each kernel launch's time from its resources (registers,
spills, shared memory, warps, stages, barriers: ahead-of-time sm_90 compiles where the kernel
exists, stated assumptions where it does not) and its work: the issue / FP32 / MUFU / tensor pipes,
shared-memory bytes, L2 traffic with the re-read factor of its grid order, spills beyond the L1 left
after shared memory, atomics with same-address serialisation, the latency that occupancy and
prefetch do not hide, block-wide barriers, waves and HBM. Every assumption is printed with its
source and a low / central / high value; every result is a low / central / high range (the
optimistic, central and pessimistic ends of every assumption together). The model is first run on
a published kernel (our own FlashAttention-2-style forward at the Triton tutorial's settings)
against its published H100 TFLOP/s.

Printed: assumptions; the calibration; kernel resources; per-kernel time at each length (central);
the step ratio MDLMPE / RoPE for LLaDA-8B (32 heads with MDLMPE, bf16, micro-batch 1, gradient
checkpointing on) per design and RoPE baseline; the extra attention memory per design.

    python benchmarks/estimate_gpu.py
    python benchmarks/estimate_gpu.py --lengths 2048 --designs current pair_bias --json est.json
    python benchmarks/estimate_gpu.py --compile            # recompile today's kernels first (~3 min)
    python benchmarks/estimate_gpu.py --no-calibration     # no compiler needed at all
    python benchmarks/estimate_gpu.py --pair-resources 8,2,255,400,196608,6   # a pair kernel's compile
    python benchmarks/estimate_gpu.py --measured           # what one H100 measured, beside the model

``--measured`` prints the tables of ``gpu_cost/measured.py`` (the record ``measured_h100.json``
of a lent H100) and exits: the README's and docs/gpu.md's measured tables are these, verbatim.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_cost import designs, recorded, step
from gpu_cost.assumptions import ASSUMPTIONS, SCENARIOS, Scenario
from gpu_cost.kernel_model import ctas_per_sm

#: The previous model's output (SASS issue counts, perfect overlap, no L2 or latency term, flash
#: baseline costed alike with backward = 2.5x forward, rest of step 6N at 45% MFU), for contrast.
PREVIOUS_MODEL = {1024: 1.69, 2048: 2.27, 4096: 3.39}
LABEL = "ESTIMATE"


def fmt_range(values: tuple[float, float, float], spec: str = ".2f", unit: str = "") -> str:
    low, central, high = values
    return f"{central:{spec}}{unit} ({low:{spec}}-{high:{spec}})"


def design_rows(lengths, names, baselines, attention, rec, overrides=None, pair_resources=None) -> list[dict]:
    """Per (design, length): layer ms and step ratio per baseline, each (low, central, high)."""
    rows = []
    for name in names:
        kinds = attention if name.startswith("pair_bias") else ("-",)
        for kind in kinds:
            for length in lengths:
                per = {
                    s: designs.layer(
                        name, length, Scenario(s, dict(overrides or {})), rec, kind, pair_resources
                    )
                    for s in SCENARIOS
                }
                row = dict(
                    design=per["central"].design,
                    length=length,
                    layer_ms=tuple(per[s].ms for s in SCENARIOS),
                    kernels={t.name: t.ms for t in per["central"].timings},
                    glue_ms=per["central"].glue_ms,
                )
                layer_ms = {s: per[s].ms for s in SCENARIOS}
                for base in baselines:
                    row[f"ratio_{base}"] = step.ratio_range(layer_ms, base, length, overrides)
                rows.append(row)
    return rows


def print_assumptions() -> None:
    print(f"Assumptions (low / central / high; the low scenario takes each one's optimistic end) [{LABEL}]:")
    for a in ASSUMPTIONS.values():
        print(f"  - {a.line()}")
    per_sm = " / ".join(f"{Scenario(s).l2_bytes_per_clk_sm():.0f}" for s in ("high", "central", "low"))
    print(f"  - derived: L2 -> SM per SM per clock (low / central / high): {per_sm} B/clk/SM")
    print(
        "  - LLaDA-8B: 32 layers, hidden 4096, 32 heads = KV heads, d_h 128, FFN 12288, vocab 126464; "
        "all 32 heads with MDLMPE (|M| = 32 pairs); bf16; micro-batch 1; gradient checkpointing on: "
        "matmuls 8 FLOPs per weight per token, RoPE attention forward twice, MDLMPE attention outside "
        "the checkpoint (forward once)."
    )


def print_calibration(space_name: str) -> dict | None:
    from gpu_cost import calibrate

    space = calibrate.TUTORIAL_SPACE if space_name == "tutorial" else (calibrate.CENTRAL_SETTING,)
    try:
        fitted = calibrate.fit_non_overlap(space)
        rows = calibrate.calibration_rows(fitted, space)
    except Exception as err:  # no triton, or no sm_90 compiler in this triton
        print(f"\nCalibration skipped: cannot compile the calibration kernel for sm_90 here ({err})")
        return None
    stated = ASSUMPTIONS["non_overlap"].central
    print(
        f"\nCalibration [{LABEL}]: our FlashAttention-2-style forward, AOT sm_90, settings "
        f"{'the tutorial space' if space_name == 'tutorial' else 'BM 128, BN 64, 3 stages, 4 warps'}; "
        f"H100 SXM, bf16, d 128, 16 heads, B*S = 16k, non-causal. non_overlap fitted at S = "
        f"{calibrate.FIT_LENGTH}: {fitted:.3f} (assumption's central: {stated})."
    )
    print(f"  {'S':>6} {'published':>10} {'predicted central (low-high)':>32} {'pred/pub':>9}")
    for r in rows:
        note = "  <- fitted here" if r["fitted"] else ""
        print(
            f"  {r['length']:>6} {r['published']:>10.0f} {fmt_range(r['predicted'], '.0f', ' TFLOP/s'):>32} "
            f"{r['ratio']:>9.2f}{note}"
        )
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"  largest miss off the fitted point: {100 * worst:.0f}% (central)")
    return dict(fitted_non_overlap=fitted, rows=rows, worst=worst)


def print_resources(rec, pair_resources=None) -> None:
    print("\nKernel resources (today's kernels: AOT sm_90 compiles, recorded; pair kernels: assumed):")
    print(
        f"  {'kernel':<24} {'warps':>5} {'stages':>6} {'regs':>5} {'spill B':>8} {'shared B':>9} "
        f"{'CTA/SM':>6} {'bar/it':>7}"
    )
    items = [(f"{k} [{v}]", r) for v, ks in rec.items() for k, (r, _) in ks.items()]
    items.append(("pair kernels (a), (b)", pair_resources or designs.ASSUMED_PAIR_RESOURCES))
    for name, r in items:
        print(
            f"  {name:<24} {r.warps:>5} {r.stages:>6} {r.registers:>5} {r.spill_bytes:>8} "
            f"{r.shared_bytes:>9} {ctas_per_sm(r):>6} {r.barriers:>7.0f}"
        )


def print_kernels(lengths, names, attention, rec, pair_resources=None) -> None:
    sc = Scenario("central")
    print(f"\nPer kernel, central scenario, per layer (fwd + bwd), ms [{LABEL}]:")
    for name in names:
        for kind in attention if name.startswith("pair_bias") else ("-",):
            for length in lengths:
                est = designs.layer(name, length, sc, rec, kind, pair_resources)
                print(f"  {est.design} L={length}: layer {est.ms:.2f} ms (torch glue {est.glue_ms:.2f})")
                for t in est.timings:
                    terms = ", ".join(f"{k} {v:.2f}" for k, v in t.terms_ms.items() if v >= 0.005)
                    print(
                        f"    {t.name:<26} {t.ms:7.2f}  bound {t.bound:<13} L2 {t.l2_gb:6.1f} GB  "
                        f"HBM {t.hbm_gb:5.2f} GB  | {terms}"
                    )


def print_ratios(rows, baselines, lengths) -> None:
    print(f"\nLLaDA-8B step ratio MDLMPE / RoPE, central (low-high) [{LABEL}]:")
    for base in baselines:
        rope_ms = {
            n: tuple(step.rope_layer_ms(base, n, Scenario(s))["layer_ms"] for s in SCENARIOS) for n in lengths
        }
        rope = ", ".join(f"L={n}: {fmt_range(ms, '.2f', ' ms')}" for n, ms in rope_ms.items())
        print(f"  RoPE baseline {base} (attention per layer, fwd x2 + bwd: {rope})")
        for r in rows:
            if r["length"] == lengths[0]:
                cells = [fmt_range(x[f"ratio_{base}"]) for x in rows if x["design"] == r["design"]]
                print(
                    f"    {r['design']:<24} "
                    + "  ".join(f"L={n}: {c:<18}" for n, c in zip(lengths, cells, strict=True))
                )
    prev = "  ".join(f"L={n}: {PREVIOUS_MODEL[n]:.2f}" for n in lengths if n in PREVIOUS_MODEL)
    if prev:
        print(
            f"  previous model (its recorded output, for contrast; no L2, latency or recompute term): {prev}"
        )


def print_memory(length: int, batch: int, budget: float) -> dict:
    print(f"\nExtra attention memory at the backward's peak, L = {length}, micro-batch {batch} [{LABEL}]:")
    print(
        "  (current / no_rewrite: alpha, beta, d delta [|M|, L, L]; pair_bias*: E and dE [H, L, L] bf16, "
        "the bias a flash attention with bias reads and the dBias it returns)"
    )
    out = {}
    for name in designs.DESIGNS:
        full = designs.extra_memory_gib(name, length, batch)
        seq = designs.extra_memory_gib(name, length, 1)
        capped = designs.extra_memory_gib(name, length, batch, budget)
        out[name] = dict(full_gib=full, per_sequence_gib=seq, capped_gib=capped)
        print(
            f"  {name:<14} {full:6.1f} GiB for the micro-batch in one launch ({seq:.1f} per sequence); "
            f"{capped:4.1f} GiB under a {budget:g} GiB per-launch budget (row blocks of query rows)"
        )
    return out


def print_measured() -> None:
    """The measured tables (``gpu_cost.measured``): step ratio, kernels at every measured length,
    the RoPE side's rates, the calibration kernel."""
    from gpu_cost import measured

    record = measured.load()
    soft = record["software"]
    print(f"Measured on one {record['device']} ({record['date']}; torch {soft['torch']},")
    print(f"Triton {soft['triton']}),")
    print(f"beside the model's {LABEL} of the same quantities.\n")
    print(measured.step_table(record) + "\n")
    for length in measured.lengths(record):
        print(f"L = {length}, one LLaDA-8B layer, fwd + bwd, batch 1:")
        print(measured.kernel_table(record, length) + "\n")
    print(f"What the targets ask of the pair arithmetic (its FP32 floor, the rest as measured) [{LABEL}]:")
    print(measured.floor_table(record) + "\n")
    print("The RoPE side:")
    print(measured.rope_table(record) + "\n")
    print(f"The calibration kernel on the same H100 (Triton {record['calibration']['software']['triton']}):")
    print(measured.calibration_table(record))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--designs", nargs="+", choices=designs.DESIGNS, default=list(designs.DESIGNS))
    p.add_argument("--baselines", nargs="+", choices=step.BASELINES, default=list(step.BASELINES))
    p.add_argument(
        "--attention", nargs="+", choices=designs.BIAS_ATTENTION, default=list(designs.BIAS_ATTENTION)
    )
    p.add_argument("--compile", action="store_true", help="recompile today's kernels (AOT sm_90) first")
    p.add_argument("--no-calibration", action="store_true", help="skip the calibration (needs triton)")
    p.add_argument("--calibration-space", choices=("central", "tutorial"), default="central")
    p.add_argument("--memory-length", type=int, default=4096)
    p.add_argument("--memory-batch", type=int, default=4)
    p.add_argument("--pair-buffer-gib", type=float, default=6.0, help="per-launch pair-buffer budget")
    p.add_argument(
        "--pair-resources",
        type=designs.parse_resources,
        default=None,
        help="warps,stages,registers,spill_bytes,shared_bytes,barriers of the pair kernels of (a), (b) "
        "(default: the stated assumption 8,2,255,0,163840,2)",
    )
    p.add_argument("--json", default=None, help="also write every figure here")
    p.add_argument(
        "--measured",
        action="store_true",
        help="print the H100 measurements (gpu_cost/measured_h100.json) beside the model, then exit",
    )
    args = p.parse_args(argv)
    if args.measured:
        print_measured()
        return 0
    if args.compile:
        from sweep_launch_gpu import FUSED_CANDIDATES

        print("compiling today's kernels and the H100 sweep's fused settings for sm_90 ...", flush=True)
        recorded.save(recorded.compile_kernels())
        recorded.save(recorded.compile_sweep(FUSED_CANDIDATES), recorded.SWEEP_RECORD)
    rec = recorded.load()
    print(f"Every figure below is an {LABEL} from a model; nothing here ran on a GPU.\n")
    print_assumptions()
    calibration = None if args.no_calibration else print_calibration(args.calibration_space)
    print_resources(rec, args.pair_resources)
    print_kernels(args.lengths, args.designs, args.attention, rec, args.pair_resources)
    rows = design_rows(
        args.lengths, args.designs, args.baselines, args.attention, rec, pair_resources=args.pair_resources
    )
    print_ratios(rows, args.baselines, args.lengths)
    memory = print_memory(args.memory_length, args.memory_batch, args.pair_buffer_gib)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                dict(
                    label=LABEL,
                    assumptions={k: vars(a) for k, a in ASSUMPTIONS.items()},
                    calibration=calibration,
                    designs=rows,
                    memory=memory,
                ),
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
