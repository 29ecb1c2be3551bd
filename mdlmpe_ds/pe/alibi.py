"""ALiBi for a bidirectional (non-causal) encoder: the paper's from-scratch baseline (Press et al. 2022).

Head h adds -m_h * |i - j| to the attention score of query i and key j, with the geometric slopes
m_h = 2^(-8 (h+1) / H) for a power-of-two head count H, and for other H the standard interleaving:
the slopes of the nearest lower power of two n, followed by every other slope of 2n. No rotary
embedding is applied when ALiBi is selected. The attention that adds this bias is
:func:`mdlmpe_ds.attention.common.alibi_attention`.
"""

from __future__ import annotations

import torch


def _power_of_two_slopes(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (h + 1) for h in range(n)]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """m_h for h = 0..H-1, fp32 [H]."""
    if num_heads < 1:
        raise ValueError(f"ALiBi needs at least one head, got {num_heads}")
    lower = 1 << (num_heads.bit_length() - 1)
    slopes = _power_of_two_slopes(lower)
    if lower != num_heads:
        slopes += _power_of_two_slopes(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(
    seq_len: int, num_heads: int, key_valid: torch.Tensor | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Additive score bias -m_h |i - j|, plus finfo(float32).min on invalid keys. fp32 [B|1, H, L, L]."""
    pos = torch.arange(seq_len, dtype=torch.float32, device=device)
    distance = (pos[None, :] - pos[:, None]).abs()  # [L, L]
    bias = -alibi_slopes(num_heads).to(device)[:, None, None] * distance  # [H, L, L]
    bias = bias.unsqueeze(0)  # [1, H, L, L]
    if key_valid is not None and not bool(key_valid.all()):
        invalid = ~key_valid.bool()[:, None, None, :]  # [B, 1, 1, L]
        bias = bias.masked_fill(invalid, torch.finfo(torch.float32).min)
    return bias
