"""Region 1 of one query block of the blocked MDLMPE attention: the pair coefficients alpha, beta
[B, C, |M|, L] from the block's rows of A, D through Eqs. (4)-(5) and the phase MLP (Eq. (25)),
shared by every head, and their vector-Jacobian product for backward.

Apart from region 2 (blocked_scores.py) because it is head-independent maths with its own
precision concerns (the arcsin form of the angle, the tanh that inductor vectorises) and is
compiled as a graph of its own: fused with region 2, inductor recomputes its sin/tanh chain once
per head (blocked_math.py, which runs both per block). All maths in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _tanh(z: torch.Tensor) -> torch.Tensor:
    """tanh(z). Compiled as 1 - 2 / (exp(2z) + 1): inductor vectorises exp well and its tanh ~2.6x
    slower; same limits (+-1, no NaN: exp overflows to inf), |difference| < 1e-7 (fp32 rounding)."""
    if torch.compiler.is_compiling():
        return 1.0 - 2.0 / (torch.exp(2.0 * z) + 1.0)
    return torch.tanh(z)


def _in_place(t: torch.Tensor) -> bool:
    """Whether a fresh intermediate ``t`` may be overwritten: not when autograd records it (A, D
    differentiable). In place saves eager passes and allocations; compiled, it is the same graph."""
    return not (t.requires_grad and torch.is_grad_enabled())


def _phase_mlp_inputs(
    a_rows: torch.Tensor, d_rows: torch.Tensor, a_cols: torch.Tensor, d_cols: torch.Tensor, clip_kappa: float
) -> torch.Tensor:
    """arcsin(x) [B, C, F, L] with x = clip(2 r_ij,f - 1) (Eqs. (4)-(5)), for the block's rows a_rows,
    d_rows [B, C, F] and every key a_cols, d_cols [B, F, L] (A, D transposed, contiguous: the key
    index is the fast axis).

    The angle s = arccos(x) - pi/2 is -arcsin(x): the same function with the same derivative,
    cheaper and free of the cancellation near x = 0; the sign is folded into W1 by the callers.
    Without gradients for A, D, x = (e_i + e_j) / (D_i + D_j) with e = 2A - D (three passes over
    [C, F, L] instead of five); with them, 2r - 1 as written (arcsin is steep next to the clip, so
    the reference's rounding is kept there).
    """
    denom = d_rows.unsqueeze(-1) + d_cols.unsqueeze(1)  # [B, C, F, L]
    low, high = -1.0 + clip_kappa, 1.0 - clip_kappa
    if not _in_place(denom) or not _in_place(a_rows) or not _in_place(a_cols):
        r = (a_rows.unsqueeze(-1) + a_cols.unsqueeze(1)) / denom
        return torch.asin((2.0 * r - 1.0).clamp(low, high))
    x = ((2.0 * a_rows - d_rows).unsqueeze(-1) + (2.0 * a_cols - d_cols).unsqueeze(1)).div_(denom)
    return x.clamp_(low, high).asin_()


def _rowwise_linear(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """weight [O, I] applied to every query row of x [B, C, I, L] -> [B, C, O, L], as one bmm.

    Region 1 stays feature-major throughout (s, u, z, alpha, beta all [B, C, *, L], the layout
    region 2 reads). Written as a matmul over a trailing feature axis, inductor transposes every
    [C L, *] operand to and from that layout; as an explicit bmm over the B C rows nothing is
    copied.
    """
    rows = x.shape[0] * x.shape[1]
    y = torch.bmm(weight.expand(rows, *weight.shape), x.flatten(0, 1)).view(*x.shape[:2], weight.shape[0], -1)
    if bias is None:
        return y
    return y.add_(bias.unsqueeze(-1)) if _in_place(y) else y + bias.unsqueeze(-1)


def _alpha_beta(z: torch.Tensor, tau_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha = -2 sin^2(delta/2) (cos(delta) - 1 without cancellation), beta = sin(delta), with
    delta = tau_max tanh(z); z, alpha, beta [B, C, |M|, L]."""
    delta = tau_max * _tanh(z)
    beta = torch.sin(delta)
    if _in_place(delta):
        return delta.mul_(0.5).sin_().square_().mul_(-2.0), beta
    half = torch.sin(0.5 * delta)
    return -2.0 * half * half, beta


def coefficients(
    a_rows: torch.Tensor,
    d_rows: torch.Tensor,
    a_cols: torch.Tensor,
    d_cols: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    tau_max: float,
    clip_kappa: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Region 1: alpha, beta [B, C, |M|, L] of one query block, shared by every head.

    a_rows, d_rows [B, C, F] (the block's rows of A, D); a_cols, d_cols [B, F, L] (A, D
    transposed, contiguous); w1 [H, F], b1 [H], w2 [|M|, H], b2 [|M|]. Compiled on its own, the
    intermediates are not graph outputs, so inductor fuses them away instead of writing them out
    as :func:`coefficients_for_backward` must."""
    alpha, beta, *_ = coefficients_for_backward(
        a_rows, d_rows, a_cols, d_cols, w1, b1, w2, b2, tau_max, clip_kappa
    )
    return alpha, beta


def coefficients_for_backward(
    a_rows: torch.Tensor,
    d_rows: torch.Tensor,
    a_cols: torch.Tensor,
    d_cols: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    tau_max: float,
    clip_kappa: float,
) -> tuple[torch.Tensor, ...]:
    """alpha, beta and what :func:`coefficients_vjp` needs: arcsin(x) = -s [B, C, F, L] and the
    pre-activations u [B, C, H, L], z [B, C, |M|, L] (Eq. (25): u = W1 s + b1)."""
    asin_x = _phase_mlp_inputs(a_rows, d_rows, a_cols, d_cols, clip_kappa)  # [B, C, F, L]
    u = _rowwise_linear(-w1, asin_x, b1)
    z = _rowwise_linear(w2, F.silu(u), b2)
    return (*_alpha_beta(z, tau_max), asin_x, u, z)


def coefficients_vjp(
    asin_x: torch.Tensor,
    u: torch.Tensor,
    z: torch.Tensor,
    w2: torch.Tensor,
    tau_max: float,
    grad_alpha: torch.Tensor,
    grad_beta: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Gradients of the phase-MLP weights (w1, b1, w2, b2) from those of alpha, beta [B, C, |M|, L].

    Hand-derived: d alpha/d delta = -sin(delta), d beta/d delta = cos(delta), tanh' = 1 - t^2,
    SiLU'(u) = g (1 + u (1 - g)) with g = sigmoid(u). Cheaper than autograd's forward-with-saves
    plus backward (fewer [C, *, L] intermediates written and read back). Runs without autograd,
    so every intermediate is updated in place.
    """
    t = _tanh(z)  # [B, C, |M|, L]
    delta = tau_max * t
    grad_z = torch.cos(delta).mul_(grad_beta).sub_(delta.sin_().mul_(grad_alpha))
    grad_z.mul_(t.square_().neg_().add_(1.0)).mul_(tau_max)
    del t, delta
    gate = torch.sigmoid(u)  # [B, C, H, L]
    hidden = u * gate  # SiLU(u)
    slope = (1.0 - gate).mul_(u).add_(1.0).mul_(gate)
    grad_u = _rowwise_linear(w2.t(), grad_z, None).mul_(slope)
    # Weight gradients: per-row [O, L] @ [L, I] products summed over the B C rows; u = -W1 arcsin(x) + b1.
    grad_w1 = (
        torch.bmm(grad_u.flatten(0, 1), asin_x.flatten(0, 1).transpose(1, 2)).sum(dim=0).neg_()
    )  # [H, F]
    grad_w2 = torch.bmm(grad_z.flatten(0, 1), hidden.flatten(0, 1).transpose(1, 2)).sum(dim=0)  # [|M|, H]
    return grad_w1, grad_u.sum(dim=(0, 1, 3)), grad_w2, grad_z.sum(dim=(0, 1, 3))


__all__ = ["coefficients", "coefficients_for_backward", "coefficients_vjp"]
