"""GPU benchmark of one MDLMPE attention layer: fused Triton kernel vs the blocked PyTorch
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
Triton launch settings not given on the command line (tile, heads per program, pair chunk, warps,
stages) are the backend's own (``triton.launch.launch_config`` for the head size, dtype and GPU).
Without a GPU, ``--compile-only`` compiles the four kernels ahead of time for ``--arch`` (sm_90,
H100, by default) with exactly those settings (``triton.aot.compile_kernel``, as the launcher
would) and prints shared memory against the target's limit, registers and spill stack per thread
(cuobjdump), e.g. ``--compile-only --arch 80 --dtype float32`` or ``--compile-only --tile 32``.
Beside every measurement it prints the cost model's ESTIMATE of the same quantity
(``benchmarks/gpu_cost``, today's kernels, central and low-high range): each Triton kernel's time
(measured with the torch profiler), and the step ratio with the run's recompute (gradient
checkpointing: the layer's matmuls and the RoPE attention forward run twice, the MDLMPE attention
once) against the SDPA flash baseline this benchmark runs. ``--model-only`` prints the model's side
without a GPU. Targets: whole-step <= 2.0x at L = 2048. Extra memory: the kernels' transient pair buffers
(alpha, beta, dE/d delta: |M| L^2 fp32 each per sequence, at most AttentionImpl.pair_buffer_gib
per launch) besides O(L) per head.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mdlmpe_ds.attention.common import rope_attention
from mdlmpe_ds.pe.phase import PhaseMLP

sys.path.insert(0, str(Path(__file__).resolve().parent))

# LLaDA-8B (docs/models.md §1.1).
LLADA = dict(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=12288, vocab=126464)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=LLADA["heads"])
    p.add_argument("--kv-heads", type=int, default=LLADA["kv_heads"])
    p.add_argument("--head-dim", type=int, default=LLADA["head_dim"])
    p.add_argument("--active-fraction", type=float, default=1.0, help="share of KV heads with MDLMPE")
    # Triton launch settings: None = the backend's (triton.launch.launch_config).
    p.add_argument("--tile", type=int, default=None, help="Triton row/key tile (attention.tile)")
    p.add_argument("--heads-per-program", type=int, default=None, help="Triton heads sharing alpha/beta")
    p.add_argument("--pair-chunk", type=int, default=None, help="Triton MDLMPE pairs per alpha/beta chunk")
    p.add_argument("--num-warps", type=int, default=None, help="Triton warps")
    p.add_argument("--num-stages", type=int, default=None, help="Triton software-pipelining stages")
    p.add_argument("--phase-tile", type=int, default=None, help="Triton phase kernels' pair tile")
    p.add_argument("--max-registers", type=int, default=None, help="Triton maxnreg (registers/thread)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="q, k, v dtype")
    p.add_argument("--compile-only", action="store_true", help="AOT-compile for --arch, no GPU needed")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability for --compile-only")
    p.add_argument("--blocked-block", type=int, default=128, help="blocked path query block C")
    p.add_argument("--compile-blocked", action="store_true", help="torch.compile the blocked regions")
    p.add_argument("--skip-blocked", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", type=str, default=None, help="also write the results here")
    p.add_argument("--model-only", action="store_true", help="print the cost model's estimates, no GPU")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the cost model's calibration kernel (gpu_cost.calibrate) at the published shapes, "
        "every launch setting of the tutorial's autotuning space, then exit",
    )
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


def layer_inputs(
    batch: int, heads: int, kv_heads: int, head_dim: int, length: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, ...]:
    """One attention layer's inputs, the same numbers on every call: q, k, v (leaves in ``dtype``),
    A, D [B, L, d_h / 2] fp32, a trained-looking (non-zero) phase MLP, and the output gradient.
    Shared by this benchmark and ``sweep_launch_gpu`` (which compares settings on them)."""
    torch.manual_seed(0)  # the phase MLP's own initialisation
    gen = torch.Generator(device=device).manual_seed(0)
    num_pairs = head_dim // 2

    def leaf(h: int) -> torch.Tensor:
        x = torch.randn(batch, h, length, head_dim, device=device, generator=gen)
        return x.to(dtype).requires_grad_()

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    D = torch.rand(batch, length, num_pairs, device=device, generator=gen) + 0.5
    A = torch.rand(batch, length, num_pairs, device=device, generator=gen) * D
    mlp = PhaseMLP(num_pairs, max(16, num_pairs // 2), device=device)
    with torch.no_grad():
        mlp.fc2.weight.normal_(0.0, 0.1, generator=gen)
    grad = torch.randn(q.shape, device=device, generator=gen).to(dtype)
    return q, k, v, A, D, mlp, grad


def attention_methods(args: argparse.Namespace, length: int) -> dict[str, Callable[[], None]]:
    """One closure per method doing fwd + bwd on the same bf16 inputs (leaf grads reset each call)."""
    from mdlmpe_ds.attention.triton.backend import triton_attention
    from mdlmpe_ds.attention.triton.pair_backend import pair_bias_attention

    dev, dtype = "cuda", getattr(torch, args.dtype)
    shape = (args.batch, args.heads, args.kv_heads, args.head_dim, length)
    q, k, v, A, D, mlp, grad = layer_inputs(*shape, dtype, dev)
    active = max(1, round(args.active_fraction * args.kv_heads))
    active_kv = torch.zeros(args.kv_heads, dtype=torch.bool, device=dev)
    active_kv[:active] = True
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

    key_valid = torch.ones(args.batch, length, dtype=torch.bool, device=dev)
    key_valid[:, length - max(1, length // 64) :] = False  # a padded tail: SDPA's bias path

    def padded_rope() -> torch.Tensor:
        return rope_attention(q, k, v, key_valid=key_valid)

    methods = {
        "rope_flash": run(flash),
        "rope_padded_mea": run(padded_rope),
        "mdlmpe_triton_pair": run(
            lambda: pair_bias_attention(
                q, k, v, A, D, mlp.params(), tau_max=0.25, clip_kappa=1e-4, active_kv=active_kv
            )
        ),
        "mdlmpe_triton": run(
            lambda: triton_attention(
                q,
                k,
                v,
                A,
                D,
                mlp.params(),
                **common,
                **launch_overrides(args),
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


def forward_only(args: argparse.Namespace, length: int) -> dict[str, Callable[[], None]]:
    """Forward-only closures of what gradient checkpointing runs a second time in backward: the
    layer's matmuls and the RoPE attention (the MDLMPE attention stays outside the checkpoint)."""
    dev, bf16 = "cuda", torch.bfloat16
    d, ffn, tokens = LLADA["hidden"], LLADA["ffn"], args.batch * length
    x = torch.randn(tokens, d, device=dev).to(bf16)
    w_qkv, w_o = torch.randn(d, 3 * d, device=dev).to(bf16), torch.randn(d, d, device=dev).to(bf16)
    w_gate, w_up = torch.randn(d, ffn, device=dev).to(bf16), torch.randn(d, ffn, device=dev).to(bf16)
    w_down = torch.randn(ffn, d, device=dev).to(bf16)
    shape = (args.batch, args.heads, length, args.head_dim)
    q, k, v = (torch.randn(shape, device=dev).to(bf16) for _ in range(3))

    @torch.no_grad()
    def layer() -> None:
        h = (x @ w_qkv)[:, :d] @ w_o
        F.silu(h @ w_gate) * (h @ w_up) @ w_down

    @torch.no_grad()
    def flash() -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            rope_attention(q, k, v)

    return {"linear_layer_fwd": layer, "rope_flash_fwd": flash}


