"""GPU benchmark of one MDLMPE attention layer (issue 8): fused Triton kernel vs the blocked PyTorch
path vs RoPE through flash ``scaled_dot_product_attention``, fwd + bwd, all in one run.

Defaults are one LLaDA-8B layer (32 query = KV heads, d_h 128, bf16, all heads with MDLMPE) at
L = 2048 and 4096. Prints time and peak extra memory per method, as ratios to flash RoPE, and an
estimate of the whole LLaDA-8B training step ratio built from measured pieces:

    step(attn) = n_layers * (t_linear + t_attn) + t_head

with t_linear the layer's projections + SwiGLU MLP (fwd + bwd, bf16 matmuls at the same L) and
t_head the LM head. Norms, element-wise ops, embedding and optimizer are left out, so the printed
ratio is an upper bound on the true step ratio (they add the same time to both sides).

Run on a CUDA machine (exits with a message otherwise):
    python benchmarks/bench_attention_gpu.py
    python benchmarks/bench_attention_gpu.py --lengths 2048 --tile 16 --heads-per-program 8 --skip-blocked
    python benchmarks/bench_attention_gpu.py --json bench_gpu.json
Without a GPU, ``--compile-only`` compiles the three kernels ahead of time for sm_90 (H100) at the
chosen tile / heads-per-program / warps and prints registers and spill stack per thread
(cuobjdump), e.g. ``--compile-only --tile 16 --heads-per-program 4 --num-warps 8``.
Targets (issue 8): Triton fwd+bwd <= 20x flash RoPE at L = 2048 (ideal ~13x), whole-step <= 2.3x,
extra memory independent of L^2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mdlmpe_ds.attention.common import rope_attention
from mdlmpe_ds.pe.phase import PhaseMLP

# LLaDA-8B (../shared/MODELS.md §1.1).
LLADA = dict(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=12288, vocab=126464)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=LLADA["heads"])
    p.add_argument("--kv-heads", type=int, default=LLADA["kv_heads"])
    p.add_argument("--head-dim", type=int, default=LLADA["head_dim"])
    p.add_argument("--active-fraction", type=float, default=1.0, help="share of KV heads with MDLMPE")
    p.add_argument("--tile", type=int, default=32, help="Triton row/key tile (mdlmpe.block_size)")
    p.add_argument("--heads-per-program", type=int, default=2, help="Triton heads sharing alpha/beta")
    p.add_argument("--pair-chunk", type=int, default=16, help="Triton MDLMPE pairs per alpha/beta chunk")
    p.add_argument("--num-warps", type=int, default=None, help="Triton warps (default: the backend's)")
    p.add_argument("--compile-only", action="store_true", help="AOT-compile for sm_90, no GPU needed")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability for --compile-only")
    p.add_argument("--blocked-block", type=int, default=128, help="blocked path query block C")
    p.add_argument("--compile-blocked", action="store_true", help="torch.compile the blocked regions")
    p.add_argument("--skip-blocked", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", type=str, default=None, help="also write the results here")
    return p.parse_args(argv)


def time_fwd_bwd(step: Callable[[], None], warmup: int, iters: int) -> tuple[float, int]:
    """Mean ms of ``step`` (one fwd + bwd) over ``iters`` after ``warmup``; peak extra bytes of one."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, peak


