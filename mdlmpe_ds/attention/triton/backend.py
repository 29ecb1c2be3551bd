"""Fused Triton MDLMPE attention: the ``triton`` value of ``AttentionImpl.backend``
(``--attention.backend``).

Same contract as ``reference_attention`` (the spec) plus ``block_size``; an autograd.Function
over four kernels in ``triton.kernels`` (imported lazily: triton picks interpreter vs compiler
when it decorates, so ``TRITON_INTERPRET`` must be settled first).

Design (paper Eqs. (23)-(26); kernels.py says what each kernel holds):
- The logit is RoPE plus a correction, S_ij = (q_i . k_j + E_ij) / sqrt(d_h), with
  E_ij = sum_{m in M} alpha (q1 k1 + q2 k2) + beta (q2 k1 - q1 k2), alpha = cos(delta) - 1,
  beta = sin(delta). The plain term is one tile product (tensor cores); E is the CUDA-core work.
- alpha, beta depend on (i, j, m), never on the head, and are symmetric in (i, j): a phase kernel
  computes them once per layer for half the plane (r, the angle, the phase MLP, sin / cos) into
  [B, |M|, L, L] fp32 buffers; the attention kernels read them, G query heads per program
  sharing each alpha_m, beta_m tile load. The backward recomputes them (another phase launch)
  rather than keeping them, sums dE/d delta over all heads (in registers over the G heads of a
  program, atomically over programs), and one more phase kernel runs the MLP's backward once per
  pair. Those buffers are the only O(L^2) memory, transient: at most PAIR_BUFFER_BYTES per
  launch (whole sequences while they fit, else row blocks of one sequence).
- alpha, beta by Taylor polynomials when |tau_max| <= 0.5 (|delta| <= tau_max; error bound in
  kernels.POLY_SIN_BOUND / POLY_COS_BOUND, tested densely), libdevice sin otherwise; approximate
  division where a clamp follows.
- Online softmax; the forward saves only O and the row max m and sum l (m and l apart, not
  their log-sum-exp, so a padding-only row, whose logits all sit at finfo(float32).min, keeps its
  uniform weights exactly as the reference does).
- One backward pass per key tile: dK, dV, the pair parts of dK (added by one program only, in a
  fixed order: deterministic);
  dQ and its pair parts with fp32 atomics into zeroed buffers, and dE/d delta likewise (so their
  order of summation is not fixed on a GPU: run-to-run differences at fp32 rounding). GQA: dK, dV
  per query head (fp32), summed per KV group.
- Inactive KV heads (the per-head warm-up mask) skip the correction entirely: their query heads
  are routed to plain RoPE SDPA (flash) and only the active heads run the kernels.
- Precision: q.k, P.V, dO.V, dS.K, dS^T.Q, P^T.dO are tile products in the inputs' dtype (bf16
  tensor cores, fp32 accumulation; P and dS rounded to bf16 as in flash attention); the whole pair
  path (ratio, angle, MLP, alpha, beta, E, its gradients) is fp32, its MLP products TF32 for 16-bit
  inputs, IEEE fp32 for fp32 inputs. The interpreter upcasts bf16 tile operands (its bf16 dot is
  wrong in triton 3.9; the upcast is exact).
- The launch plan (tiles, pair-buffer launches under a byte budget, the phase launch) is
  ``triton.plan``. Launch settings: ``triton.launch.launch_config(d_h, dtype, capability)``, one
  function used by the launcher, the CI resource check (tests/unit/test_triton_resources.py compiles the four
  kernels for sm_80 and sm_90 at d_h 64 / 128, bf16 / fp32, and fails if shared memory is over the
  target's per-block limit or spills grow) and ``benchmarks/bench_attention_gpu.py
  --compile-only``. ``benchmarks/estimate_gpu.py`` turns the kernels' sm_90 SASS into an
  ESTIMATED H100 step time (not a measurement; correctness is verified in the interpreter only).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mdlmpe_ds.attention.common import check_inputs, route_active_heads
from mdlmpe_ds.attention.triton.launch import (
    LaunchConfig,
    device_capability,
    launch_config,
)
from mdlmpe_ds.attention.triton.plan import MAX_GPU_TILE, PAIR_BUFFER_BYTES, Plan, interpreting
from mdlmpe_ds.pe.phase import PhaseParams


def check_triton_available() -> None:
    """Raise RuntimeError saying why the ``triton`` backend cannot run here (build-time check)."""
    try:
        import triton  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            "attention backend 'triton' needs the triton package (pip install triton); "
            "use backend 'blocked' on machines without it"
        ) from err
    if not torch.cuda.is_available() and not interpreting():
        raise RuntimeError(
            "attention backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for the CPU "
            "interpreter, tests only); use backend 'blocked' on CPU"
        )


def _sequences(s: int, e: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Sequences s .. e - 1 of each tensor (batch-major, so each slice stays contiguous)."""
    return [t[s:e] for t in tensors]