#: Profiler names of the fused Triton kernels -> the cost model's kernel names.
KERNEL_NAMES = {
    "phase_fwd_kernel": "phase_forward",
    "mdlmpe_fwd_kernel": "forward",
    "mdlmpe_bwd_kernel": "backward",
    "phase_bwd_kernel": "phase_backward",
    "pair_bias_fwd_kernel": "pair_forward",
    "pair_bias_bwd_q_kernel": "pair_backward_q",
    "pair_bias_bwd_k_kernel": "pair_backward_k",
    # SDPA's memory-efficient (cutlass) kernels: the pair design's bias attention.
    "fmha_cutlassF": "attn_bias_fwd (sdpa)",
    "fmha_cutlassB": "attn_bias_bwd (sdpa)",
}


def kernel_times(step: Callable[[], None], iters: int) -> dict[str, float]:
    """Measured ms per fwd + bwd of each fused Triton kernel (all its launches), by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        for raw, name in KERNEL_NAMES.items():
            if raw in event.key:
                us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
                out[name] = out.get(name, 0.0) + us / 1e3 / iters
    return out


def model_estimates(length: int, batch: int, backend: str = "triton") -> dict[str, object]:
    """The cost model's ESTIMATE (low, central, high) of what this benchmark measures for one
    backend at the launcher's settings (``gpu_cost.measured``: ``triton`` from the fused kernels'
    recorded compile, ``triton-pair`` as built, with SDPA's memory-efficient kernels as its bias
    attention): ms per kernel and per MDLMPE layer (batch 1, times ``batch``), and the step ratio
    against the SDPA flash baseline with the run's recompute."""
    from gpu_cost import measured, step
    from gpu_cost.assumptions import SCENARIOS, Scenario

    per = measured.layer_model(measured.BACKENDS[backend][0], length)
    kernels = {
        t.name: tuple(batch * {x.name: x.ms for x in per[s].timings}[t.name] for s in SCENARIOS)
        for t in per["central"].timings
    }
    layer = {s: per[s].ms for s in SCENARIOS}
    rope = tuple(
        batch * step.rope_layer_ms("sdpa_flash", length, Scenario(s), recompute=False)["layer_ms"]
        for s in SCENARIOS
    )
    return dict(
        kernels=kernels,
        mdlmpe_layer_ms=tuple(batch * layer[s] for s in SCENARIOS),
        rope_flash_ms=rope,
        step_ratio=measured.model_step_ratio(backend, length),
    )


