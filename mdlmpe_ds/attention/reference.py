"""Reference MDLMPE attention: the spec, written as the paper states it (Eqs. (7),
(26)). It materialises the L x L x F pair tensor and rotates every key pair by its own
2 x 2 matrix R(delta_ij,f); use it only in tests and on small inputs. Fast paths must match it.
"""

from __future__ import annotations

import math

import torch

from mdlmpe_ds.attention.common import check_inputs, key_padding_bias, repeat_kv
from mdlmpe_ds.pe.heads import query_head_mask
from mdlmpe_ds.pe.phase import PhaseParams, mdlmpe_pairs, pair_phase


def reference_attention(
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
    """S_ij = (1/sqrt(d_h)) [sum_{f not in M} q_f . k_f + sum_{f in M} q_f^T R(delta_ij,f) k_f].

    q [B, Hq, L, d_h], k/v [B, Hkv, L, d_h] (RoPE-rotated); A, D [B, L, F] fp32; ``active_kv``
    [Hkv] bool (None: all heads active). Output [B, Hq, L, d_h] in q's dtype. Everything in fp32.
    """
    check_inputs("reference attention", q, k, v, A, D, phase, active_kv, key_valid, 1)
    batch, num_heads, length, head_dim = q.shape
    num_pairs = head_dim // 2
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    qf, kf, vf = q.float(), repeat_kv(k, num_heads).float(), repeat_kv(v, num_heads).float()
    # 1. Pair phases delta_{ij,m} for every (i, j) and MDLMPE pair m.          [B, L, L, |M|]
    delta = pair_phase(A, D, A, D, phase, tau_max, clip_kappa)
    # 2. Full per-pair angle offset: zero on RoPE pairs and on inactive heads.  [B, Hq, L, L, F]
    offset = torch.zeros(batch, num_heads, length, length, num_pairs, dtype=torch.float32, device=q.device)
    if active_kv is None:
        active_kv = torch.ones(k.shape[1], dtype=torch.bool)
    heads = query_head_mask(active_kv.cpu(), num_heads).nonzero().flatten().tolist()
    for h in heads:
        offset[:, h, :, :, mdlmpe_pairs(num_pairs)] = delta
    # 3. Rotate each key pair (k1, k2) = (k_f, k_{f+F}) by R(offset) and dot with the query pair.
    q1, q2 = qf[..., :num_pairs], qf[..., num_pairs:]  # [B, Hq, L, F]
    k1, k2 = kf[..., :num_pairs].unsqueeze(2), kf[..., num_pairs:].unsqueeze(2)  # [B, Hq, 1, L, F]
    cos, sin = offset.cos(), offset.sin()
    rk1 = cos * k1 - sin * k2  # R(delta) = [[cos, -sin], [sin, cos]]
    rk2 = sin * k1 + cos * k2
    scores = (q1.unsqueeze(3) * rk1 + q2.unsqueeze(3) * rk2).sum(-1) * scale  # [B, Hq, L, L]
    bias = key_padding_bias(key_valid)
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1)
    return (probs @ vf).to(q.dtype)
