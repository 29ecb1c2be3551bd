"""Which KV heads carry the phase residual: the SFT head schedule (paper Eq. (27)) and
the nested, evenly spread activation order (docs/method.md "Heads", "Head schedule").
"""

from __future__ import annotations

import math

import torch


def head_fraction(update: int, total_updates: int) -> float:
    """alpha(n): 0 for n/N < 0.1, (n/N - 0.1)/0.8 up to 0.9, then 1 (Eq. (27))."""
    if total_updates <= 0:
        raise ValueError(f"total_updates must be positive, got {total_updates}")
    progress = update / total_updates
    if progress < 0.1:
        return 0.0
    if progress >= 0.9:
        return 1.0
    return (progress - 0.1) / 0.8


def active_head_count(fraction: float, num_kv_heads: int) -> int:
    """h = round(alpha * H_kv), halves rounded up so the count never depends on banker's rounding."""
    return math.floor(fraction * num_kv_heads + 0.5)


def activation_order(num_kv_heads: int) -> list[int]:
    """Fixed order in which KV heads switch on: bit-reversal over the next power of two, dropping
    indices >= H_kv. For 8 heads: 0, 4, 2, 6, 1, 5, 3, 7. Every prefix is spread over [0, H_kv - 1]
    and the active set of h heads is its first h entries, so a head never switches off again.
    """
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
    bits = max(1, (num_kv_heads - 1).bit_length())
    order = [int(f"{i:0{bits}b}"[::-1], 2) for i in range(1 << bits)]
    return [h for h in order if h < num_kv_heads]


def active_kv_heads(count: int, num_kv_heads: int) -> torch.Tensor:
    """Boolean mask [H_kv] with the first ``count`` heads of :func:`activation_order` set."""
    if not 0 <= count <= num_kv_heads:
        raise ValueError(f"active head count {count} outside [0, {num_kv_heads}]")
    mask = torch.zeros(num_kv_heads, dtype=torch.bool)
    mask[activation_order(num_kv_heads)[:count]] = True
    return mask


def scheduled_kv_heads(update: int, total_updates: int, num_kv_heads: int) -> torch.Tensor:
    """Active-head mask at optimizer update n of N under the SFT schedule. [H_kv] bool."""
    return active_kv_heads(
        active_head_count(head_fraction(update, total_updates), num_kv_heads), num_kv_heads
    )


def query_head_mask(kv_mask: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """Expand a KV-head mask to query heads: query head h follows KV head h // (Hq / Hkv) (GQA). [Hq]."""
    num_kv = kv_mask.numel()
    if num_query_heads % num_kv:
        raise ValueError(f"{num_query_heads} query heads are not a multiple of {num_kv} KV heads")
    return kv_mask.repeat_interleave(num_query_heads // num_kv)