def measured_rates(timed: dict[str, float], length: int, batch: int) -> dict[str, float]:
    """The measured counterparts of the model's RoPE-side assumptions (``gpu_cost.measured``'s
    ``rope_rates`` of ``timed``, ms per method), printed beside them."""
    from gpu_cost import measured

    rates = measured.rope_rates(timed, length, batch)
    print(f"measured rates vs the model's assumptions (low / central / high), L = {length}:")
    for name, (value, assumed) in rates.items():
        print(f"  {name:<62} measured {value:8.3g}   assumed " + " / ".join(f"{a:.3g}" for a in assumed))
    return {name: value for name, (value, _) in rates.items()}


def _range(values) -> str:
    low, central, high = values
    return f"{central:.2f} ({low:.2f}-{high:.2f})"


def print_model(length: int, batch: int) -> dict[str, object]:
    est = model_estimates(length, batch)
    print(f"cost model ESTIMATE, L = {length}, batch {batch} (central, low-high):")
    for name, ms in est["kernels"].items():
        print(f"  {name:<16} {_range(ms)} ms")
    print(
        f"  mdlmpe layer     {_range(est['mdlmpe_layer_ms'])} ms; "
        f"rope_flash {_range(est['rope_flash_ms'])} ms"
    )
    print(f"  step ratio vs SDPA flash RoPE, with recompute: {_range(est['step_ratio'])}")
    return est


