"""Resources and main-loop SASS counts of the kernels that exist, from ahead-of-time sm_90 compiles.

``compile_kernels`` compiles the fused MDLMPE kernels (``mdlmpe_ds.attention.triton.aot``) at the
launcher's bf16 sm_90 settings ("default") and at the no-rewrite candidate's 2 heads per program,
8 warps and 2 stages ("w8s2"), and reads registers, spill stack, shared memory and the main
loop's instruction counts and barriers. ``sm90_kernels.json`` beside this file holds the last
such compile, so that the estimate runs in a second without a compiler;
``python benchmarks/estimate_gpu.py --compile`` refreshes it (a minute with a warm Triton
cache). Any kernel that compiles can be fed the same way: ``from_compile`` turns a compiled kernel
into the model's ``Resources`` and per-iteration counts.
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
#: "default": the launcher's settings; "w8s2": the no-rewrite design's 2 heads per program, 8 warps
#: and 2 stages.
VARIANTS = {"default": {}, "w8s2": {"heads_per_program": 2, "num_warps": 8, "num_stages": 2}}


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


def compile_config(change: dict, kernels) -> dict[str, dict]:
    """{kernel: {"resources": ..., "counts": ...}} of ``kernels`` compiled for sm_90 (bf16, d_h 128)
    at the launcher's settings with ``change`` (``LaunchConfig`` fields) applied."""
    from mdlmpe_ds.attention.triton.aot import compile_cubin
    from mdlmpe_ds.attention.triton.launch import PHASE_KERNELS, kernel_options, launch_config

    config = dataclasses.replace(launch_config(128, torch.bfloat16, 90), **change)
    out = {}
    for kernel in kernels:
        options = kernel_options(kernel, config)
        compiled = compile_cubin(kernel, 128, torch.bfloat16, 90, config)
        trips = 1 if kernel in PHASE_KERNELS else PAIR_TRIPS
        res, counts = from_compile(compiled, options["num_warps"], options["num_stages"], trips)
        out[kernel] = {"resources": dataclasses.asdict(res), "counts": dataclasses.asdict(counts)}
    return out


def compile_kernels() -> dict[str, dict[str, dict]]:
    """{variant: {kernel: {"resources": ..., "counts": ...}}} from fresh sm_90 compiles."""
    from mdlmpe_ds.attention.triton.launch import KERNELS, PHASE_KERNELS

    # the phase kernels have their own settings: compiled once, with the default variant
    return {
        variant: compile_config(change, [k for k in KERNELS if not (change and k in PHASE_KERNELS)])
        for variant, change in VARIANTS.items()
    }


#: The fused attention kernels compiled at every ``triton`` setting of the H100 sweep
#: (``measured.SWEEP``), so the model can be held against the sweep setting by setting.
SWEEP_RECORD = Path(__file__).with_name("sm90_sweep_kernels.json")
#: Sweep candidate keywords (``triton_attention``'s) -> ``LaunchConfig`` fields.
_CANDIDATE_FIELDS = {"block_size": "tile"}


def compile_sweep(candidates: dict[str, dict[str, int]]) -> dict[str, dict[str, dict]]:
    """{candidate: {"forward" / "backward": {"resources": ..., "counts": ...}}} for the ``triton``
    sweep candidates (``sweep_launch_gpu.FUSED_CANDIDATES``)."""
    return {
        name: compile_config(
            {_CANDIDATE_FIELDS.get(k, k): v for k, v in settings.items()}, ("forward", "backward")
        )
        for name, settings in candidates.items()
    }


def save(record: dict, path: Path = RECORD) -> None:
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def load(path: Path = RECORD) -> dict[str, dict[str, tuple[Resources, LoopCounts]]]:
    """A recorded compile: {variant (or sweep candidate): {kernel: (Resources, LoopCounts)}}."""
    raw = json.loads(path.read_text())
    return {
        variant: {k: (Resources(**v["resources"]), LoopCounts(**v["counts"])) for k, v in kernels.items()}
        for variant, kernels in raw.items()
    }
