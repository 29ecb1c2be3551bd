"""MDLMPE attention as RoPE attention with an additive bias: the ``triton-pair`` value of
``AttentionImpl.backend`` (``--attention.backend triton-pair``).

Same contract as ``reference_attention`` (the spec). The logit is S = (q . k + E) / sqrt(d_h)
(docs/method.md "The correction form"), so the attention is SDPA with the additive bias
B = E * scale + key bias, and its gradient dB is the gradient of the logits:
- ``pair_bias.pair_bias_fwd_kernel`` writes B [B, Hq, L, L] for every active query head, computing
  the phase MLP, alpha and beta once per (i, j) tile for all heads (no [B, |M|, L, L] buffers);
- ``torch.nn.functional.scaled_dot_product_attention`` with that bias (a float ``attn_mask``
  that requires grad): on a GPU the memory-efficient kernel, which returns dB; on the CPU the
  math path;
- ``pair_bias_bwd_q_kernel`` / ``pair_bias_bwd_k_kernel`` fold dE = dB * scale into the pair
  components of dq, dk and, through dE/d delta summed over the heads in registers, into the
  phase MLP's gradients. Each kernel's loop over the other side's tiles is cut into splits
  (``launch.pair_backward_splits``; grids (L / tile_m, key splits, B) and (L / key_tile_n, row
  splits, B); each kernel has its own tile, ``launch.pair_kernel_settings``) so that batch 1 fills
  the GPU: each split writes fp32 partials of dq, dk pairs and each query-side program its own
  MLP-gradient slot, summed here in torch in a fixed order; no atomics between programs (a
  deterministic backward).

Memory: B is kept by SDPA for its backward and dB lives during it: H_q L^2 elements each, in the
attention's dtype, per sequence and layer. Layer checkpointing therefore recomputes this backend
with the layer (``AttentionImpl.keeps_pair_tensors``): one layer's B and dB at a time. The pair
components of q and k are kept for the backward in fp32 (``pair_components``: 2 |M| / d_h of q
and k in fp32, 32 MiB each for LLaDA-8B at L = 4096), and the backward adds its fp32 partials of
their gradients, splits x B x H x L x 2 |M| x 4 bytes per kernel, each bounded to 1/8 of B and
dB (LLaDA-8B at L = 4096, batch 1: 96 + 64 MiB against 2 GiB).

Precision: E is accumulated in fp32 and stored, scaled and with the key-padding bias folded in,
in the attention's dtype (bf16 in bf16 training). SDPA's fused kernels take a bias in the query's
dtype, and the rounding adds at most half an ulp of |E scale| to a logit whose bf16 q, k already
carry that much (tests/unit/test_triton_pair.py bounds the output error it causes). The pair
path itself (ratio, angle, MLP, alpha, beta, E, dE/d delta) is fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mdlmpe_ds.attention.common import check_inputs, masked_key_bias, repeat_kv, route_active_heads
from mdlmpe_ds.attention.triton.backend import check_triton_available
from mdlmpe_ds.attention.triton.launch import (
    PairLaunchConfig,
    device_capability,
    pair_backward_splits,
    pair_constexprs,
    pair_kernel_options,
    pair_kernel_settings,
    pair_launch_config,
    pair_padded_length,
    sm_count,
)
from mdlmpe_ds.attention.triton.plan import interpreting
from mdlmpe_ds.pe.phase import PhaseParams, mdlmpe_pairs


def pair_components(
    x: torch.Tensor, pairs: torch.Tensor, padded_length: int, padded_pairs: int
) -> torch.Tensor:
    """[B, H, L, d_h] -> [B, H, LP, 2 NMP] fp32, component-major: row l holds component 0 (dim
    2m + 1) of the MDLMPE pairs m at 0 .. NM - 1, component 1 (dim F + 2m + 1) at NMP .. NMP +
    NM - 1, zeros elsewhere and past L (a copy, exact: every bf16 / fp16 value is an fp32 value).

    Why fp32 and padded: the kernels load these components once per head and (i, j) tile, so their
    loads need no bf16 conversions (one integer op per value on the GPU) and no masks (whose
    zero-fill costs a register move per value); the array is 2 NMP / d_h of x's elements in fp32
    (LLaDA-8B: 32 MiB for its 32 heads at L = 4096)."""
    batch, heads, length, head_dim = x.shape
    out = x.new_zeros(batch, heads, padded_length, 2 * padded_pairs, dtype=torch.float32)
    num_pairs = head_dim // 2
    out[:, :, :length, : len(pairs)] = x[..., pairs]
    out[:, :, :length, padded_pairs : padded_pairs + len(pairs)] = x[..., pairs + num_pairs]
    return out


#: The largest value the fp16 pair arithmetic may form: fp16's largest (65,504), halved for margin.
HALF_LIMIT = 32_752.0


def half_pairs_fit(q_max: float, k_max: float, qk_max: float, tau_max: float, num_chunks: int) -> bool:
    """Whether a call's pair arithmetic may run in fp16 (``PairLaunchConfig.half_pairs``), from the
    largest pair component of q (``q_max``) and of k (``k_max``) and the largest product of one
    pair's two (``qk_max`` = max over pairs m of q_max(m) k_max(m), ``pair_maxima``: an outlier
    dimension of q rarely meets one of k in the same pair).

    With c = max |alpha| + max |beta| (0.28 at tau_max 0.25), u = (alpha k1 - beta k2, alpha k2 +
    beta k1) has |u| <= c k_max(m) per component, and per (i, j, pair) the kernels form at most:
    the components; the forward's q1 u1 + q2 u2 summed over the num_chunks pair chunks,
    2 c num_chunks qk_max; the query side's dE (q2 (k1 + u1) - q1 (k2 + u2)) with dE scaled below
    2, 4 (1 + c) qk_max; the key side's dE (alpha q1 + beta q2), 2 c q_max. Every one must stay
    under HALF_LIMIT; a NaN or inf anywhere is not a fit (the fp32 kernels then pass it on)."""
    tau = abs(tau_max)
    c = (1.0 - math.cos(min(tau, math.pi))) + math.sin(min(tau, math.pi / 2))
    worst = max(q_max, k_max, 2 * c * num_chunks * qk_max, 4 * (1 + c) * qk_max, 2 * c * q_max)
    return math.isfinite(worst) and worst <= HALF_LIMIT


def pair_maxima(xpair: torch.Tensor) -> torch.Tensor:
    """[B, H, LP, 2 NMP] (``pair_components``) -> [NMP]: the largest |component| of each pair."""
    top = xpair.abs().amax(dim=(0, 1, 2))
    return torch.maximum(top[: top.shape[0] // 2], top[top.shape[0] // 2 :])


def half_pairs_for(config: PairLaunchConfig, dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels of ``config.half_pairs`` that run in fp16 for inputs of ``dtype``: none for fp32
    inputs, which ask for fp32 numbers (the pair path's error then stays ~1e-7)."""
    return () if dtype == torch.float32 else config.half_pairs


