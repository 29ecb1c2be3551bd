"""Forward+backward cost of the blocked MDLMPE attention relative to plain RoPE SDPA.

Toy layer (docs/method.md "Cost and precision"): B = 1, 8 query heads, d_h = 64, fp32, one thread. For every
configuration the RoPE baseline (``scaled_dot_product_attention`` on rotated q, k) and the MDLMPE
method run in the same process, so the ratio is what to read (absolute times on a shared machine
are noisy). Columns:

- ``rope ms`` / ``mdlmpe ms``: best of ``--repeats`` forward+backward wall times (after warm-up;
  compiled runs warm up until the graphs exist, so compile time is excluded).
- ``saved MB``: bytes kept for backward between forward and backward (distinct storages seen by
  torch.autograd.graph.saved_tensors_hooks: block inputs, outputs and log-sum-exps).
- ``peak+ MB`` (rows of ``--memory-modes``): transient memory of one forward+backward above
  RoPE's. CPU: a fresh subprocess per configuration with every allocation >= 64 KiB mmapped (so
  freed memory leaves RSS), VmHWM reset through /proc/self/clear_refs after the inputs exist and
  one warm-up run, peak RSS growth of the MDLMPE run minus that of the RoPE run. CUDA:
  torch.cuda.max_memory_allocated, same difference.
- ``rows``: query rows per block as run (eager blocked caps C at an L2-sized slice, see
  blocked.eager_block_rows; C is then an upper bound).
- ``B/(C·L)``: peak+ divided by (rows x length): flat when the extra memory is linear in C·L.

Usage:
    python benchmarks/bench_attention.py --quick
    python benchmarks/bench_attention.py --lengths 1024 2048 --block-sizes 64 128 --modes compiled
    python benchmarks/bench_attention.py --device cuda --methods blocked triton   # GPU section

Methods are functions registered in METHODS (``rope`` is the baseline of every row); a GPU kernel
plugs in as one more entry.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from proc_memory import reset_peak, status_kb

from mdlmpe_ds.attention.blocked import blocked_attention, eager_block_rows
from mdlmpe_ds.attention.common import rope_attention
from mdlmpe_ds.pe.heads import active_kv_heads
from mdlmpe_ds.pe.phase import PhaseMLP

TAU_MAX = 0.25
CLIP_KAPPA = 1e-4


@dataclass(frozen=True)
class Case:
    """One row of the table."""

    length: int
    block_size: int
    heads: int = 8
    kv_heads: int = 8
    active: int = 8  # number of KV heads with MDLMPE (activation order of pe.heads)
    head_dim: int = 64
    mode: str = "eager"  # eager | compiled
    method: str = "blocked"
    device: str = "cpu"


def make_inputs(case: Case, seed: int = 0) -> dict:
    """Rotated q, k, v (leaves), A <= D availability summaries, a phase MLP with a non-zero output."""
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(case.device)
    num_pairs = case.head_dim // 2

    def leaf(heads: int) -> torch.Tensor:
        x = torch.randn(1, heads, case.length, case.head_dim, generator=gen)
        return x.to(device).requires_grad_()

    A = torch.rand(1, case.length, num_pairs, generator=gen)
    D = A + torch.rand(1, case.length, num_pairs, generator=gen) + 1e-3
    torch.manual_seed(seed)
    mlp = PhaseMLP(num_pairs, max(16, num_pairs // 2)).to(device)
    with torch.no_grad():
        mlp.fc2.weight.normal_(0.0, 0.5)
    return {
        "q": leaf(case.heads),
        "k": leaf(case.kv_heads),
        "v": leaf(case.kv_heads),
        "A": A.to(device),
        "D": D.to(device),
        "mlp": mlp,
        "active": active_kv_heads(case.active, case.kv_heads),
    }


def method_rope(inp: dict, case: Case) -> torch.Tensor:
    """Baseline: the backbone's own attention, SDPA on rotated q, k."""
    return rope_attention(inp["q"], inp["k"], inp["v"])


