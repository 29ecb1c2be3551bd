"""One LLaDA-8B layer's MDLMPE attention fwd + bwd per Triton backend inside a profiler window,
for Nsight Compute: the hardware counters the cost model's terms stand for (L2 bytes, L1 hit
rate, achieved occupancy, stall reasons) on every kernel of the layer.

Each backend runs once outside the window (compiling its kernels), then once between
cudaProfilerStart / Stop, so ``--profile-from-start off`` sees exactly one fwd + bwd:

    ncu --profile-from-start off --clock-control none -k 'regex:pair_bias|mdlmpe_|phase_' \
        --section SpeedOfLight --section MemoryWorkloadAnalysis_Chart --section Occupancy \
        --section WarpStateStats --section InstructionStats --section SchedulerStats \
        --section LaunchStats --section ComputeWorkloadAnalysis --csv --page raw \
        python benchmarks/profile_kernels_gpu.py --length 2048 > ncu.csv

(the command behind ``benchmarks/gpu_cost/counters_h100.json``; one fwd + bwd of both backends
took 25 s under it on an H100).

Settings: the launchers' defaults unless ``--pair`` / ``--fused`` name a candidate of
``sweep_launch_gpu``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    from sweep_launch_gpu import DEFAULT_CANDIDATE, FUSED_CANDIDATES, PAIR_CANDIDATES, layer_step

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument(
        "--backends", nargs="+", choices=("triton-pair", "triton"), default=["triton-pair", "triton"]
    )
    p.add_argument("--pair", default=DEFAULT_CANDIDATE["triton-pair"], choices=tuple(PAIR_CANDIDATES))
    p.add_argument("--fused", default=DEFAULT_CANDIDATE["triton"], choices=tuple(FUSED_CANDIDATES))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_kernels_gpu: needs a CUDA device (none visible)", file=sys.stderr)
        return 2
    settings = {"triton-pair": PAIR_CANDIDATES[args.pair], "triton": FUSED_CANDIDATES[args.fused]}
    for backend in args.backends:
        step = layer_step(backend, settings[backend], args.length)
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled {backend} at L = {args.length}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
