"""The pair arithmetic in fp16, packed two to a register, checked without a GPU.

``measured.floor_rows`` finds that the cost targets need 62-87% of the H100's FP32 peak on the pair
arithmetic, and 31-43% at twice that rate. The H100 runs packed half-precision FMAs (HFMA2: two
fp16 FMAs per lane and instruction) at twice its FP32 rate. The three ``triton-pair`` kernels take
the dtype of their per-head pair arithmetic as a constexpr, ``PAIR_DT`` (``pair_bias``), set per
kernel by ``PairLaunchConfig.half_pairs``: fp32 by default, where every conversion is a no-op (the
sm_90 machine code is the recorded one), and fp16: pair components, alpha, beta, dE and their
products in fp16, every sum over heads, keys, rows, tiles and pair chunks in fp32. Two questions
decide whether the fp16 rate is usable, answered offline:

1. Precision (``precision_rows``): all three kernels in fp16 in the Triton interpreter, through the
   real launch path (``pair_backend._PairBias``, its range guard ``half_pairs_fit`` off so that
   every case runs in fp16; the table says which cases the guard would send to fp32), whose numpy
   fp16 ops round every operation (the GPU's FMA rounds once per multiply-add: the interpreter
   errs on the safe side). Forward: the bias against the fp32 kernels' (which match the reference
   to ~1e-7), beside the bias's own rounding to bf16 that training pays. Backward: the gradients
   of q, k and the phase MLP for a dBias from SDPA's backward at a training-like scale, against
   the fp32 kernels' with the exact dBias, beside the error the fp32 kernels already take from
   dBias rounded to bf16 (as SDPA returns it in bf16 training). dBias is then below fp16's normal
   range (6.1e-5): the fp16 backward is shown without and with the backend's shift of dBias by a
   power of two (``dbias_shift``: exact, undone in fp32 after).
2. Machine code (``probe_loops``): each kernel compiled for sm_90 at the launcher's settings with
   PAIR_DT fp32 and fp16 (fp16 pair components in memory), its per-head loop read from the SASS.

``PairLaunchConfig.half_pairs`` runs it (opt-in; the sweep's candidate ``per_kernel_half``): the
forward's and the query side's, where the machine code gains. ``step_estimates`` says what that
would be worth if time scaled with instructions: an ESTIMATE; the sweep measures it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: (d_h, heads, L, scale of q and k, std of dO): the study's cases. The phase MLP's output layer is
#: drawn (std 0.5) away from its zero init so that |delta| spans (0, tau_max). The second case's dO
#: puts max |dBias| near 2e-5, below fp16's normal range, as a long sequence's softmax does (P ~
#: 1 / L); the third scales q and k by 30 (|bias| up to ~360) to look for fp16 overflow.
CASES = ((32, 2, 32, 3.0, 1e-4), (128, 2, 32, 3.0, 1e-6), (128, 2, 32, 30.0, 1e-4))
GRADIENTS = ("q", "k", "phase MLP")


def _relative(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _probe_worker(case: tuple) -> dict:
    """In a process whose triton runs interpreted: one case (``precision_rows``)."""
    from dataclasses import replace

    import torch

    from mdlmpe_ds.attention.triton import pair_backend
    from mdlmpe_ds.attention.triton.launch import PAIR_KERNELS
    from mdlmpe_ds.pe.phase import PhaseMLP, mdlmpe_pairs

    head_dim, heads, length, size, grad_scale = case
    gen = torch.Generator().manual_seed(head_dim + heads + length)
    torch.manual_seed(0)
    mlp = PhaseMLP(head_dim // 2, max(16, head_dim // 4))
    with torch.no_grad():
        mlp.fc2.weight.normal_(0.0, 0.5, generator=gen)
        mlp.fc2.bias.normal_(0.0, 0.5, generator=gen)
    q, k, v = (
        torch.randn(1, heads, length, head_dim, generator=gen).mul(size).bfloat16().float() for _ in range(3)
    )
    D = torch.rand(1, length, head_dim // 2, generator=gen) + 0.5
    A = torch.rand(1, length, head_dim // 2, generator=gen) * D
    scale = 1.0 / math.sqrt(head_dim)
    config = pair_backend.resolve_pair_launch(q)
    fit, shift, applied = pair_backend.half_pairs_fit, pair_backend.dbias_shift, pair_backend.half_pairs_for
    pairs = mdlmpe_pairs(head_dim // 2)
    q_top, k_top = (
        pair_backend.pair_maxima(pair_backend.pair_components(x, pairs, length, len(pairs))) for x in (q, k)
    )
    q_max, k_max, qk_max = float(q_top.max()), float(k_top.max()), float((q_top * k_top).max())

    def run(half: bool, dbias=None, scaled: bool = True):
        """The bias, and with ``dbias`` the gradients (q, k, the MLP's four, flattened), through
        the backend with all three kernels' pair arithmetic in fp16 (``half``; the range guard
        and the fp32-input rule off, so that fp16 runs whatever q, k are; ``scaled``: the
        backend's dBias shift on)."""
        launch = replace(config, half_pairs=PAIR_KERNELS if half else ())
        pair_backend.half_pairs_fit = lambda *args: True
        pair_backend.half_pairs_for = lambda config, dtype: config.half_pairs  # fp32 inputs here
        if not scaled:
            pair_backend.dbias_shift = lambda *args: 1.0
        try:
            leaves = [t.detach().clone().requires_grad_(dbias is not None) for t in (q, k, *mlp.params())]
            args = (*leaves[:2], A, D, *(p.float() for p in leaves[2:]), torch.zeros(1, length))
            bias = pair_backend._PairBias.apply(*args, 0.25, 1e-4, scale, launch)
            if dbias is None:
                return bias.detach(), None
            bias.backward(dbias)
            grads = [t.grad for t in leaves]
            return bias.detach(), (grads[0], grads[1], torch.cat([g.flatten() for g in grads[2:]]))
        finally:
            pair_backend.half_pairs_fit, pair_backend.dbias_shift, pair_backend.half_pairs_for = (
                fit,
                shift,
                applied,
            )

    exact, _ = run(False)
    half, _ = run(True)
    # dBias from SDPA's backward with the fp32 bias, at a training-like scale of dO
    bias_leaf = exact.clone().requires_grad_()
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias_leaf, scale=scale)
    out.backward(torch.randn(out.shape, generator=gen) * grad_scale)
    dbias = bias_leaf.grad
    rounded = dbias.bfloat16().float()
    _, want = run(False, dbias)
    _, training = run(False, rounded)
    _, fp16 = run(True, rounded, scaled=False)
    _, fp16_shifted = run(True, rounded)
    return dict(
        case=list(case),
        bias_max=float(exact.abs().max()),
        dbias_max=float(dbias.abs().max()),
        guard_fits=fit(q_max, k_max, qk_max, 0.25, 2),
        forward={
            "fp16 bias error": _relative(half, exact),
            "bias rounding to bf16": _relative(exact.bfloat16(), exact),
        },
        backward={
            name: {
                "fp32, dBias in bf16 (training)": _relative(training[i], want[i]),
                "fp16": _relative(fp16[i], want[i]),
                "fp16, dBias scaled": _relative(fp16_shifted[i], want[i]),
            }
            for i, name in enumerate(GRADIENTS)
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


def probe_loops() -> dict[str, dict[str, dict]]:
    """{kernel: {"fp32": ..., "fp16": ...}}: each pair kernel compiled for sm_90 at the launcher's
    settings (LLaDA-8B widths, bf16) with PAIR_DT fp32 (as shipped) and fp16 (fp16 pair components
    in memory): registers, spill, and its per-head loop (``sass.body_summary``, with the packed
    half-precision instructions counted apart)."""
    import torch
    import triton.language as tl

    from gpu_cost import sass
    from mdlmpe_ds.attention.triton import aot
    from mdlmpe_ds.attention.triton.launch import PAIR_KERNELS

    out = {}
    for kernel in PAIR_KERNELS:
        out[kernel] = {}
        for name, pair_dt, pointers in (
            ("fp32", tl.float32, None),
            ("fp16", tl.float16, {"qpair": "fp16", "kpair": "fp16"}),
        ):
            compiled = aot.compile_cubin(
                kernel, 128, torch.bfloat16, 90, constexprs={"PAIR_DT": pair_dt}, pointers=pointers
            )
            cubin = compiled.asm["cubin"]
            usage = aot.resource_usage(cubin)
            loops = sass.innermost_loops(sass.parse_sass(aot.sass(cubin)))
            body = [i for loop in loops for i in loop]  # the head loop (the key side: per KV head)
            summary = sass.body_summary(body)
            summary["packed_half"] = sum(op.startswith(("HFMA2", "HMUL2", "HADD2")) for _, op, _ in body)
            out[kernel][name] = dict(registers=usage["REG"], spill_bytes=usage["STACK"], head_loop=summary)
    return out


def step_estimates(
    loops: dict[str, dict[str, dict]], record: dict | None = None
) -> dict[int, tuple[float, float]]:
    """{L: (today's ESTIMATE, with HALF_PAIR_KERNELS in fp16)}: triton-pair's assembled step
    ratio with each pair kernel's time scaled by the instructions it issues
    (``measured.rework_step_ratio``: the H100's measured times, scaled to today's build), then the
    forward's and the query side's scaled again by their fp16 / fp32 head-loop instructions
    (``probe_loops``; the recomputed forward too). An ESTIMATE twice over: issue efficiency
    unchanged, and the head loop standing for the whole kernel."""
    from gpu_cost import measured
    from mdlmpe_ds.attention.triton.launch import HALF_PAIR_KERNELS

    record = measured.load() if record is None else record
    ratio = {
        k: loops[k]["fp16"]["head_loop"]["instructions"] / loops[k]["fp32"]["head_loop"]["instructions"]
        for k in HALF_PAIR_KERNELS
    }
    out = {}
    for length in measured.lengths(record):
        row = record["benchmark"]["lengths"][str(length)]
        kernels = {d: dict(k) for d, k in row["kernels_ms"].items()}
        ms = dict(row["ms"])
        for r in measured.rework_rows(record, length):
            est = r["estimate_ms"] * ratio.get(r["kernel"], 1.0)
            ms["mdlmpe_triton_pair"] += est - r["ms"]
            kernels["pair_bias"][r["kernel"]] = est
        today = measured.rework_step_ratio(record, length)[1]
        out[length] = (today, measured.assembled_step_ratio(ms, kernels, "triton-pair"))
    return out


def step_table(estimates: dict[int, tuple[float, float]]) -> str:
    """docs/gpu.md's table of ``step_estimates``."""
    lines = [
        "| triton-pair step ÷ RoPE step, LLaDA-8B, micro-batch 1 (ESTIMATE) | "
        + " | ".join(f"L = {n}" for n in estimates)
        + " |",
        "|---" * (len(estimates) + 1) + "|",
        "| today's kernels (fp32 pair arithmetic), issue-scaled | "
        + " | ".join(f"{a:.2f}×" for a, _ in estimates.values())
        + " |",
        "| `half_pairs` = forward and query side in fp16, issue-scaled | "
        + " | ".join(f"{b:.2f}×" for _, b in estimates.values())
        + " |",
    ]
    return "\n".join(lines)


def precision_table(rows: list[dict]) -> str:
    """docs/gpu.md's table of ``precision_rows``: relative errors (norms)."""
    lines = [
        "| d_h, heads, L, q and k scale, dO std | max abs bias, dBias | range guard | forward: fp16 bias / "
        "bias rounded to bf16 | backward, q / k / phase MLP: fp32 with dBias in bf16 (training) | fp16 | "
        "fp16, dBias scaled |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = ("fp32, dBias in bf16 (training)", "fp16", "fp16, dBias scaled")
    for r in rows:
        d, h, n, size, grad = r["case"]
        f = r["forward"]
        backward = [" / ".join(f"{r['backward'][g][key]:.1e}" for g in GRADIENTS) for key in keys]
        lines.append(
            f"| {d}, {h}, {n}, {size:g}, {grad:g} | {r['bias_max']:.1f}, {r['dbias_max']:.1e} | "
            f"{'fp16' if r['guard_fits'] else 'fp32 (forced here)'} | "
            f"{f['fp16 bias error']:.1e} / {f['bias rounding to bf16']:.1e} | {' | '.join(backward)} |"
        )
    return "\n".join(lines)


def loops_table(loops: dict[str, dict[str, dict]]) -> str:
    """docs/gpu.md's table of ``probe_loops``."""
    lines = [
        "| kernel (sm_90, LLaDA-8B widths) | PAIR_DT | registers | spill B | per head and warp: "
        "instructions | FP pipe (of them packed fp16) | shuffles | global loads |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kernel, builds in loops.items():
        for name, r in builds.items():
            h = r["head_loop"]
            lines.append(
                f"| {kernel} | {name} | {r['registers']} | {r['spill_bytes']} | {h['instructions']} | "
                f"{h['fp32']} ({h['packed_half']}) | {h['shuffles']} | {h['global_loads']} |"
            )
    return "\n".join(lines)


def main() -> int:
    print("The triton-pair kernels with their pair arithmetic in fp16 (PAIR_DT; a probe, not shipped).\n")
    print("Precision, in the Triton interpreter (every fp16 operation rounded), relative errors:")
    print(precision_table(precision_rows()) + "\n")
    print("Machine code, ahead-of-time sm_90 compiles at the launcher's settings:")
    loops = probe_loops()
    print(loops_table(loops) + "\n")
    print("The step, scaled by instructions (an ESTIMATE on the H100's measured pieces):")
    print(step_table(step_estimates(loops)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.exit(main())