def method_blocked(inp: dict, case: Case) -> torch.Tensor:
    """Blocked MDLMPE attention (pure PyTorch; eager or with the two regions compiled)."""
    return blocked_attention(
        inp["q"],
        inp["k"],
        inp["v"],
        inp["A"],
        inp["D"],
        inp["mlp"].params(),
        tau_max=TAU_MAX,
        clip_kappa=CLIP_KAPPA,
        active_kv=inp["active"],
        block_size=case.block_size,
        compile=case.mode == "compiled",
    )


def method_triton(inp: dict, case: Case) -> torch.Tensor:
    """GPU hook: the fused Triton kernel (another module; needs CUDA or TRITON_INTERPRET=1)."""
    from mdlmpe_ds.attention.triton.backend import check_triton_available, triton_attention

    check_triton_available()
    return triton_attention(
        inp["q"],
        inp["k"],
        inp["v"],
        inp["A"],
        inp["D"],
        inp["mlp"].params(),
        tau_max=TAU_MAX,
        clip_kappa=CLIP_KAPPA,
        active_kv=inp["active"],
        # The kernel's own tile for this GPU, head size and dtype (triton.launch.launch_config):
        # case.block_size is the blocked path's query block (128), above any GPU tile.
    )


METHODS: dict[str, Callable[[dict, Case], torch.Tensor]] = {
    "rope": method_rope,
    "blocked": method_blocked,
    "triton": method_triton,
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fwd_bwd(method: str, inp: dict, case: Case) -> None:
    out = METHODS[method](inp, case)
    out.backward(torch.ones_like(out))


def time_fwd_bwd(method: str, inp: dict, case: Case, repeats: int, warmup: int) -> float:
    """Best forward+backward wall time in seconds."""
    for _ in range(warmup):
        fwd_bwd(method, inp, case)
    _sync(case.device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fwd_bwd(method, inp, case)
        _sync(case.device)
        best = min(best, time.perf_counter() - start)
    return best


def saved_bytes(method: str, inp: dict, case: Case) -> int:
    """Bytes of distinct storages autograd keeps for backward (inputs included), forward only."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        METHODS[method](inp, case)
    return sum(storages.values())


def child_peak_bytes(case: Case) -> int:
    """In a fresh process: peak RSS growth of one forward+backward of ``case.method`` (CPU)."""
    torch.set_num_threads(1)
    inp = make_inputs(case)
    # Warm up first: lazy imports, autograd worker state and compiled graphs are not attention memory.
    fwd_bwd(case.method, inp, case)
    for leaf in (inp["q"], inp["k"], inp["v"], *inp["mlp"].parameters()):
        leaf.grad = None
    reset_peak()
    before = status_kb("VmRSS")
    fwd_bwd(case.method, inp, case)
    return (status_kb("VmHWM") - before) * 1024


def peak_bytes(case: Case) -> int:
    """Transient peak of one forward+backward (see module docstring for what it measures)."""
    if case.device.startswith("cuda"):
        inp = make_inputs(case)
        fwd_bwd(case.method, inp, case)
        torch.cuda.synchronize()
        for leaf in (inp["q"], inp["k"], inp["v"], *inp["mlp"].parameters()):
            leaf.grad = None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd(case.method, inp, case)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child-peak", json.dumps(asdict(case))]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=1800)
    if result.returncode:
        raise RuntimeError(f"memory child for {case} failed:\n{result.stderr[-2000:]}")
    return int(result.stdout.strip().splitlines()[-1])


def build_cases(args: argparse.Namespace) -> list[Case]:
    """Full MHA sweep over lengths x block sizes x modes, then GQA and partial-mask rows."""
    cases = []
    for mode in args.modes:
        for length in args.lengths:
            for block in args.block_sizes:
                cases.append(Case(length, block, mode=mode, device=args.device))
        if args.no_variants:
            continue
        variant_length = args.variant_length
        block = args.block_sizes[0]
        cases.append(Case(variant_length, block, kv_heads=2, active=2, mode=mode, device=args.device))
        cases.append(Case(variant_length, block, kv_heads=8, active=2, mode=mode, device=args.device))
    return cases


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="L in {256, 512, 1024}, C = 128, fewer repeats")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    parser.add_argument("--variant-length", type=int, default=512, help="L of the GQA / partial-mask rows")
    parser.add_argument("--no-variants", action="store_true", help="skip the GQA / partial-mask rows")
    methods = [m for m in METHODS if m != "rope"]
    parser.add_argument("--methods", nargs="+", choices=methods, default=["blocked"])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU section")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--memory-modes",
        nargs="*",
        choices=["eager", "compiled"],
        default=["eager"],
        help="modes whose rows also measure peak memory (one subprocess per row; on CPU a "
        "compiled row compiles again there)",
    )
    parser.add_argument("--child-peak", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.block_sizes, args.repeats = [256, 512, 1024], [128], 2
    return args


def block_rows(case: Case, inp: dict) -> int:
    """Query rows per block as run: eager blocked caps C at an L2-sized slice (blocked.eager_block_rows)."""
    rows = min(case.block_size, case.length)
    if case.method == "blocked" and case.mode == "eager":
        pair_heads = case.active * (case.heads // case.kv_heads)  # query heads on the pair path
        hidden = inp["mlp"].params().w1.shape[0]
        rows = eager_block_rows(rows, 1, case.length, case.head_dim // 2, hidden, pair_heads)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child_peak:
        print(child_peak_bytes(Case(**json.loads(args.child_peak))))
        return
    torch.set_num_threads(args.threads)
    header = (
        f"{'method':>8} {'mode':>8} {'L':>5} {'C':>4} {'rows':>4} {'Hkv':>3} {'act':>3} "
        f"{'rope ms':>8} {'mdlmpe ms':>10} {'ratio':>6} {'saved MB':>8} {'peak+ MB':>8} {'B/(C·L)':>8}"
    )
    print(
        f"# torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
        f"B=1, Hq=8, d_h=64, fp32, fwd+bwd"
    )
    print(header)
    started = time.perf_counter()
    for method in args.methods:
        for case in build_cases(args):
            case = Case(**{**asdict(case), "method": method})
            if case.mode == "compiled":
                torch._dynamo.reset()  # every row compiles its own graphs (no recompile-limit fallback)
            inp = make_inputs(case)
            base = Case(**{**asdict(case), "method": "rope", "mode": "eager"})
            # The baseline is cheap: many repeats before and after the method, best of all, so a
            # quiet moment of the (shared) machine is found for both.
            rope_repeats = max(10, args.repeats)
            t_rope = time_fwd_bwd("rope", inp, base, rope_repeats, warmup=1)
            warmup = 2 if case.mode == "compiled" else 1
            t_method = time_fwd_bwd(method, inp, case, args.repeats, warmup=warmup)
            t_rope = min(t_rope, time_fwd_bwd("rope", inp, base, rope_repeats, warmup=0))
            saved = saved_bytes(method, inp, case) / 2**20
            rows = block_rows(case, inp)
            peak = per_cl = float("nan")
            if case.mode in args.memory_modes:
                extra = peak_bytes(case) - peak_bytes(base)
                peak, per_cl = extra / 2**20, extra / (rows * case.length)
            print(
                f"{method:>8} {case.mode:>8} {case.length:>5} {case.block_size:>4} {rows:>4} "
                f"{case.kv_heads:>3} "
                f"{case.active:>3} {t_rope * 1e3:>8.1f} "
                f"{t_method * 1e3:>10.1f} {t_method / t_rope:>6.1f} {saved:>8.1f} {peak:>8.1f} "
                f"{per_cl:>8.0f}",
                flush=True,
            )
    print(f"# total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
