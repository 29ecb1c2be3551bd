"""Pieces shared by every attention path: GQA expansion, the key-padding bias, plain RoPE SDPA.

Conventions (all paths): q [B, Hq, L, d_h] and k, v [B, Hkv, L, d_h] are already RoPE-rotated;
``key_valid`` [B, L] is True where a key may be attended. Masked keys get an additive
finfo(float32).min (LLaDA's convention), so a row with no valid key at all (a padding-only
sequence) degrades to a uniform average instead of NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def repeat_kv(x: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """[B, Hkv, L, d] -> [B, Hq, L, d]: query head h reads KV head h // (Hq / Hkv)."""
    num_kv = x.shape[1]
    if num_query_heads % num_kv:
        raise ValueError(f"{num_query_heads} query heads are not a multiple of {num_kv} KV heads")
    rep = num_query_heads // num_kv
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def key_padding_bias(
    key_valid: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """[B, L] bool -> additive bias [B, 1, 1, L] (0 where valid, finfo(float32).min where not)."""
    if key_valid is None or bool(key_valid.all()):
        return None
    bias = torch.zeros(key_valid.shape, dtype=torch.float32, device=key_valid.device)
    bias.masked_fill_(~key_valid.bool(), torch.finfo(torch.float32).min)
    return bias[:, None, None, :].to(dtype)


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain bidirectional attention on rotated q, k (the backbones' own path). [B, Hq, L, d_h]."""
    num_heads = q.shape[1]
    return F.scaled_dot_product_attention(
        q,
        repeat_kv(k, num_heads),
        repeat_kv(v, num_heads),
        attn_mask=key_padding_bias(key_valid, q.dtype),
        is_causal=False,
        scale=scale,
    )
