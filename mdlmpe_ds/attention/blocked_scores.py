"""Region 2 of one query block of the blocked MDLMPE attention: the scores q.k + E for every active
head, softmax and PV, and their gradients by hand-derived formulas.

The sums over the MDLMPE pairs have two layouts, chosen with the pieces (``per_head_sums``, see
:func:`_correction`): eager, rotated keys per KV head and batched matmuls (few large kernels);
compiled, one broadcast-multiply-sum per query head, which inductor fuses into one loop nest.

Apart from region 1 (blocked_coefficients.py) because it is the per-head part: it takes alpha,
beta as inputs and knows nothing of A, D or the phase MLP. blocked_math.py runs both per block.
All maths in fp32.
"""

from __future__ import annotations

import torch

# Keys per chunk in the compiled layout's k-gradient reduction (see _key_pair_grads_summed); 0 or
# a non-divisor of L: one chunk.
KEY_CHUNK = 64


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


__all__ = ["KEY_CHUNK", "attend_backward", "attend_forward"]
