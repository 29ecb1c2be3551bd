"""A direction checked without a GPU: the pair arithmetic in fp16, packed two to a register.

``measured.floor_rows`` finds that the cost targets need 62-87% of the H100's FP32 peak on the pair
arithmetic, and 31-43% at twice that rate. The H100 runs packed half-precision FMAs (HFMA2: two
fp16 FMAs per lane and instruction) at twice its FP32 rate. Two questions decide whether that rate
is usable, and both are answered here offline, for the pair forward (the bias E):

1. Precision (``precision_rows``): the probe kernel (``half_pair_probe``: the shipped pair forward
   with fp16 pair components, alpha, beta and per-pair products, the sum over a chunk's pairs in
   fp32) run in the Triton interpreter, whose numpy fp16 ops round every operation (the GPU's FMA
   rounds once per multiply-add: the interpreter errs on the safe side). Its bias against the
   reference's, and the error it puts on the MDLMPE part of the attention output (reference minus
   plain RoPE), beside the baselines: the shipped fp32 pair path, and the bias's own rounding to
   bf16, which training already pays.
2. Machine code (``probe_loops``): the probe and the shipped forward compiled for sm_90 at the
   launcher's settings; their per-head loops read from the SASS (``sass.body_summary``).

The backward kernels are not probed: their sums over keys (dq), rows (dk) and heads (dE/d delta)
need fp32 accumulators, so their gain would be smaller. Nothing here changes what runs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: (d_h, heads, L, scale of q and k, std of the phase MLP's output weights): the study's cases. The
#: MLP's output layer is drawn away from its zero init so that |delta| spans (0, tau_max).
CASES = ((32, 4, 64, 3.0, 0.5), (128, 4, 64, 3.0, 0.5), (128, 4, 64, 30.0, 0.5))


def _probe_worker(case: tuple) -> dict:
    """In a process whose triton runs interpreted: the probe and the shipped pair forward on one
    case, and the attention outputs they lead to. Returns the errors (see ``precision_rows``)."""
    import torch

    from mdlmpe_ds.attention.common import rope_attention
    from mdlmpe_ds.attention.reference import reference_attention
    from mdlmpe_ds.attention.triton import pair_backend, pair_bias
    from mdlmpe_ds.pe.phase import PhaseMLP

    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_cost.half_pair_probe import half_pair_fwd_kernel

    head_dim, heads, length, size, spread = case
    gen = torch.Generator().manual_seed(head_dim + heads + length)
    torch.manual_seed(0)
    mlp = PhaseMLP(head_dim // 2, max(16, head_dim // 4))
    with torch.no_grad():
        mlp.fc2.weight.normal_(0.0, spread, generator=gen)
        mlp.fc2.bias.normal_(0.0, spread, generator=gen)
    q, k, v = (
        torch.randn(1, heads, length, head_dim, generator=gen).mul(size).bfloat16().float() for _ in range(3)
    )
    D = torch.rand(1, length, head_dim // 2, generator=gen) + 0.5
    A = torch.rand(1, length, head_dim // 2, generator=gen) * D
    scale = 1.0 / math.sqrt(head_dim)
    phase = mlp.params()
    args = (q, k, A, D, *(p.float().contiguous() for p in phase), torch.zeros(1, length))
    settings = (0.25, 1e-4, scale, pair_backend.resolve_pair_launch(q))
    with torch.no_grad():
        shipped = pair_backend._PairBias.apply(*args, *settings)
        fp32_components = pair_backend.pair_components
        pair_bias.pair_bias_fwd_kernel, kept = half_pair_fwd_kernel, pair_bias.pair_bias_fwd_kernel
        pair_backend.pair_components = lambda *a: fp32_components(*a).half()
        try:
            probe = pair_backend._PairBias.apply(*args, *settings)
        finally:
            pair_bias.pair_bias_fwd_kernel, pair_backend.pair_components = kept, fp32_components
        want = reference_attention(q, k, v, A, D, phase, tau_max=0.25, clip_kappa=1e-4)
        plain = rope_attention(q, k, v)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        exact_bias = shipped.double()  # the fp32 path's bias: the reference's to ~1e-7 (tests)

        def output_error(bias: torch.Tensor) -> float:
            out = sdpa(q, k, v, attn_mask=bias.float(), scale=scale)
            return float((out - want).norm() / (want - plain).norm())

        return dict(
            case=list(case),
            mdlmpe_part=float((want - plain).norm() / want.norm()),
            bias_max=float(exact_bias.abs().max()),
            probe_bias_error=float((probe.double() - exact_bias).norm() / exact_bias.norm()),
            bf16_rounding_error=float((shipped.bfloat16().double() - exact_bias).norm() / exact_bias.norm()),
            output_error={
                "fp32 pair path, bias fp32": output_error(shipped),
                "fp32 pair path, bias bf16 (training)": output_error(shipped.bfloat16()),
                "fp16 pair path, bias fp32": output_error(probe),
                "fp16 pair path, bias bf16": output_error(probe.bfloat16()),
            },
        )


def precision_rows(cases=CASES, timeout: float = 900) -> list[dict]:
    """``_probe_worker`` for every case, in one interpreted subprocess (triton decides interpreter
    or compiler when its kernels are defined, so not in this process)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from gpu_cost import half_pairs; "
        "print(json.dumps([half_pairs._probe_worker(tuple(c)) for c in json.loads(sys.argv[2])]))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "benchmarks"), json.dumps([list(c) for c in cases])],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"the interpreted probe failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def probe_loops() -> dict[str, dict]:
    """The shipped pair forward and the fp16 probe compiled for sm_90 at the launcher's settings
    (LLaDA-8B widths, bf16): registers, spill, and the per-head loop (``sass.body_summary``, with
    the packed half-precision instructions counted apart)."""
    import torch

    from gpu_cost import sass
    from gpu_cost.half_pair_probe import half_pair_fwd_kernel
    from mdlmpe_ds.attention.triton import aot
    from mdlmpe_ds.attention.triton.launch import pair_constexprs, pair_kernel_options, pair_launch_config

    config = pair_launch_config(128, torch.bfloat16, 90)
    meta = pair_constexprs(
        num_heads=32, num_kv=32, head_dim=128, hidden=32, num_mdlmpe=32, dtype=torch.bfloat16,
        config=config, interpreting=False, kernel="pair_forward",
    )  # fmt: skip
    options = pair_kernel_options(config, "pair_forward")
    builds = {
        "shipped (fp32 pair arithmetic)": (aot._pair_kernel_fn("pair_forward"), None),
        "probe (fp16 pair arithmetic)": (half_pair_fwd_kernel, {"qpair": "fp16", "kpair": "fp16"}),
    }
    out = {}
    for name, (fn, pointers) in builds.items():
        cubin = aot.compile_function(fn, meta, torch.bfloat16, 90, options, pointers).asm["cubin"]
        usage = aot.resource_usage(cubin)
        (loop,) = sass.innermost_loops(sass.parse_sass(aot.sass(cubin)))
        summary = sass.body_summary(loop)
        summary["packed_half"] = sum(op.startswith(("HFMA2", "HMUL2", "HADD2")) for _, op, _ in loop)
        out[name] = dict(registers=usage["REG"], spill_bytes=usage["STACK"], head_loop=summary)
    return out


