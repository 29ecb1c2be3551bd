"""Resources and main-loop SASS counts of the kernels that exist, from ahead-of-time sm_90 compiles.

``compile_kernels`` compiles the fused MDLMPE kernels (``mdlmpe_ds.attention.triton.aot``) at the
launcher's bf16 sm_90 settings ("default") and at the no-rewrite candidate's 8 warps / 2 stages
("w8s2"), and reads registers, spill stack, shared memory and the main loop's instruction counts
and barriers. ``sm90_kernels.json`` beside this file holds the last such compile, so that the
estimate runs in a second without a compiler; ``python benchmarks/estimate_gpu.py --compile``
refreshes it (a minute with a warm Triton cache). Any kernel that compiles can be fed the same way:
``from_compile`` turns a compiled kernel into the model's ``Resources`` and per-iteration counts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from gpu_cost.kernel_model import Resources
from gpu_cost.sass import LoopCounts, loop_counts

RECORD = Path(__file__).with_name("sm90_kernels.json")
#: Trip count of the per-pair loops nested in the head kernels' main loop (|M| at d_h 128).
PAIR_TRIPS = 32
VARIANTS = {"default": {}, "w8s2": {"num_warps": 8, "num_stages": 2}}


def from_compile(compiled, warps: int, stages: int, trips: int = 1) -> tuple[Resources, LoopCounts]:
    """The model's inputs from one Triton compile (``.asm["cubin"]``, ``.metadata.shared``)."""
    from mdlmpe_ds.attention.triton.aot import resource_usage, sass

    cubin = compiled.asm["cubin"]
    usage = resource_usage(cubin)
    counts = loop_counts(sass(cubin), trips)
    res = Resources(
        warps=warps,
        stages=stages,
        registers=usage["REG"],
        spill_bytes=usage["STACK"],
        shared_bytes=int(compiled.metadata.shared),
        barriers=counts.barriers,
        source="AOT sm_90",
    )
    return res, counts


def compile_kernels() -> dict[str, dict[str, dict]]:
    """{variant: {kernel: {"resources": ..., "counts": ...}}} from fresh sm_90 compiles."""
    from mdlmpe_ds.attention.triton.aot import compile_cubin
    from mdlmpe_ds.attention.triton.launch import KERNELS, PHASE_KERNELS, kernel_options, launch_config

    out: dict[str, dict[str, dict]] = {}
    for variant, change in VARIANTS.items():
        config = dataclasses.replace(launch_config(128, torch.bfloat16, 90), **change)
        out[variant] = {}
        for kernel in KERNELS:
            if change and kernel in PHASE_KERNELS:
                continue  # the phase kernels have their own settings
            options = kernel_options(kernel, config)
            compiled = compile_cubin(kernel, 128, torch.bfloat16, 90, config)
            trips = 1 if kernel in PHASE_KERNELS else PAIR_TRIPS
            res, counts = from_compile(compiled, options["num_warps"], options["num_stages"], trips)
            out[variant][kernel] = {
                "resources": dataclasses.asdict(res),
                "counts": dataclasses.asdict(counts),
            }
    return out


def save(record: dict) -> None:
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def load() -> dict[str, dict[str, tuple[Resources, LoopCounts]]]:
    """The recorded compile: {variant: {kernel: (Resources, LoopCounts)}}."""
    raw = json.loads(RECORD.read_text())
    return {
        variant: {k: (Resources(**v["resources"]), LoopCounts(**v["counts"])) for k, v in kernels.items()}
        for variant, kernels in raw.items()
    }