class _MDLMPEAttention(torch.autograd.Function):
    """All heads active. Inputs contiguous; phase tensors fp32; kbias [B, L] fp32."""

    @staticmethod
    def forward(ctx, q, k, v, A, D, w1, b1, w2, b2, kbias, tau_max, clip_kappa, scale, config, budget):
        from mdlmpe_ds.attention.triton import kernels as kern

        plan = Plan(q, k, w1, config, tau_max, budget)
        out = torch.empty_like(q)
        row_max = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        row_sum = torch.empty_like(row_max)
        qp, kp = plan.pair_components(q), plan.pair_components(k)
        groups = plan.num_heads // plan.group
        for s, e, r0, rows in plan.blocks(q.shape[0]):
            alpha, beta = plan.alpha_beta(A[s:e], D[s:e], w1, b1, w2, b2, tau_max, clip_kappa, r0, rows)
            row_tiles = math.ceil(min(rows, plan.length - r0) / plan.head_tile)
            kern.mdlmpe_fwd_kernel[((e - s) * groups, row_tiles)](
                *_sequences(s, e, q, k, v, qp, kp),
                alpha,
                beta,
                *_sequences(s, e, kbias, out, row_max, row_sum),
                *plan.head_dims(r0, rows),
                scale,
                **plan.meta["forward"],
            )
            del alpha, beta
        ctx.save_for_backward(q, k, v, A, D, w1, b1, w2, b2, kbias, out, row_max, row_sum)
        ctx.plan = plan
        ctx.consts = (tau_max, clip_kappa, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from mdlmpe_ds.attention.triton import kernels as kern

        q, k, v, A, D, w1, b1, w2, b2, kbias, out, row_max, row_sum = ctx.saved_tensors
        plan: Plan = ctx.plan
        tau_max, clip_kappa, scale = ctx.consts
        grad_out = grad_out.contiguous()
        batch, num_heads, length, head_dim = q.shape
        # delta_i = sum_d dO_i O_i, the softmax-backward row term.                    [B, Hq, L]
        row_delta = (grad_out.float() * out.float()).sum(-1)
        f32 = dict(dtype=torch.float32, device=q.device)
        dk = torch.zeros(batch, num_heads, length, head_dim, **f32)  # row blocks add to dk, dv
        dv = torch.zeros_like(dk)
        dq = torch.zeros_like(dk)  # every key-tile program adds its share
        qp, kp = plan.pair_components(q), plan.pair_components(k)
        dqp = torch.zeros(batch, num_heads, plan.num_mdlmpe, plan.padded, 2, **f32)  # atomics
        dkp = torch.zeros_like(dqp)  # per query head; added to by its key-tile program only
        spans = plan.key_spans
        slots = (plan.padded // plan.phase_tile) * spans * batch  # one per phase-kernel program
        dw1 = torch.empty(slots, *w1.shape, **f32)
        db1 = torch.empty(slots, *b1.shape, **f32)
        dw2 = torch.zeros(slots, *w2.shape, **f32)
        db2 = torch.zeros(slots, *b2.shape, **f32)
        key_tiles, groups = math.ceil(length / plan.head_tile), num_heads // plan.group
        for s, e, r0, rows in plan.blocks(batch):
            alpha, beta = plan.alpha_beta(A[s:e], D[s:e], w1, b1, w2, b2, tau_max, clip_kappa, r0, rows)
            ddelta = plan.pair_buffer(e - s, rows, q.device, zero=True)
            kern.mdlmpe_bwd_kernel[((e - s) * groups, key_tiles)](
                *_sequences(s, e, q, k, v, qp, kp),
                alpha,
                beta,
                *_sequences(s, e, kbias, grad_out, row_max, row_sum, row_delta, dq, dk, dv, dqp, dkp),
                ddelta,
                *plan.head_dims(r0, rows),
                scale,
                **plan.meta["backward"],
            )
            del alpha, beta
            first = s * (plan.padded // plan.phase_tile) * spans  # this chunk's slots
            kern.phase_bwd_kernel[plan.phase_grid(rows, e - s)](
                A[s:e],
                D[s:e],
                w1,
                b1,
                w2,
                b2,
                ddelta,
                dw1[first:],
                db1[first:],
                dw2[first:],
                db2[first:],
                *plan.phase_dims(r0, rows),
                tau_max,
                clip_kappa,
                **plan.meta["phase_backward"],
            )
            del ddelta
        # Add the correction gradients to the MDLMPE pair dims (f and F + f, f odd).
        pairs = plan.pairs
        dqp, dkp = dqp[:, :, :, :length].transpose(2, 3), dkp[:, :, :, :length].transpose(2, 3)
        dq[..., pairs] += dqp[..., 0]  # [B, Hq, L, NM]
        dq[..., pairs + plan.num_pairs] += dqp[..., 1]
        dk[..., pairs] += dkp[..., 0]
        dk[..., pairs + plan.num_pairs] += dkp[..., 1]
        # GQA: query heads h*REP .. h*REP+REP-1 read KV head h.
        rep = num_heads // plan.num_kv
        dk = dk.view(batch, plan.num_kv, rep, length, head_dim).sum(2)
        dv = dv.view(batch, plan.num_kv, rep, length, head_dim).sum(2)
        # One entry per forward input: q, k, v, A, D, W1, b1, W2, b2, then kbias and 5 settings.
        grads_in = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None)
        return (*grads_in, dw1.sum(0), db1.sum(0), dw2.sum(0), db2.sum(0), *(None,) * 6)


def _check_inputs(q, k, v, A, D, phase: PhaseParams, active_kv, key_valid, block_size: int) -> None:
    """The shapes every backend checks (``common.check_inputs``), then what the fused kernel adds:
    one dtype, 32-bit offsets, no gradient into A and D, a power-of-2 tile within the GPU range."""
    if q.dim() == 4 and q.shape[-1] % 2:
        raise ValueError(f"triton_attention: head_dim={q.shape[-1]} must be even (rotary pairs)")
    check_inputs("triton_attention", q, k, v, A, D, phase, active_kv, key_valid, block_size)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"triton_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if q.numel() >= 2**31 or k.numel() >= 2**31:
        raise ValueError(
            f"triton_attention: q {tuple(q.shape)} / k {tuple(k.shape)} have 2^31 elements or more; "
            "the kernels index with 32-bit offsets (split the batch)"
        )
    if A.requires_grad or D.requires_grad:
        raise NotImplementedError(
            "triton_attention: gradients w.r.t. A, D (coordinate='mlp') are not implemented in the "
            "fused kernel; use attention backend 'blocked' with a learned coordinate"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"triton_attention: block_size={block_size} (attention.tile) must be a power of 2")
    if not interpreting() and not 16 <= block_size <= MAX_GPU_TILE:
        raise ValueError(
            f"triton_attention: block_size={block_size} (attention.tile) must be in [16, {MAX_GPU_TILE}] "
            "on a GPU; the score tiles live in registers (None picks the one that fits)"
        )


def _fused(
    q, k, v, A, D, phase: PhaseParams, kbias, tau_max, clip_kappa, scale, config: LaunchConfig, budget: int
):
    tensors = (q, k, v, A.float(), D.float(), *(p.float() for p in phase), kbias)
    settings = (float(tau_max), float(clip_kappa), float(scale), config, int(budget))
    return _MDLMPEAttention.apply(*(t.contiguous() for t in tensors), *settings)


def resolve_launch(
    q: torch.Tensor,
    block_size: int | None = None,
    heads_per_program: int | None = None,
    pair_chunk: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_registers: int | None = None,
    phase_tile: int | None = None,
) -> LaunchConfig:
    """The launch settings of a call: :func:`triton.launch.launch_config` for q's head size, dtype and
    GPU (sm_90's in the interpreter), with any setting given explicitly taking its place."""
    capability = 90 if q.device.type != "cuda" else device_capability(q.device)
    config = launch_config(q.shape[-1], q.dtype, capability)
    explicit = dict(
        tile=block_size,
        heads_per_program=heads_per_program,
        pair_chunk=pair_chunk,
        num_warps=num_warps,
        num_stages=num_stages,
        max_registers=max_registers,
        phase_tile=phase_tile,
    )
    return dataclasses.replace(config, **{k: v for k, v in explicit.items() if v is not None})


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    phase: PhaseParams,
    *,
    tau_max: float,
    clip_kappa: float,
    active_kv: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    scale: float | None = None,
    block_size: int | None = None,
    heads_per_program: int | None = None,
    pair_chunk: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_registers: int | None = None,
    phase_tile: int | None = None,
    pair_buffer_bytes: int | None = None,
) -> torch.Tensor:
    """Fused MDLMPE attention; the same numbers as ``reference_attention`` (Eq. (26)).

    q [B, Hq, L, d_h], k/v [B, Hkv, L, d_h] (RoPE-rotated); A, D [B, L, F] fp32 (no grad);
    ``active_kv`` [Hkv] bool (None: all); ``key_valid`` [B, L] bool. ``block_size`` is the row
    and key tile edge; ``heads_per_program``, ``pair_chunk`` (MDLMPE pairs per alpha/beta chunk, a
    power of 2, >= 16 on a GPU), ``num_warps``, ``num_stages``, ``max_registers`` and
    ``phase_tile`` (the phase kernels' pair tile, see ``LaunchConfig``) are GPU tuning knobs; each one
    left None comes from ``triton.launch.launch_config`` (the settings checked to fit the GPU).
    ``pair_buffer_bytes``: the most the transient pair buffers of one launch hold (None:
    PAIR_BUFFER_BYTES; ``AttentionImpl.pair_buffer_gib`` in a run).
    Output [B, Hq, L, d_h] in q's dtype; grads for q, k, v and the phase MLP.
    """
    check_triton_available()
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"attention backend 'triton' got {q.device.type} tensors: the fused kernel runs on CUDA tensors "
            "(TRITON_INTERPRET=1 runs it on the CPU, tests only); use backend 'auto' or 'blocked' here"
        )
    config = resolve_launch(
        q, block_size, heads_per_program, pair_chunk, num_warps, num_stages, max_registers, phase_tile
    )
    _check_inputs(q, k, v, A, D, phase, active_kv, key_valid, config.tile)
    chunk = config.pair_chunk
    if chunk < 1 or chunk & (chunk - 1) or (chunk < 16 and not interpreting()):
        raise ValueError(f"triton_attention: pair_chunk={chunk} must be a power of 2 (>= 16 on a GPU)")
    batch, _, length, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    kbias = torch.zeros(batch, length, dtype=torch.float32, device=q.device)
    if key_valid is not None:
        kbias.masked_fill_(~key_valid.bool(), torch.finfo(torch.float32).min)
    budget = PAIR_BUFFER_BYTES if pair_buffer_bytes is None else int(pair_buffer_bytes)
    if budget <= 0:
        raise ValueError(f"triton_attention: pair_buffer_bytes={pair_buffer_bytes} must be > 0")
    args = (tau_max, clip_kappa, scale, config, budget)

    def fused(qs, ks, vs):
        return _fused(qs, ks, vs, A, D, phase, kbias, *args)

    return route_active_heads(fused, q, k, v, active_kv, key_valid, scale)
