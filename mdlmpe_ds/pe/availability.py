"""Availability state and token-centred summaries A, D (paper Eqs. (9), (21), (22),
(15), (16); Appendix D Eq. (28)).

Everything here is computed once per forward in fp32 and shared by all layers. The Gaussian
operator is never materialised as an L x L matrix: the row-normalised banded sum is a 1-D
convolution with the 2W+1 tap kernel, O(L * W * F).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch
import torch.nn.functional as F

from mdlmpe_ds.pe.rope import inverse_frequencies


def availability(
    input_ids: torch.Tensor, mask_token_id: int, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """b_t = 1[x_t != mask] * a_t and a_t (Eq. (9)), both fp32 [B, L].

    ``valid`` marks positions attention may see (False for padding, and for future blocks in
    blocked-context block diffusion). It is derived from the model input only, never from targets.
    """
    if valid is None:
        a = torch.ones(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    else:
        if valid.shape != input_ids.shape:
            raise ValueError(f"valid mask shape {tuple(valid.shape)} != input_ids {tuple(input_ids.shape)}")
        a = valid.to(torch.float32)
    b = (input_ids != mask_token_id).to(torch.float32) * a
    return b, a


@lru_cache(maxsize=64)
def _gaussian_taps_cpu(window: int, sigma: float) -> torch.Tensor:
    offsets = torch.arange(-window, window + 1, dtype=torch.float64)
    return torch.exp(-(offsets**2) / (2.0 * sigma**2)).to(torch.float32)


def gaussian_taps(window: int, sigma: float, device: torch.device | None = None) -> torch.Tensor:
    """Unnormalised truncated Gaussian exp(-d^2 / 2 sigma^2) for d = -W..W (Eq. (21)). [2W+1].

    Cached by (W, sigma): the only things it depends on.
    """
    return _gaussian_taps_cpu(int(window), float(sigma)).to(device)


@lru_cache(maxsize=64)
def _sine_basis_cpu(seq_len: int, head_dim: int, theta: float) -> torch.Tensor:
    t = torch.arange(seq_len, dtype=torch.float64)
    omega = inverse_frequencies(head_dim, theta).to(torch.float64)
    return (0.5 * (1.0 + torch.sin(torch.outer(t, omega)))).to(torch.float32)


def sine_basis(seq_len: int, head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """RoPE-aligned coordinate c_{t,f} = (1 + sin(t w_f)) / 2 in [0, 1] (Eq. (15)).

    Shape [L, F]; computed in fp64 then stored fp32 so large t * w_f keeps its phase. Cached by
    (L, d_h, theta).
    """
    return _sine_basis_cpu(int(seq_len), int(head_dim), float(theta)).to(device)


@contextmanager
def exact_fp32_convolution() -> Iterator[None]:
    """cuDNN convolutions in IEEE fp32 inside the block, whatever the global setting.

    PyTorch lets cuDNN run fp32 convolutions in TF32 on Ampere and later GPUs by default
    (``torch.backends.cudnn.conv.fp32_precision == "tf32"``): a 10-bit mantissa, ~1e-3 relative
    error in A and D, which docs/method.md "Precision" fixes in fp32. Only this module's banded sums are
    affected; the previous setting is restored on exit. A no-op on the CPU (no TF32 there).
    """
    conv = torch.backends.cudnn.conv
    saved = conv.fp32_precision
    conv.fp32_precision = "ieee"
    try:
        yield
    finally:
        conv.fp32_precision = saved


def _banded_sum(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """y_{., i} = sum_{|d| <= W} taps[d] * x_{., i+d}, zero outside [0, L). x: [N, L] -> [N, L]."""
    window = (taps.numel() - 1) // 2
    if window == 0:
        return x * taps[0]
    return _BandedSum.apply(x, taps)


class _BandedSum(torch.autograd.Function):
    """The banded sum as a 1-D cross-correlation (conv1d; the taps are symmetric, so it equals the
    convolution), forward and backward in exact fp32: autograd's own conv backward would run
    outside :func:`exact_fp32_convolution` and use TF32 (A, D carry gradients with the learned
    coordinate). The taps are constants (no gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(taps)
        return _correlate(x, taps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (taps,) = ctx.saved_tensors
        # d y_i / d x_j = taps[j - i + W]: the adjoint is the correlation with the reversed taps.
        return _correlate(grad, taps.flip(0)), None


def _correlate(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """y_i = sum_d taps[d] x_{i + d - W} with zero padding, in IEEE fp32. [N, L] -> [N, L]."""
    window = (taps.numel() - 1) // 2
    with exact_fp32_convolution():
        return F.conv1d(x.unsqueeze(1), taps.view(1, 1, -1), padding=window).squeeze(1)


def token_summaries(
    b: torch.Tensor, a: torch.Tensor, coordinate: torch.Tensor, taps: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A_{i,f} = sum_t w_{i,t} b_t c_{t,f}; D_{i,f} = sum_t w_{i,t} a_t c_{t,f} + eps.

    w_{i,t} = g(i - t) a_t / (sum_u g(i - u) a_u + eps) with g the truncated Gaussian taps
    (Eqs. (21), (22), (16)).

    b, a: [B, L] fp32; coordinate: [L, F] (or [B, L, F]); taps: [2W+1]. Returns A, D as [B, L, F]
    fp32. Cost O(B * L * W * F); no L x L tensor is formed.
    """
    batch, length = a.shape
    coordinate = coordinate.to(torch.float32)
    if coordinate.dim() == 2:
        coordinate = coordinate.unsqueeze(0).expand(batch, -1, -1)
    num_pairs = coordinate.shape[-1]
    taps = taps.to(device=a.device, dtype=torch.float32)
    # 1. Row mass of the window over valid positions: sum_u g(i-u) a_u.      [B, L]
    row_mass = _banded_sum(a, taps)
    # 2. Banded sums of b*c and a*c for every pair, as 2F independent rows.   [B, 2F, L]
    signals = torch.cat((b.unsqueeze(-1) * coordinate, a.unsqueeze(-1) * coordinate), dim=-1)
    sums = _banded_sum(signals.transpose(1, 2).reshape(batch * 2 * num_pairs, length), taps)
    sums = sums.view(batch, 2 * num_pairs, length).transpose(1, 2)  # [B, L, 2F]
    # 3. Row normalisation (Eq. (22)), then the eps floor of D.
    norm = (row_mass + eps).unsqueeze(-1)  # [B, L, 1]
    numer, denom = sums[..., :num_pairs] / norm, sums[..., num_pairs:] / norm
    return numer, denom + eps


def dense_weights(a: torch.Tensor, window: int, sigma: float, eps: float) -> torch.Tensor:
    """The row-normalised L x L matrix w_{i,t} of Eq. (22), materialised. [B, L, L].

    For tests and the analysis figures only; training uses :func:`token_summaries`.
    """
    length = a.shape[-1]
    pos = torch.arange(length, dtype=torch.float64, device=a.device)
    dist = pos[:, None] - pos[None, :]
    kernel = torch.exp(-(dist**2) / (2.0 * sigma**2)) * (dist.abs() <= window)
    raw = kernel.to(torch.float32).unsqueeze(0) * a.unsqueeze(1)  # [B, L, L]
    return raw / (raw.sum(-1, keepdim=True) + eps)