def attention_methods(args: argparse.Namespace, length: int) -> dict[str, Callable[[], None]]:
    """One closure per method doing fwd + bwd on the same bf16 inputs (leaf grads reset each call)."""
    from mdlmpe_ds.attention.triton_backend import triton_attention

    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    num_pairs = args.head_dim // 2

    def leaf(heads: int) -> torch.Tensor:
        x = torch.randn(args.batch, heads, length, args.head_dim, device=dev, generator=gen)
        return x.to(bf16).requires_grad_()

    q, k, v = leaf(args.heads), leaf(args.kv_heads), leaf(args.kv_heads)
    D = torch.rand(args.batch, length, num_pairs, device=dev, generator=gen) + 0.5
    A = torch.rand(args.batch, length, num_pairs, device=dev, generator=gen) * D
    mlp = PhaseMLP(num_pairs, max(16, num_pairs // 2), device=dev)
    with torch.no_grad():  # a trained-looking (non-zero) phase MLP
        mlp.fc2.weight.normal_(0.0, 0.1, generator=gen)
    active = max(1, round(args.active_fraction * args.kv_heads))
    active_kv = torch.zeros(args.kv_heads, dtype=torch.bool, device=dev)
    active_kv[:active] = True
    grad = torch.randn(q.shape, device=dev, generator=gen).to(bf16)
    leaves = (q, k, v, *mlp.parameters())
    common = dict(tau_max=0.25, clip_kappa=1e-4, active_kv=active_kv)

    def run(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            for t in leaves:
                t.grad = None
            fn().backward(grad)

        return step

    def flash() -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return rope_attention(q, k, v)

    methods = {
        "rope_flash": run(flash),
        "mdlmpe_triton": run(
            lambda: triton_attention(
                q,
                k,
                v,
                A,
                D,
                mlp.params(),
                **common,
                block_size=args.tile,
                heads_per_program=args.heads_per_program,
                pair_chunk=args.pair_chunk,
                **({} if args.num_warps is None else {"num_warps": args.num_warps}),
            )
        ),
    }
    if not args.skip_blocked:
        from mdlmpe_ds.attention.blocked import blocked_attention

        methods["mdlmpe_blocked"] = run(
            lambda: blocked_attention(
                q,
                k,
                v,
                A,
                D,
                mlp.params(),
                **common,
                block_size=args.blocked_block,
                checkpoint=True,
                compile=args.compile_blocked,
            )
        )
    return methods


def linear_parts(args: argparse.Namespace, length: int) -> dict[str, Callable[[], None]]:
    """fwd + bwd of one LLaDA-8B layer's matmuls (q, k, v, o projections, SwiGLU) and of the LM head."""
    dev, bf16 = "cuda", torch.bfloat16
    d, ffn, tokens = LLADA["hidden"], LLADA["ffn"], args.batch * length

    def weight(n_in: int, n_out: int) -> torch.Tensor:
        return (torch.randn(n_in, n_out, device=dev) / math.sqrt(n_in)).to(bf16).requires_grad_()

    x = torch.randn(tokens, d, device=dev).to(bf16).requires_grad_()
    w_qkv, w_o = weight(d, 3 * d), weight(d, d)
    w_gate, w_up, w_down = weight(d, ffn), weight(d, ffn), weight(ffn, d)
    w_head = weight(d, LLADA["vocab"])

    def layer() -> None:
        h = (x @ w_qkv)[:, :d] @ w_o
        (F.silu(h @ w_gate) * (h @ w_up) @ w_down).sum().backward()

    def head() -> None:
        (x @ w_head).float().logsumexp(-1).sum().backward()

    return {"linear_layer": layer, "lm_head": head}


def compile_report(args: argparse.Namespace) -> list[dict[str, str]]:
    """Compile the forward, dK/dV and dQ kernels for ``--arch`` (bf16 q/k/v, LLaDA head dims) and
    read each cubin's resource usage: REG (registers per thread) and STACK (spill bytes per thread)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from mdlmpe_ds.attention import triton_backend as backend
    from mdlmpe_ds.attention import triton_kernels as kern

    num_pairs = args.head_dim // 2
    nm = num_pairs // 2
    hidden = max(16, nm)
    pow2 = lambda n: backend._pow2(n, 16)  # noqa: E731
    meta = dict(
        REP=args.heads // args.kv_heads,
        G=args.heads_per_program,
        DH=args.head_dim,
        DP=pow2(args.head_dim),
        FP=pow2(num_pairs),
        HP=pow2(hidden),
        MC=min(pow2(nm), args.pair_chunk),
        NC=math.ceil(nm / min(pow2(nm), args.pair_chunk)),
        BM=args.tile,
        BN=args.tile,
        PREC="tf32",
        UPCAST=False,
    )
    ints, floats = {"L", "HQ", "HKV", "F", "HID", "NM"}, {"tau_max", "clip_kappa", "scale"}
    warps = args.num_warps or backend.NUM_WARPS
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    rows = []
    for name, fn, bf16 in (
        ("forward", kern.mdlmpe_fwd_kernel, {"q", "k", "v", "o"}),
        ("dk_dv", kern.mdlmpe_bwd_dkdv_kernel, {"q", "k", "v", "do_ptr"}),
        ("dq", kern.mdlmpe_bwd_dq_kernel, {"q", "k", "v", "do_ptr"}),
    ):
        signature = {
            n: "constexpr"
            if n in meta
            else "i32"
            if n in ints
            else "fp32"
            if n in floats
            else "*bf16"
            if n in bf16
            else "*fp32"
            for n in fn.arg_names
        }
        start = time.time()
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=meta)
        compiled = triton.compile(
            src, target=GPUTarget("cuda", args.arch, 32), options=dict(num_warps=warps, num_stages=1)
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
            fh.write(compiled.asm["cubin"])
            fh.flush()
            usage = subprocess.run(
                [cuobjdump, "-res-usage", fh.name], capture_output=True, text=True, check=True
            )
        line = next(ln.strip() for ln in usage.stdout.splitlines() if "REG:" in ln)
        fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
        rows.append(
            {
                "kernel": name,
                "REG": fields["REG"],
                "STACK": fields["STACK"],
                "compile_s": f"{time.time() - start:.0f}",
            }
        )
        print(
            f"{name:<8} sm_{args.arch} tile={args.tile} G={args.heads_per_program} "
            f"chunk={args.pair_chunk} warps={warps}: "
            f"{fields['REG']} registers, {fields['STACK']} B spill stack per thread",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        compile_report(args)
        return 0
    if not torch.cuda.is_available():
        print("bench_attention_gpu: needs a CUDA device (none visible); nothing measured", file=sys.stderr)
        return 2
    from mdlmpe_ds.attention.triton_backend import check_triton_available

    check_triton_available()
    device = torch.cuda.get_device_name()
    results = {"device": device, "args": vars(args), "lengths": {}}
    print(f"device: {device}; B={args.batch} Hq={args.heads} Hkv={args.kv_heads} d_h={args.head_dim}")
    for length in args.lengths:
        row: dict[str, dict[str, float]] = {}
        for name, step in {**attention_methods(args, length), **linear_parts(args, length)}.items():
            ms, peak = time_fwd_bwd(step, args.warmup, args.iters)
            row[name] = {"ms": ms, "peak_extra_mib": peak / 2**20}
            torch.cuda.empty_cache()
        base = row["rope_flash"]["ms"]
        print(f"\nL = {length}")
        print(f"{'method':<16}{'fwd+bwd ms':>12}{'x flash':>10}{'peak MiB':>12}")
        for name, r in row.items():
            print(f"{name:<16}{r['ms']:>12.2f}{r['ms'] / base:>10.2f}{r['peak_extra_mib']:>12.1f}")
        lin, head, n = row["linear_layer"]["ms"], row["lm_head"]["ms"], LLADA["layers"]
        rope_step = n * (lin + base) + head
        for name in ("mdlmpe_triton", "mdlmpe_blocked"):
            if name in row:
                ratio = (n * (lin + row[name]["ms"]) + head) / rope_step
                row[name]["step_ratio_estimate"] = ratio
                print(f"estimated whole LLaDA-8B step, {name}: {ratio:.2f}x the RoPE step")
        results["lengths"][str(length)] = row
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
