"""Pair feature, angularisation and the per-layer phase MLP (paper Eqs. (23),
(24), (25), (26); docs/method.md "Pair feature", "Phase MLP", "Frequency split").

The functions take plain tensors so the attention paths (reference, blocked, Triton) can call
them on any block of (i, j) pairs and recompute them under activation checkpointing.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


def mdlmpe_pairs(num_pairs: int) -> torch.Tensor:
    """Indices of the rotary pairs that carry a phase residual: the odd f (docs/method.md "Frequency split").
    [F // 2]."""
    return torch.arange(1, num_pairs, 2)


def pair_ratio(a_i: torch.Tensor, d_i: torch.Tensor, a_j: torch.Tensor, d_j: torch.Tensor) -> torch.Tensor:
    """r_{ij,f} = (A_{i,f} + A_{j,f}) / (D_{i,f} + D_{j,f}) in [0, 1] (Eq. (23)).

    a_i, d_i: [..., Lq, F]; a_j, d_j: [..., Lk, F]  ->  [..., Lq, Lk, F] (fp32).
    """
    return (a_i.unsqueeze(-2) + a_j.unsqueeze(-3)) / (d_i.unsqueeze(-2) + d_j.unsqueeze(-3))


def angularize(r: torch.Tensor, clip_kappa: float) -> torch.Tensor:
    """s = arccos(clip(2r - 1, -1 + kappa, 1 - kappa)) - pi/2 (Eq. (24) with the clip of docs/method.md
    "Pair feature")."""
    return torch.acos((2.0 * r - 1.0).clamp(-1.0 + clip_kappa, 1.0 - clip_kappa)) - math.pi / 2


class PhaseParams(NamedTuple):
    """The four tensors of one layer's phase MLP: W1 [H, F], b1 [H], W2 [|M|, H], b2 [|M|]."""

    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor


def phase_residual(s: torch.Tensor, params: PhaseParams, tau_max: float) -> torch.Tensor:
    """delta = tau_max * tanh(W2 SiLU(W1 s + b1) + b2) (Eq. (25)), fp32. s [..., F] -> [..., |M|]."""
    hidden = F.silu(F.linear(s, params.w1.float(), params.b1.float()))
    return tau_max * torch.tanh(F.linear(hidden, params.w2.float(), params.b2.float()))


def pair_phase(
    a_i: torch.Tensor,
    d_i: torch.Tensor,
    a_j: torch.Tensor,
    d_j: torch.Tensor,
    params: PhaseParams,
    tau_max: float,
    clip_kappa: float,
) -> torch.Tensor:
    """delta_{ij,m} for every query row i and key column j: r -> s -> MLP. [..., Lq, Lk, |M|] fp32."""
    return phase_residual(angularize(pair_ratio(a_i, d_i, a_j, d_j), clip_kappa), params, tau_max)


class ZeroLinear(nn.Linear):
    """``nn.Linear`` whose own constructor zero-initialises it.

    Initialising inside the owner's constructor (not from a parent's) keeps the value under
    ``deepspeed.zero.Init``, which partitions each module as soon as its own ``__init__`` returns.
    """

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class PhaseMLP(nn.Module):
    """One attention layer's phase MLP: F -> H (SiLU) -> |M| = F/2, output zero-initialised.

    With W2 = b2 = 0 the residual is exactly 0 and the layer is plain RoPE attention. Each layer
    initialises itself in its own constructor (default ``nn.Linear`` init for W1, b1; zeros for
    W2, b2), so building under ``deepspeed.zero.Init`` gives the same initial values.
    """

    def __init__(self, num_pairs: int, hidden: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        if num_pairs < 2:
            raise ValueError(f"MDLMPE needs at least 2 rotary pairs (head_dim >= 4), got F={num_pairs}")
        self.num_pairs = num_pairs
        self.fc1 = nn.Linear(num_pairs, hidden, device=device)
        self.fc2 = ZeroLinear(hidden, len(mdlmpe_pairs(num_pairs)), device=device)

    def reset_parameters(self) -> None:
        """Re-initialise (e.g. on gathered ZeRO-3 parameters); construction needs no call to it."""
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()

    def params(self) -> PhaseParams:
        return PhaseParams(self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)
