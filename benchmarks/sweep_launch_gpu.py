"""Launch-settings sweep of the Triton MDLMPE kernels on a GPU: each kernel's time at every
candidate setting, measured, so the launchers' defaults are chosen from measurements instead of
from the cost model alone.

For each candidate it runs one LLaDA-8B layer's MDLMPE attention (batch 1, 32 query = KV heads,
d_h 128, bf16, all heads with MDLMPE; ``bench_attention_gpu.layer_inputs``) fwd + bwd and times every
kernel with the torch profiler (``bench_attention_gpu.kernel_times``): the pair kernels of
``triton-pair`` under ``triton.launch.PairLaunchConfig`` candidates, the fused kernels of
``triton`` under ``LaunchConfig`` overrides. A candidate that does not compile or launch (shared
memory, registers) is reported with its error, not fatal. Each kernel's fastest candidate is
printed beside the launcher's default.

Compiling is most of a sweep's wall time. ``--compile-workers N`` first runs every candidate once
in N processes (sharing Triton's on-disk cache), so the timing pass, one candidate after another
on an otherwise idle GPU, only loads compiled kernels.

    python benchmarks/sweep_launch_gpu.py --length 2048 --json sweep.json --compile-workers 12
    python benchmarks/sweep_launch_gpu.py --backends triton-pair --candidates 8x16w8 16x16w8
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: ``triton-pair`` candidates: name -> ``PairLaunchConfig.uniform`` keywords (one tile, warps and
#: register cap for all three kernels), or ``PairLaunchConfig`` fields over the launcher's per-kernel
#: settings ({}: those settings; ``pair_config``).
PAIR_CANDIDATES: dict[str, dict[str, object]] = {
    "per_kernel": {},  # pair_launch_config: 16 x 8 / 8 warps, key side 32 x 8 / 8 warps / 128 registers
    # the same with the forward's and the query side's pair arithmetic in fp16 (fewer instructions
    # per head in their sm_90 code; its time is what this measures)
    "per_kernel_half": {"half_pairs": ("pair_forward", "pair_backward_q")},
    "8x16w8": dict(tile_m=8, tile_n=16, num_warps=8, key_max_registers=128),  # the default until 2026-11-28
    "8x16w8_kreg255": dict(tile_m=8, tile_n=16, num_warps=8),
    "8x16w4": dict(tile_m=8, tile_n=16, num_warps=4, key_max_registers=128),
    "8x16w4_kreg255": dict(tile_m=8, tile_n=16, num_warps=4),
    "8x8w4": dict(tile_m=8, tile_n=8, num_warps=4, key_max_registers=128),
    "8x8w8": dict(tile_m=8, tile_n=8, num_warps=8, key_max_registers=128),
    "8x8w8_kreg255": dict(tile_m=8, tile_n=8, num_warps=8),
    "16x4w4": dict(tile_m=16, tile_n=4, num_warps=4, key_max_registers=128),
    "16x8w4": dict(tile_m=16, tile_n=8, num_warps=4, key_max_registers=128),
    "16x8w8": dict(tile_m=16, tile_n=8, num_warps=8, key_max_registers=128),
    "16x8w8_kreg255": dict(tile_m=16, tile_n=8, num_warps=8),
    "16x16w4": dict(tile_m=16, tile_n=16, num_warps=4, key_max_registers=128),
    "16x16w8": dict(tile_m=16, tile_n=16, num_warps=8, key_max_registers=128),
    "32x8w8": dict(tile_m=32, tile_n=8, num_warps=8, key_max_registers=128),
    "8x32w8": dict(tile_m=8, tile_n=32, num_warps=8, key_max_registers=128),
    # 16 warps need <= 128 registers per thread (64 K registers per SM); the query side then spills
    "8x16w16r128": dict(tile_m=8, tile_n=16, num_warps=16, max_registers=128),
    "16x8w16r128": dict(tile_m=16, tile_n=8, num_warps=16, max_registers=128),
    "16x16w16r128": dict(tile_m=16, tile_n=16, num_warps=16, max_registers=128),
}

#: ``triton`` (fused) candidates: name -> triton_attention launch keywords.
FUSED_CANDIDATES: dict[str, dict[str, int]] = {
    "t64g1w8": dict(block_size=64, heads_per_program=1, num_warps=8, num_stages=1),  # the sm_90 default
    "t64g2w4": dict(
        block_size=64, heads_per_program=2, num_warps=4, num_stages=1
    ),  # default until 2026-11-28
    "t64g2w8": dict(block_size=64, heads_per_program=2, num_warps=8, num_stages=1),
    "t64g1w4": dict(block_size=64, heads_per_program=1, num_warps=4, num_stages=1),
    "t64g1w8s2": dict(block_size=64, heads_per_program=1, num_warps=8, num_stages=2),
    "t64g1w8r168": dict(block_size=64, heads_per_program=1, num_warps=8, num_stages=1, max_registers=168),
    "t64g1w8r128": dict(block_size=64, heads_per_program=1, num_warps=8, num_stages=1, max_registers=128),
    "t64g1w16r128": dict(block_size=64, heads_per_program=1, num_warps=16, num_stages=1, max_registers=128),
    "t64g2w4s2": dict(block_size=64, heads_per_program=2, num_warps=4, num_stages=2),
    "t32g1w4": dict(block_size=32, heads_per_program=1, num_warps=4, num_stages=1),
    "t32g1w8": dict(block_size=32, heads_per_program=1, num_warps=8, num_stages=1),
    "t32g2w4": dict(block_size=32, heads_per_program=2, num_warps=4, num_stages=1),
    "t32g2w8": dict(block_size=32, heads_per_program=2, num_warps=8, num_stages=1),
    "t32g4w4": dict(block_size=32, heads_per_program=4, num_warps=4, num_stages=1),
    "t32g4w8": dict(block_size=32, heads_per_program=4, num_warps=8, num_stages=1),
}

BACKEND_CANDIDATES = {"triton-pair": PAIR_CANDIDATES, "triton": FUSED_CANDIDATES}
DEFAULT_CANDIDATE = {"triton-pair": "per_kernel", "triton": "t64g1w8"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument(
        "--backends", nargs="+", choices=tuple(BACKEND_CANDIDATES), default=list(BACKEND_CANDIDATES)
    )
    p.add_argument("--candidates", nargs="+", default=None, help="names to run (default: all)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument(
        "--compile-workers", type=int, default=0, help="compile every candidate first in N processes"
    )
    p.add_argument("--json", type=str, default=None)
    return p.parse_args(argv)


def pair_config(settings: dict[str, object]):
    """The ``PairLaunchConfig`` of a ``PAIR_CANDIDATES`` entry."""
    from mdlmpe_ds.attention.triton.launch import PairLaunchConfig

    return PairLaunchConfig.uniform(**settings) if "tile_m" in settings else PairLaunchConfig(**settings)


def layer_step(
    backend: str, settings: dict[str, int], length: int, device: str = "cuda", heads: int = 32
) -> Callable[[], None]:
    """fwd + bwd of one LLaDA-8B layer's MDLMPE attention under ``settings`` (leaf grads reset);
    ``device`` / ``heads`` other than a GPU's 32 are for checking this script in the interpreter."""
    from bench_attention_gpu import layer_inputs

    from mdlmpe_ds.attention.triton.backend import triton_attention
    from mdlmpe_ds.attention.triton.pair_backend import pair_bias_attention

    q, k, v, A, D, mlp, grad = layer_inputs(1, heads, heads, 128, length, torch.bfloat16, device)
    leaves = (q, k, v, *mlp.parameters())
    common = dict(tau_max=0.25, clip_kappa=1e-4)
    if backend == "triton-pair":
        config = pair_config(settings)

        def attention() -> torch.Tensor:
            return pair_bias_attention(q, k, v, A, D, mlp.params(), **common, launch=config)
    else:

        def attention() -> torch.Tensor:
            return triton_attention(q, k, v, A, D, mlp.params(), **common, **settings)

    last: dict[str, torch.Tensor] = {}

    def step() -> None:
        for t in leaves:
            t.grad = None
        out = attention()
        out.backward(grad)
        last["out"] = out

    def snapshot() -> dict[str, torch.Tensor]:
        """The last step's output and gradients (fp32 copies), to compare candidates."""
        named = {"out": last["out"], "dq": q.grad, "dk": k.grad, "dv": v.grad}
        named.update({f"d{n}": p.grad for n, p in mlp.named_parameters()})
        return {n: t.detach().float().clone() for n, t in named.items()}

    step.snapshot = snapshot  # type: ignore[attr-defined]
    return step