def launch_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The Triton launch settings given on the command line (the rest are the backend's)."""
    given = dict(
        block_size=args.tile,
        heads_per_program=args.heads_per_program,
        pair_chunk=args.pair_chunk,
        num_warps=args.num_warps,
        num_stages=args.num_stages,
        max_registers=args.max_registers,
        phase_tile=args.phase_tile,
    )
    return {k: v for k, v in given.items() if v is not None}


def compile_report(args: argparse.Namespace) -> list[dict[str, object]]:
    """Compile the four kernels for ``--arch`` with the launcher's settings for
    ``--head-dim`` and ``--dtype`` (plus any given on the command line) and print each cubin's
    shared memory (against the target's limit), registers and spill stack per thread."""
    from mdlmpe_ds.attention.triton.aot import compile_kernel
    from mdlmpe_ds.attention.triton.launch import KERNELS, launch_config

    dtype = getattr(torch, args.dtype)
    config = launch_config(args.head_dim, dtype, args.arch)
    given = launch_overrides(args)
    if "block_size" in given:
        given["tile"] = given.pop("block_size")
    config = dataclasses.replace(config, **given)
    rows = []
    for kernel in KERNELS:
        res = compile_kernel(kernel, args.head_dim, dtype, args.arch, config)
        print(res.line(), flush=True)
        rows.append(res.row())
    return rows


def measure_calibration() -> dict[str, object]:
    """TFLOP/s of the calibration kernel per published length and launch setting on this GPU (the
    autotuner's pick is the fastest), beside the published figure; its output is first checked
    against SDPA. Recorded, the model's side is printed by ``estimate_gpu.py --measured``."""
    from gpu_cost import calibrate

    batch, length = calibrate.TOKENS // 1024, 1024
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (
        torch.randn(batch, calibrate.HEADS, length, calibrate.HEAD_DIM, device="cuda", generator=gen).to(
            torch.bfloat16
        )
        for _ in range(3)
    )
    o = calibrate.attention(q, k, v)
    err = (o.float() - F.scaled_dot_product_attention(q, k, v).float()).abs().max().item()
    print(f"calibration kernel vs SDPA at S = {length}: max abs error {err:.2e}", flush=True)
    if not err < 2e-2:
        raise AssertionError(f"the calibration kernel does not compute attention (max error {err})")
    rows = []
    for length, published in calibrate.PUBLISHED_TFLOPS.items():
        per_setting = {}
        for setting in calibrate.TUTORIAL_SPACE:
            try:
                per_setting[",".join(map(str, setting))] = calibrate.measure_tflops(length, setting)
            except Exception as exc:  # a setting this GPU cannot launch: the autotuner skips it
                per_setting[",".join(map(str, setting))] = None
                print(f"  S = {length} setting {setting}: not launched ({type(exc).__name__})")
        central = per_setting[",".join(map(str, calibrate.CENTRAL_SETTING))]
        best = max((v, k) for k, v in per_setting.items() if v is not None)
        print(
            f"S = {length:>5}: published {published:5.0f} TFLOP/s; measured {central:6.1f} at the central "
            f"setting, {best[0]:6.1f} at the fastest ({best[1]})",
            flush=True,
        )
        rows.append(dict(length=length, published=published, central=central, best=best[0],
                         best_setting=best[1], per_setting=per_setting))  # fmt: skip
    return {"max_abs_error_vs_sdpa": err, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model_only:
        results = {str(n): print_model(n, args.batch) for n in args.lengths}
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=2)
        return 0
    if args.compile_only:
        rows = compile_report(args)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=2)
        return 0 if all(r["fits"] for r in rows) else 1
    if not torch.cuda.is_available():
        print("bench_attention_gpu: needs a CUDA device (none visible); nothing measured", file=sys.stderr)
        return 2
    from mdlmpe_ds.attention.triton.backend import check_triton_available

    check_triton_available()
    device = torch.cuda.get_device_name()
    if args.calibrate:
        import triton

        results = {"device": device, "torch": torch.__version__, "triton": triton.__version__}
        results["calibration"] = measure_calibration()
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=2)
        return 0
    from gpu_cost import measured

    results = {"device": device, "args": vars(args), "lengths": {}}
    print(f"device: {device}; B={args.batch} Hq={args.heads} Hkv={args.kv_heads} d_h={args.head_dim}")
    for length in args.lengths:
        row: dict[str, dict[str, float]] = {}
        methods = attention_methods(args, length)
        for name, step in {**methods, **linear_parts(args, length), **forward_only(args, length)}.items():
            ms, peak = time_fwd_bwd(step, args.warmup, args.iters)
            row[name] = {"ms": ms, "peak_extra_mib": peak / 2**20}
            torch.cuda.empty_cache()
        timed = {name: r["ms"] for name, r in row.items()}
        kernels_ms = {
            design: kernel_times(methods[method], args.iters) for design, method in measured.BACKENDS.values()
        }
        base = row["rope_flash"]["ms"]
        print(f"\nL = {length}")
        print(f"{'method':<16}{'fwd+bwd ms':>12}{'x flash':>10}{'peak MiB':>12}")
        for name, r in row.items():
            print(f"{name:<16}{r['ms']:>12.2f}{r['ms'] / base:>10.2f}{r['peak_extra_mib']:>12.1f}")
        lin, head, n = row["linear_layer"]["ms"], row["lm_head"]["ms"], LLADA["layers"]
        rope_step = n * (lin + base) + head
        for name in ("mdlmpe_triton", "mdlmpe_triton_pair", "mdlmpe_blocked"):
            if name in row:
                ratio = (n * (lin + row[name]["ms"]) + head) / rope_step
                row[name]["step_ratio_estimate"] = ratio
                print(f"estimated whole LLaDA-8B step, {name}: {ratio:.2f}x the RoPE step")
        # Side by side with the cost model: the same quantities, the step with the run's recompute
        # (gpu_cost.measured: the sum the README's measured table is made of).
        if launch_overrides(args) or (args.heads, args.kv_heads, args.head_dim) != (32, 32, 128):
            print("  (the model is for the launcher's settings at LLaDA-8B shapes; this run differs)")
        row["model"], row["measured_kernels_ms"], row["step_ratio_recompute"] = {}, kernels_ms, {}
        for backend, (design, method) in measured.BACKENDS.items():
            ratio = measured.assembled_step_ratio(timed, kernels_ms, backend)
            est = model_estimates(length, args.batch, backend)
            print(f"measured vs cost model ESTIMATE (central, low-high), L = {length}, {method} ({design}):")
            for name, ms in est["kernels"].items():
                got = kernels_ms[design].get(name)
                shown = f"{got:8.2f}" if got is not None else "     n/a"
                print(f"  {name:<22} measured {shown} ms   model {_range(ms)} ms")
            print(
                f"  {'mdlmpe layer':<22} measured {row[method]['ms']:8.2f} ms   "
                f"model {_range(est['mdlmpe_layer_ms'])} ms"
            )
            print(f"  {'rope_flash':<22} measured {base:8.2f} ms   model {_range(est['rope_flash_ms'])} ms")
            print(f"  step ratio (recompute) measured {ratio:.2f}   model {_range(est['step_ratio'])}")
            row["model"][design], row["step_ratio_recompute"][design] = est, ratio
        row["rates"] = measured_rates(timed, length, args.batch)
        results["lengths"][str(length)] = row
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
