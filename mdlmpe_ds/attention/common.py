"""Pieces shared by every attention path: GQA expansion, the key-padding bias, plain RoPE SDPA.

Conventions (all paths): q [B, Hq, L, d_h] and k, v [B, Hkv, L, d_h] are already RoPE-rotated;
``key_valid`` [B, L] is True where a key may be attended. Masked keys get an additive
finfo(dtype).min of the scores' dtype (LLaDA's finfo(float32).min in fp32; finfo(float32).min cast
to bf16 or fp16 would be -inf, and a row of -inf is NaN), so a row with no valid key at all (a
padding-only sequence) degrades to a uniform average instead of NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion


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
    """[B, L] bool -> additive bias [B, 1, 1, L] in ``dtype``: 0 where valid, finfo(dtype).min
    where not (finite in every dtype; finfo(float32).min itself rounds to -inf in bf16 and fp16)."""
    if key_valid is None or bool(key_valid.all()):
        return None
    bias = torch.zeros(key_valid.shape, dtype=dtype, device=key_valid.device)
    bias.masked_fill_(~key_valid.bool(), torch.finfo(dtype).min)
    return bias[:, None, None, :]


# SDPA reads grouped K/V itself (``enable_gqa``, no repeated copy) since torch 2.5.
SDPA_NATIVE_GQA = TorchVersion(torch.__version__) >= "2.5"


def grouped_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Bidirectional SDPA with q [B, Hq, L, d], k, v [B, Hkv, L, d]: query head h reads KV head
    h // (Hq / Hkv), through SDPA's native GQA where available (else K, V repeated). [B, Hq, L, d]."""
    num_heads, num_kv = q.shape[1], k.shape[1]
    if num_heads % num_kv:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv} KV heads")
    if SDPA_NATIVE_GQA and num_kv != num_heads:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=False, scale=scale, enable_gqa=True
        )
    return F.scaled_dot_product_attention(
        q,
        repeat_kv(k, num_heads),
        repeat_kv(v, num_heads),
        attn_mask=attn_mask,
        is_causal=False,
        scale=scale,
    )


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain bidirectional attention on rotated q, k (the backbones' own path). [B, Hq, L, d_h].

    GQA (Hkv < Hq) goes through SDPA's native ``enable_gqa`` where this torch has it, so K and V
    are never repeated in memory; the numbers are those of the repeated form. A sequence with no
    valid key gets zero queries: its scores are then all equal whatever precision the kernel adds
    the (finite, 16-bit) padding bias in, so its rows are the uniform average of V, as in fp32.
    """
    bias = key_padding_bias(key_valid, q.dtype)
    if bias is not None:
        has_key = key_valid.bool().any(dim=-1)  # [B]
        if not bool(has_key.all()):
            q = q * has_key[:, None, None, None].to(q.dtype)
    return grouped_sdpa(q, k, v, bias, scale)