def jobs(args: argparse.Namespace) -> list[tuple[str, str, dict[str, int]]]:
    out = []
    for backend in args.backends:
        for name, settings in BACKEND_CANDIDATES[backend].items():
            if args.candidates is None or name in args.candidates:
                out.append((backend, name, settings))
    return out


def _compile_one(job: tuple[str, str, dict[str, int], int]) -> tuple[str, str, float, str | None]:
    backend, name, settings, length = job
    start = time.perf_counter()
    try:
        layer_step(backend, settings, length)()
        torch.cuda.synchronize()
        return backend, name, time.perf_counter() - start, None
    except Exception as exc:  # reported, the sweep goes on
        return backend, name, time.perf_counter() - start, f"{type(exc).__name__}: {str(exc)[:200]}"


def precompile(args: argparse.Namespace) -> dict[tuple[str, str], str]:
    """Run every candidate once in ``--compile-workers`` processes; the failures by candidate."""
    work = [(b, n, s, args.length) for b, n, s in jobs(args)]
    failed = {}
    with mp.get_context("spawn").Pool(args.compile_workers) as pool:
        for backend, name, seconds, error in pool.imap_unordered(_compile_one, work):
            print(f"  compiled {backend:<12} {name:<16} {seconds:6.1f} s {error or ''}", flush=True)
            if error:
                failed[(backend, name)] = error
    return failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_launch_gpu: needs a CUDA device (none visible); nothing measured", file=sys.stderr)
        return 2
    from bench_attention_gpu import kernel_times

    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "length": args.length, "runs": {}}
    failed = precompile(args) if args.compile_workers > 0 else {}
    references: dict[str, dict[str, torch.Tensor]] = {}  # each backend's first candidate's numbers
    for backend, name, settings in jobs(args):
        key = f"{backend}/{name}"
        if (backend, name) in failed:
            results["runs"][key] = {"settings": settings, "error": failed[(backend, name)]}
            continue
        try:
            step = layer_step(backend, settings, args.length)
            step()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                step()
            end.record()
            torch.cuda.synchronize()
            kernels = kernel_times(step, args.iters)
            row = {
                "settings": settings,
                "layer_ms": start.elapsed_time(end) / args.iters,
                "kernels_ms": kernels,
            }
            numbers = step.snapshot()
            row["max_rel_err"] = agreement(numbers, references.get(backend, {}))
            references.setdefault(backend, numbers)
        except Exception as exc:
            row = {"settings": settings, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            traceback.print_exc(limit=1)
        results["runs"][key] = row
        if args.json:  # after every candidate: a sweep cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=2))
        shown = " ".join(f"{k}={v:.2f}" for k, v in row.get("kernels_ms", {}).items())
        if row.get("max_rel_err"):
            shown += f"  max rel err vs the backend's first {max(row['max_rel_err'].values()):.1e}"
        print(
            f"{key:<28} layer {row.get('layer_ms', float('nan')):8.2f} ms  {shown or row.get('error')}",
            flush=True,
        )
        torch.cuda.empty_cache()
    print_best(results, args.backends)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def agreement(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max |got - reference| / max |reference| per tensor (empty for a backend's first candidate):
    a backend's candidates compute the same function with the same bf16 roundings, only in another
    fp32 summation order, so a launch setting that breaks a kernel shows here."""
    return {
        n: float((got[n] - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        for n, ref in reference.items()
    }


def print_best(results: dict[str, object], backends: list[str]) -> None:
    """Each kernel's fastest candidate beside the launcher's default."""
    for backend in backends:
        rows = {k.split("/", 1)[1]: r for k, r in results["runs"].items() if k.startswith(backend + "/")}
        ok = {n: r for n, r in rows.items() if "kernels_ms" in r}
        if not ok:
            continue
        default_row = ok.get(DEFAULT_CANDIDATE[backend], {})
        default = default_row.get("kernels_ms", {})
        print(f"\n{backend}, L = {results['length']}: fastest candidate per kernel (ms) vs the default")
        for kernel in sorted({k for r in ok.values() for k in r["kernels_ms"]}):
            name, row = min(ok.items(), key=lambda item: item[1]["kernels_ms"].get(kernel, float("inf")))
            base = default.get(kernel, float("nan"))
            print(f"  {kernel:<24} default {base:8.2f}   best {row['kernels_ms'][kernel]:8.2f} ({name})")
        name, row = min(ok.items(), key=lambda item: item[1]["layer_ms"])
        print(
            f"  {'layer fwd+bwd':<24} default {default_row.get('layer_ms', float('nan')):8.2f}"
            f"   best {row['layer_ms']:8.2f} ({name})"
        )


if __name__ == "__main__":
    sys.exit(main())
