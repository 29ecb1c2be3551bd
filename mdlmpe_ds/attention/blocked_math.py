"""The maths of one query block of the blocked MDLMPE attention, and its autograd Function.

One :class:`BlockAttention` call per query block of C rows. Its forward keeps for backward only
the block's inputs (views of q, k, v, A, D and the phase-MLP weights), its output and the
softmax statistics of its scores: O(C d_h) per block, like a flash-attention block. Its backward
recomputes the pair coefficients alpha, beta and the scores from those and writes every gradient
with hand-derived formulas:

- region 1 (:func:`coefficients`, :func:`coefficients_vjp`): alpha, beta [B, C, |M|, L] from the
  block's rows of A, D through Eqs. (4)-(5) and the phase MLP (Eq. (25)), shared by every head;
- region 2 (:func:`attend_forward`, :func:`attend_backward`): the scores q.k + E, softmax and PV
  for every active head, and their gradients.

The pieces are plain torch functions. They run as they are (:data:`EAGER`) or each wrapped by
torch.compile (:func:`compiled_pieces`, over :data:`SUMMED`); the numbers are the same. Region 1
is one code for both. Region 2's sums over the MDLMPE pairs have two layouts, chosen with the
pieces (``per_head_sums``, see :func:`_correction`): eager, rotated keys per KV head and batched
matmuls (few large kernels); compiled, one broadcast-multiply-sum per query head, which inductor
fuses into one loop nest. Either layout run the other way is the slower one on the CPU (measured
figures: docs/method.md "Cost and precision"), so both stay. All maths in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, wraps
from typing import NamedTuple

import torch
import torch.nn.functional as F

# Keys per chunk in the compiled layout's k-gradient reduction (see _key_pair_grads_summed); 0 or
# a non-divisor of L: one chunk.
KEY_CHUNK = 64


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


def _pair_rows(q_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q1, q2 [B, Ha, G, C, |M|]: the query dims f and f + F of the MDLMPE pairs (odd f), as
    strided slices (an index tensor would make inductor emit indirect loads)."""
    num_pairs = q_rows.shape[-1] // 2
    return q_rows[..., 1:num_pairs:2], q_rows[..., num_pairs + 1 :: 2]


def _correction(
    q_rows: torch.Tensor,
    k1t: torch.Tensor,
    k2t: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    per_head_sums: bool,
) -> torch.Tensor:
    """E = sum_m alpha (q1 k1 + q2 k2) + beta (q2 k1 - q1 k2) (q^T R(delta) k minus the plain term),
    [B, Ha, G, C, L]. q_rows [B, Ha, G, C, d_h]; k1t, k2t [B, Ha, |M|, L]; alpha, beta [B, C, |M|, L].

    Two layouts of one sum, for the two ways the pieces run:
    - ``per_head_sums`` (compiled): one broadcast-multiply-sum per query head, stacked; inductor
      fuses them into one loop nest that loads each alpha, beta element once for all heads;
    - otherwise (eager, one kernel per op): per KV head the rotated-minus-plain keys
      alpha (k1, k2) + beta (-k2, k1) [B, C, 2|M|, L] are formed once for the G query heads of the
      group, and E is one batched matmul with the query pairs.
    """
    q1, q2 = _pair_rows(q_rows)  # [B, Ha, G, C, |M|]
    batch, num_kv, group, rows, num_mdl = q1.shape
    if per_head_sums:
        q1, q2 = q1.unsqueeze(-1), q2.unsqueeze(-1)  # [B, Ha, G, C, |M|, 1]
        k1, k2 = k1t.unsqueeze(2), k2t.unsqueeze(2)  # [B, Ha, 1, |M|, L]
        heads = [
            (
                alpha * (q1[:, h, g] * k1[:, h] + q2[:, h, g] * k2[:, h])
                + beta * (q2[:, h, g] * k1[:, h] - q1[:, h, g] * k2[:, h])
            ).sum(dim=-2)
            for h in range(num_kv)
            for g in range(group)
        ]
        return torch.stack(heads, dim=1).unflatten(1, (num_kv, group))
    qp = torch.cat((q1, q2), dim=-1).transpose(2, 3)  # [B, Ha, C, G, 2|M|]
    ka, kb = torch.stack((k1t, k2t), dim=2), torch.stack((-k2t, k1t), dim=2)  # [B, Ha, 2, |M|, L]
    a, b = alpha.unsqueeze(2), beta.unsqueeze(2)  # [B, C, 1, |M|, L]
    heads = []
    for h in range(num_kv):
        rotated = torch.mul(a, ka[:, h].unsqueeze(1)).addcmul_(b, kb[:, h].unsqueeze(1))  # [B, C, 2, |M|, L]
        heads.append(torch.matmul(qp[:, h], rotated.view(batch, rows, 2 * num_mdl, -1)))  # [B, C, G, L]
    return torch.stack(heads, dim=1).transpose(2, 3)


