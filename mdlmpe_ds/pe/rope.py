"""Rotary position embedding in the LLaDA / Dream layout.

Rotary pair f is the two dimensions (f, f + F) of a head ("rotate_half", docs/method.md "Pair layout"),
rotated by angle t * w_f with w_f = theta^(-2f / d_h), t the 0-based position.
"""

from __future__ import annotations

import torch


def inverse_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """w_f = theta^(-2f/d_h), f = 0..F-1, in fp32. Shape [F]."""
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponent)


def rotary_angles(
    seq_len: int, head_dim: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(t w_f), sin(t w_f) for t = 0..L-1, fp32. Shapes [L, F]."""
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inverse_frequencies(head_dim, theta, device))  # [L, F]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    """Rotate each pair (x_f, x_{f+F}) of ``x`` [..., L, d_h] by the angle whose cos/sin are [L, F].

    ``fp32=True`` rotates in fp32 and casts back (LLaDA's ``rope_full_precision``); ``False`` casts
    cos/sin to the activation dtype first and multiplies there (Dream / HF Qwen2).
    """
    half = x.shape[-1] // 2
    dtype = x.dtype
    if fp32:
        x = x.float()
    else:
        cos, sin = cos.to(dtype), sin.to(dtype)
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(dtype)
