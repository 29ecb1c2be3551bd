"""One query block of the blocked MDLMPE attention: its autograd Function and the pieces it runs.

One :class:`BlockAttention` call per query block of C rows. Its forward keeps for backward only
the block's inputs (views of q, k, v, A, D and the phase-MLP weights), its output and the
softmax statistics of its scores: O(C d_h) per block, like a flash-attention block. Its backward
recomputes the pair coefficients alpha, beta and the scores from those and writes every gradient
with hand-derived formulas:

- region 1 (blocked_coefficients.py: ``coefficients``, ``coefficients_vjp``): alpha, beta
  [B, C, |M|, L] from the block's rows of A, D through Eqs. (4)-(5) and the phase MLP (Eq. (25)),
  shared by every head;
- region 2 (blocked_scores.py: ``attend_forward``, ``attend_backward``): the scores q.k + E,
  softmax and PV for every active head, and their gradients.

The pieces are plain torch functions. They run as they are (:data:`EAGER`) or each wrapped by
torch.compile (:func:`compiled_pieces`, over :data:`SUMMED`); the numbers are the same. Region 1
is one code for both. Region 2's sums over the MDLMPE pairs have two layouts, chosen with the
pieces (``per_head_sums``, see ``blocked_scores._correction``): eager, rotated keys per KV head
and batched matmuls (few large kernels); compiled, one broadcast-multiply-sum per query head,
which inductor fuses into one loop nest. Either layout run the other way is the slower one on the
CPU (measured figures: docs/method.md "Cost and precision"), so both stay. All maths in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, wraps
from typing import NamedTuple

import torch

from mdlmpe_ds.attention.blocked_coefficients import coefficients, coefficients_for_backward, coefficients_vjp
from mdlmpe_ds.attention.blocked_scores import attend_backward, attend_forward


class Pieces(NamedTuple):
    """The five functions one block runs: the plain ones (:data:`EAGER`) or compiled ones."""

    coefficients: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    coefficients_for_backward: Callable[..., tuple[torch.Tensor, ...]]
    coefficients_vjp: Callable[..., tuple[torch.Tensor, ...]]
    attend_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    attend_backward: Callable[..., tuple[torch.Tensor, ...]]


def _attend_forward_summed(*args: torch.Tensor | float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return attend_forward(*args, per_head_sums=True)


def _attend_backward_summed(*args: torch.Tensor | float | None) -> tuple[torch.Tensor, ...]:
    return attend_backward(*args, per_head_sums=True)


#: The pieces as plain functions, eager layout.
EAGER = Pieces(coefficients, coefficients_for_backward, coefficients_vjp, attend_forward, attend_backward)
#: The pieces torch.compile wraps: region 2 in its per-head-sums layout (see blocked_scores).
SUMMED = Pieces(
    coefficients, coefficients_for_backward, coefficients_vjp, _attend_forward_summed, _attend_backward_summed
)

# Shapes each compiled piece may be traced for before dynamo stops compiling it (and runs it
# eagerly, same numbers, slower): every (batch, active heads, sequence width) is one. Dynamo's
# default of 8 is used up by a training run's head schedule alone (one count per activated KV head)
# times a few batch widths, so the pieces get a budget of their own (only while they run).
GRAPH_BUDGET = 64


def _compiled(fn: Callable) -> Callable:
    """fn through torch.compile (shape-specialised), with GRAPH_BUDGET graphs allowed."""
    graph = torch.compile(fn, dynamic=False)

    @wraps(fn)
    def call(*args):
        with torch._dynamo.config.patch(recompile_limit=GRAPH_BUDGET):
            return graph(*args)

    return call


@lru_cache(maxsize=1)
def compiled_pieces() -> Pieces:
    """:data:`SUMMED`, each piece wrapped by torch.compile; built on first use, never at import.
    Region 1 and region 2 are separate graphs: fused, inductor recomputes the sin/tanh chain of
    region 1 once per head."""
    return Pieces(*(_compiled(fn) for fn in SUMMED))


class BlockAttention(torch.autograd.Function):
    """One query block: forward saves inputs, output and softmax statistics; backward recomputes.

    Inputs: the :class:`Pieces` to run; q_rows [B, Ha, G, C, d_h]; k, v [B, Ha, L, d_h]; k1t, k2t
    [B, Ha, |M|, L]; a_rows, d_rows [B, C, F]; a_cols, d_cols [B, F, L] (contiguous); w1, b1, w2,
    b2; bias [B, 1, 1, 1, L] or None; then scale, tau_max, clip_kappa (floats). All fp32.
    Output [B, Ha, G, C, d_h].
    """

    @staticmethod
    def forward(ctx, pieces, q_rows, k, v, k1t, k2t, *region1_bias_consts):
        *region1, bias, scale, tau_max, clip_kappa = region1_bias_consts
        consts = (scale, tau_max, clip_kappa)
        alpha, beta = pieces.coefficients(*region1, tau_max, clip_kappa)
        out, stats = pieces.attend_forward(q_rows, k, v, k1t, k2t, alpha, beta, bias, scale)
        ctx.save_for_backward(q_rows, k, v, k1t, k2t, *region1, bias, out, stats)
        ctx.pieces, ctx.consts = pieces, consts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_rows, k, v, k1t, k2t, *region1, bias, out, stats = ctx.saved_tensors
        scale, tau_max, clip_kappa = ctx.consts
        pieces = ctx.pieces
        needs = ctx.needs_input_grad[1:]  # without the pieces argument
        needs_ad, needs_weights = any(needs[5:9]), any(needs[9:13])
        # 1. Recompute alpha, beta. A, D need gradients only with a learned coordinate: then
        # autograd differentiates region 1; otherwise the hand-derived vjp (cheaper) does.
        leaves = saved = None
        if needs_ad:
            leaves = [t.detach().requires_grad_(need) for t, need in zip(region1, needs[5:13])]
            with torch.enable_grad():
                alpha, beta = pieces.coefficients(*leaves, tau_max, clip_kappa)
        elif needs_weights:
            alpha, beta, *saved = pieces.coefficients_for_backward(*region1, tau_max, clip_kappa)
        else:
            alpha, beta = pieces.coefficients(*region1, tau_max, clip_kappa)
        # 2. Region 2 backward.
        grads = pieces.attend_backward(
            q_rows,
            k,
            v,
            k1t,
            k2t,
            alpha.detach(),
            beta.detach(),
            bias,
            scale,
            out,
            stats,
            grad_out.contiguous(),
        )
        grad_q, grad_k, grad_v, grad_k1, grad_k2, grad_alpha, grad_beta, grad_q1, grad_q2 = grads
        num_pairs = q_rows.shape[-1] // 2
        grad_q[..., 1:num_pairs:2] += grad_q1
        grad_q[..., num_pairs + 1 :: 2] += grad_q2
        # 3. Region 1 backward into A, D and / or the phase-MLP weights.
        grads_region1 = [None] * 8
        if leaves is not None:
            wanted = [t for t in leaves if t.requires_grad]
            found = iter(torch.autograd.grad((alpha, beta), wanted, (grad_alpha, grad_beta)))
            grads_region1 = [next(found) if t.requires_grad else None for t in leaves]
        elif saved is not None:
            asin_x, u, z = saved
            grads_region1[4:] = pieces.coefficients_vjp(
                asin_x, u, z, region1[6], tau_max, grad_alpha, grad_beta
            )
        return None, grad_q, grad_k, grad_v, grad_k1, grad_k2, *grads_region1, None, None, None, None


def block_attention(
    pieces: Pieces,
    q_rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k1t: torch.Tensor,
    k2t: torch.Tensor,
    a_rows: torch.Tensor,
    d_rows: torch.Tensor,
    a_cols: torch.Tensor,
    d_cols: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    tau_max: float,
    clip_kappa: float,
) -> torch.Tensor:
    """One query block through ``pieces``, [B, Ha, G, C, d_h] (shapes as in
    :class:`BlockAttention`); without autograd only the two forward pieces run."""
    region1 = (a_rows, d_rows, a_cols, d_cols, w1, b1, w2, b2)
    if torch.is_grad_enabled():
        consts = (scale, tau_max, clip_kappa)
        return BlockAttention.apply(pieces, q_rows, k, v, k1t, k2t, *region1, bias, *consts)
    alpha, beta = pieces.coefficients(*region1, tau_max, clip_kappa)
    return pieces.attend_forward(q_rows, k, v, k1t, k2t, alpha, beta, bias, scale)[0]