def _scores(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    k1t: torch.Tensor,
    k2t: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    per_head_sums: bool,
) -> torch.Tensor:
    """S = (q k^T + E) scale + bias, [B, Ha, G, C, L]. q_rows [B, Ha, G, C, d_h], k [B, Ha, L, d_h],
    k1t, k2t [B, Ha, |M|, L] (key dims f, f + F of the MDLMPE pairs, key index innermost)."""
    plain = torch.matmul(q_rows, k.unsqueeze(2).transpose(-1, -2))
    scores = (plain + _correction(q_rows, k1t, k2t, alpha, beta, per_head_sums)) * scale
    return scores if bias is None else scores + bias


def attend_forward(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k1t: torch.Tensor,
    k2t: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    per_head_sums: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Region 2 forward: output [B, Ha, G, C, d_h] and the softmax statistics [B, Ha, G, C, 2] of
    :func:`_probabilities`."""
    scores = _scores(q_rows, k, k1t, k2t, alpha, beta, bias, scale, per_head_sums)
    row_max = scores.amax(dim=-1, keepdim=True)
    log_sum = torch.log(torch.exp(scores - row_max).sum(dim=-1, keepdim=True))
    stats = torch.cat((row_max, log_sum), dim=-1)
    return torch.matmul(_probabilities(scores, stats), v.unsqueeze(2)), stats


def _probabilities(scores: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """softmax(scores) from the saved statistics: the row maximum and log sum_j exp(S_ij - max),
    kept apart. Added into one log-sum-exp, a padding-only row (every score ~finfo.min) would lose
    its log L to rounding and sum V instead of averaging it as the reference's softmax does."""
    return torch.exp(scores - stats[..., :1] - stats[..., 1:])


def _key_pair_grads_summed(
    ga: dict[tuple[int, int], torch.Tensor],
    gb: dict[tuple[int, int], torch.Tensor],
    q1: torch.Tensor,
    q2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """grad k1 = sum_{g, c} (ga q1 + gb q2), grad k2 = sum_{g, c} (ga q2 - gb q1), [B, Ha, |M|, L]
    (compiled layout). ga, gb: per query head (h, g) [B, C, |M|, L]; q1, q2 [B, Ha, G, C, |M|, 1].

    The key axis is split into chunks of KEY_CHUNK that become an outer output axis, so inductor's
    loop nest runs (chunk, m, keys of the chunk, rows) and one chunk of every head's dS stays in
    cache for all m; with one key axis it re-streams all of dS once per m.
    """
    num_kv, group = q1.shape[1], q1.shape[2]
    length = next(iter(ga.values())).shape[-1]
    chunk = KEY_CHUNK if KEY_CHUNK and length % KEY_CHUNK == 0 else length

    def split(x: torch.Tensor) -> torch.Tensor:  # [..., |M|, L] -> [..., L / chunk, |M|, chunk]
        return x.unflatten(-1, (length // chunk, chunk)).transpose(-2, -3)

    grads = []
    for sign, first, second in ((1.0, q1, q2), (-1.0, q2, q1)):
        per_head = [
            sum(
                (
                    split(ga[h, g]) * first[:, h, g].unsqueeze(-3)
                    + sign * split(gb[h, g]) * second[:, h, g].unsqueeze(-3)
                ).sum(dim=1)
                for g in range(group)
            )
            for h in range(num_kv)
        ]
        grads.append(torch.stack(per_head, dim=1).transpose(-2, -3).flatten(-2))  # [B, Ha, |M|, L]
    return grads[0], grads[1]


def _correction_grads_summed(grad_s, q_rows, k1t, k2t, alpha, beta) -> tuple[torch.Tensor, ...]:
    """:func:`_correction_grads` in the compiled layout: one reduction per operand (over heads for
    alpha, beta; keys for q; query rows for k1, k2), each written per query head like E itself."""
    q1, q2 = (x.unsqueeze(-1) for x in _pair_rows(q_rows))  # [B, Ha, G, C, |M|, 1]
    k1, k2 = k1t.unsqueeze(2), k2t.unsqueeze(2)  # [B, Ha, 1, |M|, L]
    heads = [(h, g) for h in range(q_rows.shape[1]) for g in range(q_rows.shape[2])]
    ds = {hg: grad_s[:, hg[0], hg[1]].unsqueeze(-2) for hg in heads}  # [B, C, 1, L]
    grad_alpha = sum(ds[h, g] * (q1[:, h, g] * k1[:, h] + q2[:, h, g] * k2[:, h]) for h, g in heads)
    grad_beta = sum(ds[h, g] * (q2[:, h, g] * k1[:, h] - q1[:, h, g] * k2[:, h]) for h, g in heads)
    ga = {hg: ds[hg] * alpha for hg in heads}  # [B, C, |M|, L] each
    gb = {hg: ds[hg] * beta for hg in heads}
    shape = (q_rows.shape[1], q_rows.shape[2])
    grad_q1 = torch.stack([(ga[h, g] * k1[:, h] - gb[h, g] * k2[:, h]).sum(-1) for h, g in heads], 1)
    grad_q2 = torch.stack([(ga[h, g] * k2[:, h] + gb[h, g] * k1[:, h]).sum(-1) for h, g in heads], 1)
    grad_k1, grad_k2 = _key_pair_grads_summed(ga, gb, q1, q2)
    return grad_alpha, grad_beta, grad_q1.unflatten(1, shape), grad_q2.unflatten(1, shape), grad_k1, grad_k2


def _correction_grads(
    grad_s: torch.Tensor,
    q_rows: torch.Tensor,
    k1t: torch.Tensor,
    k2t: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    per_head_sums: bool,
) -> tuple[torch.Tensor, ...]:
    """Gradients of E's operands from grad_s = dL/dE [B, Ha, G, C, L]: alpha, beta [B, C, |M|, L],
    q1, q2 [B, Ha, G, C, |M|], k1, k2 [B, Ha, |M|, L]. With g = dL/dE of one query head and
    ga = g alpha, gb = g beta (per i, m, j):

        d alpha = sum_heads g (q1 k1 + q2 k2),     d beta = sum_heads g (q2 k1 - q1 k2),
        d q1 = sum_j ga k1 - gb k2,   d q2 = sum_j ga k2 + gb k1,
        d k1 = sum_i ga q1 + gb q2,   d k2 = sum_i ga q2 - gb q1.

    Layouts as in :func:`_correction`: eager, the sums over j and i are batched matmuls over m and
    d alpha, d beta accumulate in place.
    """
    if per_head_sums:
        return _correction_grads_summed(grad_s, q_rows, k1t, k2t, alpha, beta)
    num_kv, group = q_rows.shape[1], q_rows.shape[2]
    q1, q2 = _pair_rows(q_rows)  # [B, Ha, G, C, |M|]
    k12 = torch.stack((k1t, k2t), dim=-1)  # [B, Ha, |M|, L, 2]
    grad_alpha, grad_beta = torch.zeros_like(alpha), torch.zeros_like(beta)  # [B, C, |M|, L]
    grad_q1, grad_q2, grad_k1, grad_k2 = [], [], [], []
    for h in range(num_kv):
        k1, k2 = k1t[:, h].unsqueeze(1), k2t[:, h].unsqueeze(1)  # [B, 1, |M|, L]
        dk1 = dk2 = 0.0
        for g in range(group):
            ds = grad_s[:, h, g].unsqueeze(2)  # [B, C, 1, L]
            qa, qb = q1[:, h, g].unsqueeze(-1), q2[:, h, g].unsqueeze(-1)  # [B, C, |M|, 1]
            grad_alpha.addcmul_(torch.mul(qa, k1).addcmul_(qb, k2), ds)
            grad_beta.addcmul_(torch.mul(qb, k1).addcmul_(qa, k2, value=-1.0), ds)
            ga, gb = (ds * alpha).transpose(1, 2), (ds * beta).transpose(1, 2)  # [B, |M|, C, L]
            # Over keys: [B, |M|, C, L] @ [B, |M|, L, 2] -> (sum ga k1, sum ga k2), likewise gb.
            sa, sb = torch.matmul(ga, k12[:, h]), torch.matmul(gb, k12[:, h])  # [B, |M|, C, 2]
            grad_q1.append((sa[..., 0] - sb[..., 1]).transpose(1, 2))  # [B, C, |M|]
            grad_q2.append((sa[..., 1] + sb[..., 0]).transpose(1, 2))
            # Over query rows: [B, |M|, 2, C] @ [B, |M|, C, L] -> (sum q1 ga, sum q2 ga), likewise gb.
            qt = torch.stack((q1[:, h, g], q2[:, h, g]), dim=-1).permute(0, 2, 3, 1)  # [B, |M|, 2, C]
            ta, tb = torch.matmul(qt, ga), torch.matmul(qt, gb)  # [B, |M|, 2, L]
            dk1 = dk1 + ta[:, :, 0] + tb[:, :, 1]  # [B, |M|, L]
            dk2 = dk2 + ta[:, :, 1] - tb[:, :, 0]
        grad_k1.append(dk1)
        grad_k2.append(dk2)
    shape = (num_kv, group)
    return (
        grad_alpha,
        grad_beta,
        torch.stack(grad_q1, dim=1).unflatten(1, shape),
        torch.stack(grad_q2, dim=1).unflatten(1, shape),
        torch.stack(grad_k1, dim=1),
        torch.stack(grad_k2, dim=1),
    )


def attend_backward(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k1t: torch.Tensor,
    k2t: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
    stats: torch.Tensor,
    grad_out: torch.Tensor,
    per_head_sums: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Region 2 backward from the saved output and softmax statistics (flash-attention style).

    Returns the gradients of q_rows (plain term only), k, v, k1t, k2t, alpha, beta, then the pair
    parts of q's gradient (grad_q1, grad_q2 [B, Ha, G, C, |M|], dims f and f + F of the odd f;
    the caller adds them into grad_q: scattered inside a compiled graph, inductor would fuse their
    reductions into the scatter's loop, which is much slower).
    """
    # 1. Probabilities again, then the softmax backward: dS = P (dP - rowsum(dO * O)).  [B, Ha, G, C, L]
    probs = _probabilities(_scores(q_rows, k, k1t, k2t, alpha, beta, bias, scale, per_head_sums), stats)
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out).sum(dim=2)  # [B, Ha, L, d_h]
    grad_p = torch.matmul(grad_out, v.unsqueeze(2).transpose(-1, -2))
    # Gradient of the unscaled logit q.k + E (the bias is a constant).
    grad_s = probs * (grad_p - (grad_out * out).sum(dim=-1, keepdim=True)) * scale
    # 2. Plain term: two matmuls.
    grad_q = torch.matmul(grad_s, k.unsqueeze(2))  # [B, Ha, G, C, d_h]
    grad_k = torch.matmul(grad_s.transpose(-1, -2), q_rows).sum(dim=2)  # [B, Ha, L, d_h]
    # 3. The correction E.
    grad_alpha, grad_beta, grad_q1, grad_q2, grad_k1, grad_k2 = _correction_grads(
        grad_s, q_rows, k1t, k2t, alpha, beta, per_head_sums
    )
    return grad_q, grad_k, grad_v, grad_k1, grad_k2, grad_alpha, grad_beta, grad_q1, grad_q2


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
#: The pieces torch.compile wraps: region 2 in its per-head-sums layout (see :func:`_correction`).
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
