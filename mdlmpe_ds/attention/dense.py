"""Dense MDLMPE attention for short sequences: the pair phases of a layer formed once, the
correction E handed to the softmax as an additive bias.

Same signature and numbers as :func:`mdlmpe_ds.attention.reference.reference_attention`; the logit is
written as RoPE plus a correction, as in :mod:`mdlmpe_ds.attention.blocked`:

    S_ij = (q_i . k_j + E_ij) / sqrt(d_h),
    E_ij = sum_{m in M} alpha_ijm (q1 k1 + q2 k2)_m + beta_ijm (q2 k1 - q1 k2)_m,
    alpha = cos(delta) - 1,  beta = sin(delta).

delta [B, L, L, |M|] is computed once per call for every head (it does not depend on the head) and
the per-head pair products are a few broadcast multiplies, so plain autograd differentiates the
whole thing with no recompute. It keeps O(B Hq L^2 |M|) fp32 tensors for backward: meant for the
studies' short rows (L <= 256) and for tests, where it is several times faster on a CPU than the
blocked path's per-block Python loop; long rows belong to the blocked or Triton paths.
"""

from __future__ import annotations

import math

import torch

from mdlmpe_ds.attention.common import check_inputs, key_padding_bias, repeat_kv
from mdlmpe_ds.pe.heads import query_head_mask
from mdlmpe_ds.pe.phase import PhaseParams, mdlmpe_pairs, pair_phase


def dense_attention(
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
) -> torch.Tensor:
    """MDLMPE attention with q [B, Hq, L, d_h], k, v [B, Hkv, L, d_h] (RoPE-rotated), A, D [B, L, F]
    fp32, ``active_kv`` [Hkv] bool (None: all heads). Output [B, Hq, L, d_h] in q's dtype; the
    scores and the pair path run in fp32."""
    check_inputs("dense attention", q, k, v, A, D, phase, active_kv, key_valid, 1)
    num_heads, head_dim = q.shape[1], q.shape[-1]
    num_pairs = head_dim // 2
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    qf, kf, vf = q.float(), repeat_kv(k, num_heads).float(), repeat_kv(v, num_heads).float()
    delta = pair_phase(A, D, A, D, phase, tau_max, clip_kappa)  # [B, L, L, |M|]
    alpha, beta = (torch.cos(delta) - 1.0).unsqueeze(1), torch.sin(delta).unsqueeze(1)  # [B, 1, L, L, |M|]
    pairs = mdlmpe_pairs(num_pairs).to(q.device)
    q1, q2 = qf[..., pairs].unsqueeze(3), qf[..., pairs + num_pairs].unsqueeze(3)  # [B, Hq, L, 1, |M|]
    k1, k2 = kf[..., pairs].unsqueeze(2), kf[..., pairs + num_pairs].unsqueeze(2)  # [B, Hq, 1, L, |M|]
    # (q1 k1 + q2 k2) and (q2 k1 - q1 k2) of every (head, i, j, m), weighted and summed over m.
    correction = (alpha * (q1 * k1 + q2 * k2) + beta * (q2 * k1 - q1 * k2)).sum(-1)  # [B, Hq, L, L]
    if active_kv is not None:
        heads = query_head_mask(active_kv.to(q.device), num_heads).float()  # [Hq]
        correction = correction * heads[:, None, None]
    scores = (qf @ kf.transpose(-1, -2) + correction) * scale  # [B, Hq, L, L]
    bias = key_padding_bias(key_valid)
    if bias is not None:
        scores = scores + bias
    return (torch.softmax(scores, dim=-1) @ vf).to(q.dtype)