def dbias_shift(dbias: torch.Tensor, scale: float) -> float:
    """A power of two that puts max |dBias * scale| in [1, 2): the fp16 backward's dE, whose
    values (a softmax gradient, ~1 / L) fall below fp16's normal range (6.1e-5) unscaled. Exact,
    undone in fp32 on the kernels' outputs. 1 for an all-zero or non-finite dBias."""
    low, high = torch.aminmax(dbias)  # one pass, no |dBias| copy
    top = max(-float(low), float(high)) * abs(scale)
    if not math.isfinite(top) or top == 0.0:
        return 1.0
    return 2.0 ** -math.floor(math.log2(top))


class _PairBias(torch.autograd.Function):
    """bias [B, Hq, L, L] in q's dtype = E * scale + kbias; gradients for q, k (their MDLMPE pair
    dims) and the phase MLP. Inputs contiguous; A, D and the MLP fp32; kbias [B, L] fp32."""

    @staticmethod
    def forward(ctx, q, k, A, D, w1, b1, w2, b2, kbias, tau_max, clip_kappa, scale, config):
        from mdlmpe_ds.attention.triton import pair_bias as kern

        batch, num_heads, length, head_dim = q.shape
        pairs = mdlmpe_pairs(head_dim // 2).to(q.device)
        shapes = dict(
            num_heads=num_heads,
            num_kv=k.shape[1],
            head_dim=head_dim,
            hidden=w1.shape[0],
            num_mdlmpe=len(pairs),
            dtype=q.dtype,
            config=config,
            interpreting=interpreting(),
            tau_max=tau_max,
        )

        chunking = pair_constexprs(**shapes, kernel="pair_forward")
        padded, num_chunks = pair_padded_length(config, length), chunking["NC"]
        padded_pairs = chunking["MC"] * num_chunks
        qpair = pair_components(q, pairs, padded, padded_pairs)
        kpair = pair_components(k, pairs, padded, padded_pairs)
        # The kernels whose pair arithmetic runs in fp16 on this call: the config's, in 16-bit
        # training only, unless q, k are too large for fp16's range (then every kernel runs in fp32).
        half = half_pairs_for(config, q.dtype)
        if half:
            q_top, k_top = pair_maxima(qpair), pair_maxima(kpair)
            q_max, k_max, qk_max = torch.stack([q_top.max(), k_top.max(), (q_top * k_top).max()]).tolist()
            if not half_pairs_fit(q_max, k_max, qk_max, tau_max, num_chunks):
                half = ()

        def launch(kernel: str) -> dict[str, object]:
            """Kernel ``kernel``'s constexprs (its own tile, the dtype of its pair arithmetic) and
            compile options."""
            pair_dt = kern.tl.float16 if kernel in half else kern.tl.float32
            return {
                **pair_constexprs(**shapes, kernel=kernel),
                "PAIR_DT": pair_dt,
                **pair_kernel_options(config, kernel),
            }

        def planes(kernel: str, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            """The pair components as ``kernel`` loads them: fp16 where its arithmetic is fp16
            (half the bytes, and the load layout its packed arithmetic uses)."""
            return tuple(x.half() if kernel in half else x for x in xs)

        bias = torch.empty(batch, num_heads, length, length, dtype=q.dtype, device=q.device)
        tile = pair_kernel_settings(config, "pair_forward")
        grid = (math.ceil(length / tile.tile_m), math.ceil(length / tile.tile_n), batch)
        dims = (length, padded, num_heads, k.shape[1], head_dim // 2, w1.shape[0], len(pairs))
        kern.pair_bias_fwd_kernel[grid](
            A, D, w1, b1, w2, b2, *planes("pair_forward", qpair, kpair), kbias, bias, *dims, scale,
            tau_max, clip_kappa, **launch("pair_forward"),
        )  # fmt: skip
        ctx.save_for_backward(qpair, kpair, A, D, w1, b1, w2, b2)
        ctx.settings = (q.shape, k.shape, pairs, dims, (scale, tau_max, clip_kappa), launch, config)
        ctx.half = (half, planes)
        return bias

    @staticmethod
    def backward(ctx, dbias):
        from mdlmpe_ds.attention.triton import pair_bias as kern

        qpair, kpair, A, D, w1, b1, w2, b2 = ctx.saved_tensors
        q_shape, k_shape, pairs, dims, consts, launch, config = ctx.settings
        dbias = dbias.contiguous()
        batch, length = q_shape[0], q_shape[2]
        splits = pair_backward_splits(
            config,
            length=length,
            batch=batch,
            num_heads=q_shape[1],
            num_kv=k_shape[1],
            padded_pairs=qpair.shape[-1] // 2,
            bias_itemsize=dbias.element_size(),
            sms=sm_count(dbias.device),
        )
        (key_splits, key_tiles), (row_splits, row_tiles_each) = splits["q"], splits["k"]
        f32 = dict(dtype=torch.float32, device=dbias.device)
        # Partial pair gradients [splits, B, H, L, 2 |M|]: each program adds to its own rows (query
        # side) or keys (key side) of its split's part only; the parts are summed below.
        dqpair = torch.zeros(key_splits, *qpair.shape, **f32)
        dkpair = torch.zeros(row_splits, *kpair.shape, **f32)
        query_side, key_side = (
            pair_kernel_settings(config, k) for k in ("pair_backward_q", "pair_backward_k")
        )
        row_tiles = math.ceil(length / query_side.tile_m)
        slots = row_tiles * key_splits * batch  # one per program of the query-side kernel
        dw1 = torch.empty(slots, *w1.shape, **f32)
        db1 = torch.empty(slots, *b1.shape, **f32)
        dw2 = torch.zeros(slots, *w2.shape, **f32)
        db2 = torch.zeros(slots, *b2.shape, **f32)
        mlp = (A, D, w1, b1, w2, b2)
        half, planes = ctx.half
        # An fp16 backward kernel takes dE = dBias * scale * shift (max |dE| in [1, 2)); its
        # outputs are divided by the shift here, in fp32 (exact: a power of two).
        scale, *rest = consts
        shift = dbias_shift(dbias, scale) if {"pair_backward_q", "pair_backward_k"} & set(half) else 1.0
        q_shift = shift if "pair_backward_q" in half else 1.0
        k_shift = shift if "pair_backward_k" in half else 1.0
        kern.pair_bias_bwd_q_kernel[(row_tiles, key_splits, batch)](
            *mlp, *planes("pair_backward_q", qpair, kpair), dbias, dqpair, dw1, db1, dw2, db2, *dims,
            scale * q_shift, *rest, key_tiles, **launch("pair_backward_q"),
        )  # fmt: skip
        kern.pair_bias_bwd_k_kernel[(math.ceil(length / key_side.tile_n), row_splits, batch)](
            *mlp, *planes("pair_backward_k", qpair), dbias, dkpair, *dims, scale * k_shift, *rest,
            row_tiles_each, **launch("pair_backward_k"),
        )  # fmt: skip
        # torch's reductions over a dimension add in a fixed order on every device: deterministic.
        dq = _scatter_pairs(_unshifted(dqpair.sum(0), q_shift), pairs, q_shape)
        dk = _scatter_pairs(_unshifted(dkpair.sum(0), k_shift), pairs, k_shape)
        mlp_grads = (_unshifted(g.sum(0), q_shift) for g in (dw1, db1, dw2, db2))
        return dq, dk, None, None, *mlp_grads, *(None,) * 5


def _unshifted(grad: torch.Tensor, shift: float) -> torch.Tensor:
    """``grad`` of a kernel that ran with dE scaled by ``shift`` (``dbias_shift``), unscaled in place
    (exact); no pass over it when nothing was scaled (fp32 kernels)."""
    return grad if shift == 1.0 else grad.div_(shift)


def _scatter_pairs(dpair: torch.Tensor, pairs: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[B, H, LP, 2 NMP] fp32 (``pair_components``' layout) -> the gradient [B, H, L, d_h] fp32,
    zero outside the MDLMPE dims."""
    out = torch.zeros(shape, dtype=torch.float32, device=dpair.device)
    length, padded_pairs = shape[2], dpair.shape[-1] // 2
    out[..., pairs] = dpair[:, :, :length, : len(pairs)]
    out[..., pairs + shape[-1] // 2] = dpair[:, :, :length, padded_pairs : padded_pairs + len(pairs)]
    return out


def resolve_pair_launch(q: torch.Tensor, config: PairLaunchConfig | None = None) -> PairLaunchConfig:
    """The pair-bias kernels' launch settings of a call: ``config`` if given, else
    ``launch.pair_launch_config`` for q's head size, dtype and GPU (sm_90's in the interpreter)."""
    if config is not None:
        return config
    capability = 90 if q.device.type != "cuda" else device_capability(q.device)
    return pair_launch_config(q.shape[-1], q.dtype, capability)


def _check_pair_inputs(q, k, v, A, D, phase: PhaseParams, active_kv, key_valid) -> None:
    """The shapes every backend checks (``common.check_inputs``), then what the kernels add: an
    even head size, one dtype, no gradient into A and D."""
    name = "triton_pair_attention"
    if q.dim() == 4 and q.shape[-1] % 2:
        raise ValueError(f"{name}: head_dim={q.shape[-1]} must be even (rotary pairs)")
    check_inputs(name, q, k, v, A, D, phase, active_kv, key_valid, 1)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"{name}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if A.requires_grad or D.requires_grad:
        raise NotImplementedError(
            f"{name}: gradients w.r.t. A, D (coordinate='mlp') are not implemented in the pair "
            "kernels; use attention backend 'blocked' with a learned coordinate"
        )


def _biased_attention(q, k, v, A, D, phase: PhaseParams, key_valid, tau_max, clip_kappa, scale, config):
    """All heads active: the pair bias, then SDPA with it. [B, Hq, L, d_h]."""
    batch, num_heads, length, _ = q.shape
    min_value = masked_key_bias(q.dtype)
    kbias = torch.zeros(batch, length, dtype=torch.float32, device=q.device)
    if key_valid is not None:
        kbias.masked_fill_(~key_valid.bool(), min_value)
        # As in common.rope_attention: a sequence with no valid key gets zero queries, so its rows
        # are the uniform average of V in every precision.
        has_key = key_valid.bool().any(dim=-1)
        if not bool(has_key.all()):
            q = q * has_key[:, None, None, None].to(q.dtype)
    tensors = (q, k, A.float(), D.float(), *(p.float() for p in phase), kbias)
    settings = (float(tau_max), float(clip_kappa), scale, config)
    bias = _PairBias.apply(*(t.contiguous() for t in tensors), *settings)
    # K, V repeated for GQA: the memory-efficient kernel (the one that returns the bias gradient)
    # does not take grouped K, V.
    return F.scaled_dot_product_attention(
        q, repeat_kv(k, num_heads), repeat_kv(v, num_heads), attn_mask=bias, scale=scale
    )


def pair_bias_attention(
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
    launch: PairLaunchConfig | None = None,
) -> torch.Tensor:
    """MDLMPE attention through the pair-bias kernels and SDPA; the numbers of
    ``reference_attention`` (Eq. (26)). q [B, Hq, L, d_h], k/v [B, Hkv, L, d_h] (RoPE-rotated);
    A, D [B, L, F] fp32 (no grad); ``active_kv`` [Hkv] bool (None: all; inactive heads run plain
    RoPE SDPA); ``key_valid`` [B, L] bool; ``launch``: the kernels' settings (None: per GPU).
    Output [B, Hq, L, d_h] in q's dtype; gradients for q, k, v and the phase MLP."""
    check_triton_available()
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"attention backend 'triton-pair' got {q.device.type} tensors: its kernels run on CUDA tensors "
            "(TRITON_INTERPRET=1 runs them on the CPU, tests only); use backend 'auto' or 'blocked' here"
        )
    config = resolve_pair_launch(q, launch)
    _check_pair_inputs(q, k, v, A, D, phase, active_kv, key_valid)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)

    def fused(qs, ks, vs):
        return _biased_attention(qs, ks, vs, A, D, phase, key_valid, tau_max, clip_kappa, scale, config)

    return route_active_heads(fused, q, k, v, active_kv, key_valid, scale)
