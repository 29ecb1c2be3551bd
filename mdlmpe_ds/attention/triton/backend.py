"""Fused Triton MDLMPE attention: the ``triton`` value of ``AttentionImpl.backend``
(``--attention.backend``).

Same contract as ``reference_attention`` (the spec) plus ``block_size``; an autograd.Function
over two kernels in ``triton.kernels`` (imported lazily: triton picks interpreter vs compiler
when it decorates, so ``TRITON_INTERPRET`` must be settled first).

Design (paper Eqs. (26), (25); kernels.py says what each pass holds):
- The logit is RoPE plus a correction, S_ij = (q_i . k_j + E_ij) / sqrt(d_h), with
  E_ij = sum_{m in M} alpha (q1 k1 + q2 k2) + beta (q2 k1 - q1 k2), alpha = cos(delta) - 1,
  beta = sin(delta). The plain term is one tile product (tensor cores); E is the CUDA-core work.
- A program owns a tile of rows (forward) or keys (backward) and G query heads. Per
  (row tile, key tile) the head-independent work (r, the angle, the phase MLP, alpha, beta) is
  done once for the G heads; the per-head work is a broadcast over a leading head axis. Backward
  sums dE/dalpha, dE/dbeta over the heads before the phase MLP's backward (once per tile).
- alpha, beta by Taylor polynomials when |tau_max| <= 0.5 (|delta| <= tau_max; error bound in
  kernels.POLY_SIN_BOUND / POLY_COS_BOUND, tested densely), libdevice sin otherwise; approximate
  division where a clamp follows; 32-bit offsets (inputs of 2^31 elements or more are refused).
- Online softmax; the forward saves only O and the row max m and sum l (m and l apart, not
  their log-sum-exp, so a padding-only row, whose logits all sit at finfo(float32).min, keeps its
  uniform weights exactly as the reference does).
- One backward pass per key tile: dK, dV and the phase-MLP gradients (per-program slots, summed
  in torch: deterministic), and dQ added with fp32 atomics into a zeroed buffer (so dQ's order of
  summation is not fixed on a GPU: run-to-run differences at fp32 rounding). The correction's
  gradients of the pair dims go to [B, Hq, L, |M|] buffers joined in torch. GQA: dK, dV per query
  head (fp32), summed per KV group. Extra memory is O(B Hq L d_h): no L x L buffer.
- Inactive KV heads (the per-head warm-up mask) skip the correction entirely: their query heads
  are routed to plain RoPE SDPA (flash) and only the active heads run the kernel.
- Precision: q.k, P.V, dO.V, dS.K, dS^T.Q, P^T.dO are tile products in the inputs' dtype (bf16
  tensor cores, fp32 accumulation; P and dS rounded to bf16 as in flash attention); the whole pair
  path (ratio, angle, MLP, alpha, beta, E, its gradients) is fp32, its MLP products TF32 for 16-bit
  inputs, IEEE fp32 for fp32 inputs. The interpreter upcasts bf16 tile operands (its bf16 dot is
  wrong in triton 3.9; the upcast is exact).
- Launch settings: ``triton.launch.launch_config(d_h, dtype, capability)``, one function used by
  the launcher, the CI resource check (tests/unit/test_triton_resources.py compiles both kernels
  for sm_80 and sm_90 at d_h 64 / 128, bf16 / fp32, and fails if shared memory is over the
  target's per-block limit or spills grow) and ``benchmarks/bench_attention_gpu.py
  --compile-only``. ``benchmarks/estimate_gpu.py`` turns the kernels' sm_90 SASS into an
  ESTIMATED H100 step time (not a measurement; correctness is verified in the interpreter only).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from mdlmpe_ds.attention.common import check_inputs, rope_attention
from mdlmpe_ds.attention.triton.launch import (
    LaunchConfig,
    device_capability,
    kernel_constexprs,
    launch_config,
)
from mdlmpe_ds.pe.heads import query_head_mask
from mdlmpe_ds.pe.phase import PhaseParams, mdlmpe_pairs

# Launch settings (tile, heads per program, pair chunk, warps, stages, registers) come from
# triton.launch.launch_config(d_h, dtype, GPU capability) unless given explicitly.
# Largest tile edge accepted on a GPU: the correction tiles BM * BN * |M| live in registers.
MAX_GPU_TILE = 64


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_triton_available() -> None:
    """Raise RuntimeError saying why the ``triton`` backend cannot run here (build-time check)."""
    try:
        import triton  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            "attention backend 'triton' needs the triton package (pip install triton); "
            "use backend 'blocked' on machines without it"
        ) from err
    if not torch.cuda.is_available() and not _interpreting():
        raise RuntimeError(
            "attention backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for the CPU "
            "interpreter, tests only); use backend 'blocked' on CPU"
        )


class _Plan:
    """Static launch parameters shared by the two kernels of one call."""

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, w1: torch.Tensor, config: LaunchConfig, tau_max: float
    ) -> None:
        batch, self.num_heads, self.length, self.head_dim = q.shape
        self.num_kv = k.shape[1]
        self.num_pairs = self.head_dim // 2
        self.hidden = w1.shape[0]
        self.num_mdlmpe = len(mdlmpe_pairs(self.num_pairs))
        self.tile = config.tile
        self.meta = kernel_constexprs(
            num_heads=self.num_heads,
            num_kv=self.num_kv,
            head_dim=self.head_dim,
            hidden=self.hidden,
            num_mdlmpe=self.num_mdlmpe,
            dtype=q.dtype,
            tile=config.tile,
            heads=config.heads_per_program,
            chunk=config.pair_chunk,
            interpreting=_interpreting(),
            tau_max=tau_max,
            split=config.pair_split,
        )
        self.group = self.meta["G"]
        self.rows = batch * (self.num_heads // self.group)
        self.num_tiles = math.ceil(self.length / config.tile)
        self.meta.update(
            num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.max_registers
        )

    def dims(self) -> tuple[int, ...]:
        return (self.length, self.num_heads, self.num_kv, self.num_pairs, self.hidden, self.num_mdlmpe)


class _MDLMPEAttention(torch.autograd.Function):
    """All heads active. Inputs contiguous; phase tensors fp32; kbias [B, L] fp32."""

    @staticmethod
    def forward(ctx, q, k, v, A, D, w1, b1, w2, b2, kbias, tau_max, clip_kappa, scale, config):
        from mdlmpe_ds.attention.triton import kernels as kern

        plan = _Plan(q, k, w1, config, tau_max)
        out = torch.empty_like(q)
        row_max = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        row_sum = torch.empty_like(row_max)
        kern.mdlmpe_fwd_kernel[(plan.num_tiles, plan.rows)](
            q,
            k,
            v,
            A,
            D,
            kbias,
            w1,
            b1,
            w2,
            b2,
            out,
            row_max,
            row_sum,
            *plan.dims(),
            tau_max,
            clip_kappa,
            scale,
            **plan.meta,
        )
        ctx.save_for_backward(q, k, v, A, D, w1, b1, w2, b2, kbias, out, row_max, row_sum)
        ctx.plan = plan
        ctx.consts = (tau_max, clip_kappa, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from mdlmpe_ds.attention.triton import kernels as kern

        q, k, v, A, D, w1, b1, w2, b2, kbias, out, row_max, row_sum = ctx.saved_tensors
        plan: _Plan = ctx.plan
        grad_out = grad_out.contiguous()
        batch, num_heads, length, head_dim = q.shape
        # delta_i = sum_d dO_i O_i, the softmax-backward row term.                    [B, Hq, L]
        row_delta = (grad_out.float() * out.float()).sum(-1)
        f32 = dict(dtype=torch.float32, device=q.device)
        dk = torch.empty(batch, num_heads, length, head_dim, **f32)
        dv = torch.empty_like(dk)
        dq = torch.zeros_like(dk)  # every key-tile program adds its share
        # Zeroed: the kernel adds into these chunk by chunk (dq1, dq2, dk1, dk2; dW2, db2 per slot).
        pair_grads = [torch.zeros(batch, num_heads, length, plan.num_mdlmpe, **f32) for _ in range(4)]
        slots = plan.num_tiles * plan.rows
        dw1 = torch.empty(slots, *w1.shape, **f32)
        db1 = torch.empty(slots, *b1.shape, **f32)
        dw2 = torch.zeros(slots, *w2.shape, **f32)
        db2 = torch.zeros(slots, *b2.shape, **f32)
        kern.mdlmpe_bwd_kernel[(plan.num_tiles, plan.rows)](
            q,
            k,
            v,
            A,
            D,
            kbias,
            w1,
            b1,
            w2,
            b2,
            grad_out,
            row_max,
            row_sum,
            row_delta,
            dq,
            dk,
            dv,
            *pair_grads,
            dw1,
            db1,
            dw2,
            db2,
            *plan.dims(),
            *ctx.consts,
            **plan.meta,
        )
        # Add the correction gradients to the MDLMPE pair dims (f and F + f, f odd).
        pairs = mdlmpe_pairs(plan.num_pairs).to(q.device)
        dq[..., pairs] += pair_grads[0]
        dq[..., pairs + plan.num_pairs] += pair_grads[1]
        dk[..., pairs] += pair_grads[2]
        dk[..., pairs + plan.num_pairs] += pair_grads[3]
        # GQA: query heads h*REP .. h*REP+REP-1 read KV head h.
        rep = num_heads // plan.num_kv
        dk = dk.view(batch, plan.num_kv, rep, length, head_dim).sum(2)
        dv = dv.view(batch, plan.num_kv, rep, length, head_dim).sum(2)
        # One entry per forward input: q, k, v, A, D, W1, b1, W2, b2, then kbias and 4 settings.
        grads_in = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None)
        return (*grads_in, dw1.sum(0), db1.sum(0), dw2.sum(0), db2.sum(0), *(None,) * 5)


def _check_inputs(q, k, v, A, D, phase: PhaseParams, key_valid, block_size: int) -> None:
    """The shapes every backend checks (``common.check_inputs``), then what the fused kernel adds:
    one dtype, 32-bit offsets, no gradient into A and D, a power-of-2 tile that fits the registers."""
    if q.dim() == 4 and q.shape[-1] % 2:
        raise ValueError(f"triton_attention: head_dim={q.shape[-1]} must be even (rotary pairs)")
    check_inputs("triton_attention", q, k, v, A, D, phase, None, key_valid, block_size)
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
    if not _interpreting() and not 16 <= block_size <= MAX_GPU_TILE:
        raise ValueError(
            f"triton_attention: block_size={block_size} (attention.tile) must be in [16, {MAX_GPU_TILE}] "
            "on a GPU; the correction tile lives in registers (None picks the one that fits)"
        )


def _fused(q, k, v, A, D, phase: PhaseParams, kbias, tau_max, clip_kappa, scale, config: LaunchConfig):
    tensors = (q, k, v, A.float(), D.float(), *(p.float() for p in phase), kbias)
    settings = (float(tau_max), float(clip_kappa), float(scale), config)
    return _MDLMPEAttention.apply(*(t.contiguous() for t in tensors), *settings)


def resolve_launch(
    q: torch.Tensor,
    block_size: int | None = None,
    heads_per_program: int | None = None,
    pair_chunk: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_registers: int | None = None,
    pair_split: int | None = None,
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
        pair_split=pair_split,
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
    pair_split: int | None = None,
) -> torch.Tensor:
    """Fused MDLMPE attention; the same numbers as ``reference_attention`` (Eq. (26)).

    q [B, Hq, L, d_h], k/v [B, Hkv, L, d_h] (RoPE-rotated); A, D [B, L, F] fp32 (no grad);
    ``active_kv`` [Hkv] bool (None: all); ``key_valid`` [B, L] bool. ``block_size`` is the row
    and key tile edge; ``heads_per_program``, ``pair_chunk`` (MDLMPE pairs per alpha/beta chunk, a
    power of 2, >= 16 on a GPU), ``num_warps``, ``num_stages``, ``max_registers`` and
    ``pair_split`` (1 or 2, see ``LaunchConfig``) are GPU tuning knobs; each one
    left None comes from ``triton.launch.launch_config`` (the settings checked to fit the GPU).
    Output [B, Hq, L, d_h] in q's dtype; grads for q, k, v and the phase MLP.
    """
    check_triton_available()
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"attention backend 'triton' got {q.device.type} tensors: the fused kernel runs on CUDA tensors "
            "(TRITON_INTERPRET=1 runs it on the CPU, tests only); use backend 'auto' or 'blocked' here"
        )
    config = resolve_launch(
        q, block_size, heads_per_program, pair_chunk, num_warps, num_stages, max_registers, pair_split
    )
    _check_inputs(q, k, v, A, D, phase, key_valid, config.tile)
    chunk = config.pair_chunk
    if chunk < 1 or chunk & (chunk - 1) or (chunk < 16 and not _interpreting()):
        raise ValueError(f"triton_attention: pair_chunk={chunk} must be a power of 2 (>= 16 on a GPU)")
    if config.pair_split not in (1, 2):
        raise ValueError(f"triton_attention: pair_split={config.pair_split} must be 1 or 2")
    batch, num_heads, length, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    kbias = torch.zeros(batch, length, dtype=torch.float32, device=q.device)
    if key_valid is not None:
        kbias.masked_fill_(~key_valid.bool(), torch.finfo(torch.float32).min)
    args = (tau_max, clip_kappa, scale, config)
    if active_kv is None or bool(active_kv.all()):
        return _fused(q, k, v, A, D, phase, kbias, *args)
    if not bool(active_kv.any()):
        return rope_attention(q, k, v, key_valid, scale)
    # Route: active KV heads (and their query heads) through the kernel, the rest through SDPA.
    active_kv = active_kv.to(device=q.device, dtype=torch.bool)
    active_q = query_head_mask(active_kv, num_heads)
    kv_on, kv_off = active_kv.nonzero().flatten(), (~active_kv).nonzero().flatten()
    q_on, q_off = active_q.nonzero().flatten(), (~active_q).nonzero().flatten()
    out_on = _fused(q[:, q_on], k[:, kv_on], v[:, kv_on], A, D, phase, kbias, *args)
    out_off = rope_attention(q[:, q_off], k[:, kv_off], v[:, kv_off], key_valid, scale)
    order = torch.argsort(torch.cat([q_on, q_off]))  # back to the original head order
    return torch.cat([out_on, out_off], dim=1)[:, order]