def precision_table(rows: list[dict]) -> str:
    """docs/gpu.md's table of ``precision_rows``."""
    lines = [
        "| d_h, heads, L, q and k scale | MDLMPE part of the output | max abs bias | fp16 bias error | "
        "bias rounding to bf16 | output error on the MDLMPE part, fp32 pairs: bias fp32 / bf16 | "
        "fp16 pairs: bias fp32 / bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d, h, n, size, _ = r["case"]
        o = {k: 100 * v for k, v in r["output_error"].items()}
        fp32_pairs = (
            f"{o['fp32 pair path, bias fp32']:.4f}% / {o['fp32 pair path, bias bf16 (training)']:.2f}%"
        )
        lines.append(
            f"| {d}, {h}, {n}, {size:g} | {100 * r['mdlmpe_part']:.0f}% | {r['bias_max']:.1f} | "
            f"{r['probe_bias_error']:.1e} | {r['bf16_rounding_error']:.1e} | "
            f"{fp32_pairs} | {o['fp16 pair path, bias fp32']:.2f}% / {o['fp16 pair path, bias bf16']:.2f}% |"
        )
    return "\n".join(lines)


def loops_table(loops: dict[str, dict]) -> str:
    """docs/gpu.md's table of ``probe_loops``."""
    lines = [
        "| pair forward, sm_90, LLaDA-8B widths | registers | spill B | per head and warp: instructions | "
        "FP pipe (of them packed fp16) | global loads | barriers |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in loops.items():
        h = r["head_loop"]
        lines.append(
            f"| {name} | {r['registers']} | {r['spill_bytes']} | {h['instructions']} | "
            f"{h['fp32']} ({h['packed_half']}) | {h['global_loads']} | {h['barriers']} |"
        )
    return "\n".join(lines)


def main() -> int:
    print("The pair forward with its pair arithmetic in fp16 (a probe; nothing shipped uses it).\n")
    print("Precision, in the Triton interpreter (every fp16 operation rounded):")
    print(precision_table(precision_rows()) + "\n")
    print("Machine code, ahead-of-time sm_90 compiles at the launcher's settings:")
    print(loops_table(probe_loops()))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.exit(main())
