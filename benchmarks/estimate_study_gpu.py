"""ESTIMATE of the GPU time of the paper-scale mechanism study, every assumption printed.

    python benchmarks/estimate_study_gpu.py            # the table docs/results.md quotes
    python benchmarks/estimate_study_gpu.py --json f   # also every figure as JSON

What it scales and why: benchmarks/gpu_cost/study_run.py. The runbook command it prices:
``python launch/mechanism_study.py --paper --launcher "deepspeed --num_gpus 8"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_cost import study_run


def report(estimate: dict) -> str:
    shape = study_run.LLADA_100M
    lines = [
        f"Paper-scale mechanism study, ESTIMATE (H100 SXM; scaled from one LLaDA-8B layer measured at "
        f"L {study_run.MEASURED_LENGTH}; no GPU has run this shape)",
        f"  llada-100m: {shape.parameters / 1e6:.0f}M parameters ({shape.layers} layers of "
        f"{shape.layer_weights / 1e6:.2f}M, embedding {shape.vocab * shape.hidden / 1e6:.1f}M), "
        f"|M| {shape.mdlmpe_pairs} of {shape.head_dim // 2} rotary pairs",
        f"  {study_run.SEEDS} seeds x (RoPE, MDLMPE), {study_run.STEPS} updates of "
        f"{study_run.GLOBAL_BATCH} x {study_run.MEASURED_LENGTH} tokens on {study_run.GPUS} GPUs, then "
        f"{study_run.SCORED_FORWARDS} scored forwards per model and mode",
        "",
        "  per-sequence pieces scaled to the 100M shape (ms, before the small-shape factor):",
    ]
    lines += [f"    {name:22s} {value:8.3f}" for name, value in estimate["pieces_ms"].items()]
    lines += ["", "  assumptions (low, central, high):"]
    for name, (values, why) in study_run.ASSUMPTIONS.items():
        lines.append(f"    {name:22s} {values}  {why}")
    lines += ["", "  | | low | central | high |", "  |---|---|---|---|"]
    sc = estimate["scenarios"]

    def row(label, get, fmt):
        return (
            f"  | {label} | " + " | ".join(fmt.format(get(sc[s])) for s in ("low", "central", "high")) + " |"
        )

    lines += [
        row("RoPE step (ms)", lambda c: c["rope"]["step_ms"], "{:.1f}"),
        row("MDLMPE step (ms)", lambda c: c["mdlmpe"]["step_ms"], "{:.1f}"),
        row("step ratio MDLMPE / RoPE", lambda c: c["step_ratio"], "{:.1f}"),
        row("ZeRO-3 traffic not hidden (ms/step)", lambda c: c["exposed_comm_ms"], "{:.1f}"),
        row("RoPE run, hours on 8 GPUs", lambda c: c["rope"]["run_hours"], "{:.1f}"),
        row("MDLMPE run, hours on 8 GPUs", lambda c: c["mdlmpe"]["run_hours"], "{:.1f}"),
        row("whole study, H100 GPU-hours", lambda c: c["study_gpu_hours"], "{:.0f}"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="also write every figure here")
    args = parser.parse_args(argv)
    estimate = study_run.study_estimate()
    print(report(estimate))
    if args.json:
        Path(args.json).write_text(json.dumps(estimate, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
