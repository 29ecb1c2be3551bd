"""Pieces shared by every attention path: input checks, GQA expansion, the key-padding bias, plain
RoPE SDPA and SDPA with the ALiBi bias.

Conventions (all paths): q [B, Hq, L, d_h] and k, v [B, Hkv, L, d_h] are already RoPE-rotated;
``key_valid`` [B, L] is True where a key may be attended. Masked keys get the additive
``masked_key_bias(dtype)`` of the scores' dtype, finfo(dtype).min / 16: finite in that dtype
(finfo(float32).min cast to bf16 or fp16 would be -inf, and a row of -inf is NaN), and finite in
fp32 after the softmax scale and log2(e) that fused SDPA kernels multiply in before they subtract the
row max. A row with no valid key at all (a padding-only sequence) then degrades to a uniform average
instead of NaN or zeros. For rows with a valid key the value is immaterial (exp underflows to 0
either way), so outputs match LLaDA's finfo(float32).min convention bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

from mdlmpe_ds.pe.heads import query_head_mask
from mdlmpe_ds.pe.phase import PhaseParams, mdlmpe_pairs


def check_inputs(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    phase: PhaseParams,
    active_kv: torch.Tensor | None,
    key_valid: torch.Tensor | None,
    block_size: int,
) -> None:
    """Raise a ValueError naming attention path ``name`` and the first argument whose shape does
    not fit q [B, Hq, L, d_h], k, v [B, Hkv, L, d_h], A, D [B, L, F], the phase MLP of F pairs,
    ``active_kv`` [Hkv], ``key_valid`` [B, L], or a ``block_size`` below 1."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
            "expected q [B, Hq, L, d_h] and k, v [B, Hkv, L, d_h]"
        )
    batch, num_heads, length, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, length, head_dim) or num_heads % k.shape[1]:
        raise ValueError(
            f"{name}: k {tuple(k.shape)} does not fit q {tuple(q.shape)} (GQA needs Hq a multiple of Hkv)"
        )
    num_pairs = head_dim // 2
    if A.shape != (batch, length, num_pairs) or D.shape != A.shape:
        expected = (batch, length, num_pairs)
        raise ValueError(f"{name}: A {tuple(A.shape)}, D {tuple(D.shape)}; expected {expected}")
    if phase.w2.shape[0] != len(mdlmpe_pairs(num_pairs)) or phase.w1.shape[1] != num_pairs:
        raise ValueError(
            f"{name}: phase MLP w1 {tuple(phase.w1.shape)}, w2 {tuple(phase.w2.shape)} "
            f"do not fit F={num_pairs}"
        )
    check_active_kv(name, active_kv, k.shape[1])
    if key_valid is not None and key_valid.shape != (batch, length):
        raise ValueError(f"{name}: key_valid {tuple(key_valid.shape)}, expected {(batch, length)}")
    if block_size < 1:
        raise ValueError(f"{name}: block_size must be >= 1, got {block_size}")


def check_active_kv(name: str, active_kv: torch.Tensor | None, num_kv: int) -> None:
    """Raise a ValueError naming attention path ``name`` unless ``active_kv`` is None or a bool
    mask [Hkv] with one entry per KV head. A mask of another length, or of head indices, would map
    the heads wrongly without any error further down (query head h reads entry h // (Hq / Hkv))."""
    if active_kv is None:
        return
    if not isinstance(active_kv, torch.Tensor) or active_kv.shape != (num_kv,):
        shape = tuple(active_kv.shape) if isinstance(active_kv, torch.Tensor) else type(active_kv).__name__
        raise ValueError(
            f"{name}: active_kv {shape}, expected a bool mask of shape ({num_kv},), one per KV head"
        )
    if active_kv.dtype != torch.bool:
        raise ValueError(
            f"{name}: active_kv has dtype {active_kv.dtype}, expected torch.bool (a mask [Hkv], "
            "not head indices)"
        )


def repeat_kv(x: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """[B, Hkv, L, d] -> [B, Hq, L, d]: query head h reads KV head h // (Hq / Hkv)."""
    num_kv = x.shape[1]
    if num_query_heads % num_kv:
        raise ValueError(f"{num_query_heads} query heads are not a multiple of {num_kv} KV heads")
    rep = num_query_heads // num_kv
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


#: The masked-key bias is finfo(dtype).min divided by this: room for the factors (scale <= 1,
#: log2(e) ~ 1.44) a fused kernel applies before subtracting the row max, which turn finfo.min
#: itself into -inf in fp32 (on an H100, SDPA's memory-efficient kernel then returns zeros for a
#: row whose keys are all masked instead of the uniform average: tests/gpu/test_gpu_shapes.py).
MASKED_KEY_HEADROOM = 16.0


def masked_key_bias(dtype: torch.dtype) -> float:
    """The additive score bias of a masked key in ``dtype`` (see the module docstring)."""
    return torch.finfo(dtype).min / MASKED_KEY_HEADROOM


def key_padding_bias(
    key_valid: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """[B, L] bool -> additive bias [B, 1, 1, L] in ``dtype``: 0 where valid,
    ``masked_key_bias(dtype)`` where not."""
    if key_valid is None or bool(key_valid.all()):
        return None
    bias = torch.zeros(key_valid.shape, dtype=dtype, device=key_valid.device)
    bias.masked_fill_(~key_valid.bool(), masked_key_bias(dtype))
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


def route_active_heads(
    fused: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    active_kv: torch.Tensor | None,
    key_valid: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """MDLMPE attention of a fused path, ``fused(q, k, v)``, on the query heads whose KV head is
    active (``active_kv`` [Hkv] bool; None: all), plain RoPE SDPA on the others, back in head order.
    [B, Hq, L, d]. No active head: plain RoPE SDPA only (``fused`` is not called)."""
    if active_kv is None or bool(active_kv.all()):
        return fused(q, k, v)
    if not bool(active_kv.any()):
        return rope_attention(q, k, v, key_valid, scale)
    active_kv = active_kv.to(device=q.device, dtype=torch.bool)
    active_q = query_head_mask(active_kv, q.shape[1])
    kv_on, kv_off = active_kv.nonzero().flatten(), (~active_kv).nonzero().flatten()
    q_on, q_off = active_q.nonzero().flatten(), (~active_q).nonzero().flatten()
    out_on = fused(q[:, q_on], k[:, kv_on], v[:, kv_on])
    out_off = rope_attention(q[:, q_off], k[:, kv_off], v[:, kv_off], key_valid, scale)
    order = torch.argsort(torch.cat([q_on, q_off]))  # back to the original head order
    return torch.cat([out_on, out_off], dim=1)[:, order]


def alibi_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Bidirectional SDPA with the ALiBi bias of ``pe.alibi.alibi_bias`` (fp32 [B|1, H, L, L]).
    q [B, Hq, L, d], k/v [B, Hkv, L, d] (not rotated). [B, Hq, L, d].

    The fp32 bias is clamped to ``masked_key_bias(q.dtype)`` before the cast: finfo(float32).min
    on padded keys would become -inf in bf16 / fp16 (NaN rows)."""
    return grouped_sdpa(q, k, v, bias.clamp_min(masked_key_bias(q.dtype)).to(q.dtype), scale)
