"""Compiled, flash-style query blocks for :mod:`mdlmpe_ds.attention.blocked` (``compile=True``).

One :class:`CompiledBlockAttention` call per query block of C rows. Its forward keeps for backward
only the block's inputs (views of q, k, v, A, D and the phase-MLP weights), its output and the
log-sum-exp of its scores: O(C d_h) per block. Its backward recomputes the pair coefficients
alpha, beta and the scores from those and writes every gradient with hand-derived formulas.
Compared with activation checkpointing around autograd-compiled regions (the previous design,
24x RoPE at L = 1024 on the toy layer of PERF.md, now ~12x) this

- runs the block's forward maths twice (forward, recompute in backward) instead of three times
  (forward, checkpoint recompute, and that recompute is an autograd forward storing its
  intermediates);
- makes each backward reduction its own loop nest in a layout it likes (autograd through the
  broadcast expression of E made inductor recompute the softmax backward 2|M| times per element
  and stream alpha, beta once per head);
- gives region 1 (the phase MLP) a hand-derived backward and a feature-major layout with no
  transposes (see :func:`_rowwise_linear`).

Each piece is compiled with ``dynamic=False`` on first use, never at import; see
:mod:`mdlmpe_ds.attention.blocked` for the recompile budget. All maths in fp32.

Tried and measured slower on the toy layer at L = 1024 (CPU, one thread), so not used:
- square C x C tiles over the upper triangle only (r_ij = r_ji, so alpha, beta serve both
  directions of a tile and region 1 runs on (n + 1) / 2n of the grid), online softmax across
  tiles: region 1 fell from ~490 to ~320 ms, but transposing each tile's alpha, beta and their
  gradients (~0.2-0.5 ms per MB on this CPU), the online-softmax state updates and ~5x more
  compiled calls cost more: 1,130 ms against 925 ms for C-row blocks;
- region 1 feature-major over the whole block ([B, F, C, L], one matmul per MLP layer with C L
  columns): the GEMMs are memory-bound either way, and the layout change adds a transposing pass;
- the phase MLP unrolled into scalar-weight sums so inductor fuses it into one loop: 4x slower
  (s is still materialised, and the kernel spills), and minutes to compile.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, wraps
from typing import NamedTuple

import torch
import torch.nn.functional as F

# Keys per chunk in the k-gradient reduction (see _key_pair_grads); 0 or a non-divisor of L: one chunk.
KEY_CHUNK = 64


def _tanh(z: torch.Tensor) -> torch.Tensor:
    """tanh(z) as 1 - 2 / (exp(2z) + 1): inductor vectorises exp well, its tanh is ~2.6x slower.
    Exact limits (+-1, no NaN: exp overflows to inf) and |error| < 1e-7 near 0 (fp32 rounding)."""
    return 1.0 - 2.0 / (torch.exp(2.0 * z) + 1.0)


def _phase_mlp_inputs(
    a_rows: torch.Tensor, d_rows: torch.Tensor, a_cols: torch.Tensor, d_cols: torch.Tensor, clip_kappa: float
) -> torch.Tensor:
    """s_ij,f [B, C, F, L] (Eqs. 4-5) for the block's rows a_rows, d_rows [B, C, F] and every key
    a_cols, d_cols [B, F, L] (A, D transposed, contiguous: the key index is the fast axis).

    s = arccos(x) - pi/2 is computed as -arcsin(x): the same function with the same derivative,
    ~1.6x cheaper in inductor's vectorised code and free of the cancellation near x = 0.
    """
    r = (a_rows.unsqueeze(-1) + a_cols.unsqueeze(1)) / (d_rows.unsqueeze(-1) + d_cols.unsqueeze(1))
    return -torch.asin((2.0 * r - 1.0).clamp(-1.0 + clip_kappa, 1.0 - clip_kappa))


def _rowwise_linear(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """weight [O, I] applied to every query row of x [B, C, I, L] -> [B, C, O, L], as one bmm.

    Region 1 stays feature-major throughout (s, u, z, alpha, beta all [B, C, *, L], the layout
    region 2 reads). Written as a matmul over a trailing feature axis, inductor transposes every
    [C L, *] operand to and from that layout; as an explicit bmm over the B C rows nothing is
    copied (region 1 ~1.3x faster forward and backward).
    """
    rows = x.shape[0] * x.shape[1]
    y = torch.bmm(weight.expand(rows, *weight.shape), x.flatten(0, 1)).view(*x.shape[:2], weight.shape[0], -1)
    return y if bias is None else y + bias.unsqueeze(-1)


def _alpha_beta(z: torch.Tensor, tau_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha = -2 sin^2(delta/2) (cos(delta) - 1 without cancellation), beta = sin(delta), with
    delta = tau_max tanh(z); z, alpha, beta [B, C, |M|, L]."""
    delta = tau_max * _tanh(z)
    half = torch.sin(0.5 * delta)
    return -2.0 * half * half, torch.sin(delta)


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
    """Region 1: alpha, beta [B, C, |M|, L] of one query block, shared by every head; the maths
    of :func:`mdlmpe_ds.attention.blocked.pair_coefficients` (same arguments and shapes).

    Compiled on its own, the intermediates s, u, z are not graph outputs, so inductor fuses them
    away instead of writing them out as :func:`coefficients_for_backward` must."""
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
    """alpha, beta and what :func:`coefficients_vjp` needs: s [B, C, F, L] and the
    pre-activations u [B, C, H, L], z [B, C, |M|, L] (Eq. phase_mlp)."""
    s = _phase_mlp_inputs(a_rows, d_rows, a_cols, d_cols, clip_kappa)  # [B, C, F, L]
    u = _rowwise_linear(w1, s, b1)
    z = _rowwise_linear(w2, F.silu(u), b2)
    return (*_alpha_beta(z, tau_max), s, u, z)


def coefficients_vjp(
    s: torch.Tensor,
    u: torch.Tensor,
    z: torch.Tensor,
    w2: torch.Tensor,
    tau_max: float,
    grad_alpha: torch.Tensor,
    grad_beta: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Gradients of the phase-MLP weights (w1, b1, w2, b2) from those of alpha, beta [B, C, |M|, L].

    Hand-derived, one graph: d alpha/d delta = -sin(delta), d beta/d delta = cos(delta),
    tanh' = 1 - t^2, SiLU'(u) = g (1 + u (1 - g)) with g = sigmoid(u). Cheaper than autograd's
    forward-with-saves plus backward (fewer [C, *, L] intermediates written and read back).
    """
    t = _tanh(z)  # [B, C, |M|, L]
    delta = tau_max * t
    grad_z = (torch.cos(delta) * grad_beta - torch.sin(delta) * grad_alpha) * (1.0 - t * t) * tau_max
    gate = torch.sigmoid(u)  # [B, C, H, L]
    grad_u = _rowwise_linear(w2.t(), grad_z, None) * (gate * (1.0 + u * (1.0 - gate)))
    # Weight gradients: per-row [O, L] @ [L, I] products summed over the B C rows.
    grad_w1 = torch.bmm(grad_u.flatten(0, 1), s.flatten(0, 1).transpose(1, 2)).sum(dim=0)  # [H, F]
    grad_w2 = torch.bmm(grad_z.flatten(0, 1), (u * gate).flatten(0, 1).transpose(1, 2)).sum(dim=0)  # [|M|, H]
    return grad_w1, grad_u.sum(dim=(0, 1, 3)), grad_w2, grad_z.sum(dim=(0, 1, 3))


def _pair_rows(q_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q1, q2 [B, Ha, G, C, |M|]: the query dims f and f + F of the MDLMPE pairs (odd f), as
    strided slices (an index tensor would make inductor emit indirect loads)."""
    num_pairs = q_rows.shape[-1] // 2
    return q_rows[..., 1:num_pairs:2], q_rows[..., num_pairs + 1 :: 2]


def _scores(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    k1t: torch.Tensor,
    k2t: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """S = (q k^T + E) scale + bias, [B, Ha, G, C, L]. q_rows [B, Ha, G, C, d_h], k [B, Ha, L, d_h],
    k1t, k2t [B, Ha, |M|, L] (key dims f, f + F of the MDLMPE pairs, key index innermost).

    E = sum_m alpha (q1 k1 + q2 k2) + beta (q2 k1 - q1 k2) (q^T R(delta) k minus the plain term),
    written once per query head (KV head h, group member g) and stacked: inductor fuses the
    per-head reductions into one loop nest that loads each alpha, beta element once for all
    heads; the all-heads broadcast form re-streams alpha, beta from memory once per head (and a
    per-KV-head form once per group member: GQA 1.4x slower).
    """
    plain = torch.matmul(q_rows, k.unsqueeze(2).transpose(-1, -2))
    q1, q2 = (x.unsqueeze(-1) for x in _pair_rows(q_rows))  # [B, Ha, G, C, |M|, 1]
    k1, k2 = k1t.unsqueeze(2), k2t.unsqueeze(2)  # [B, Ha, 1, |M|, L]
    a, b = alpha, beta  # [B, C, |M|, L]
    num_kv, group = q_rows.shape[1], q_rows.shape[2]
    correction = torch.stack(  # [B, Ha G, C, L] -> [B, Ha, G, C, L]
        [
            (
                a * (q1[:, h, g] * k1[:, h] + q2[:, h, g] * k2[:, h])
                + b * (q2[:, h, g] * k1[:, h] - q1[:, h, g] * k2[:, h])
            ).sum(dim=-2)
            for h in range(num_kv)
            for g in range(group)
        ],
        dim=1,
    ).unflatten(1, (num_kv, group))
    scores = (plain + correction) * scale
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Region 2 forward: output [B, Ha, G, C, d_h] and the scores' log-sum-exp [B, Ha, G, C, 1]."""
    scores = _scores(q_rows, k, k1t, k2t, alpha, beta, bias, scale)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v.unsqueeze(2)), lse


def _key_pair_grads(
    ga: dict[tuple[int, int], torch.Tensor],
    gb: dict[tuple[int, int], torch.Tensor],
    q1: torch.Tensor,
    q2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """grad k1 = sum_{g, c} (ga q1 + gb q2), grad k2 = sum_{g, c} (ga q2 - gb q1), [B, Ha, |M|, L].

    ga, gb: per query head (h, g) [B, C, |M|, L]; q1, q2 [B, Ha, G, C, |M|, 1]. The key axis is
    split into chunks of KEY_CHUNK that become an outer output axis, so inductor's loop nest runs
    (chunk, m, keys of the chunk, rows) and one chunk of every head's dS stays in cache for all
    m; with one key axis it runs (m, keys, rows) and re-streams all of dS once per m (~10% of
    the whole step at L = 1024).
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
    lse: torch.Tensor,
    grad_out: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Region 2 backward from the saved output and log-sum-exp (flash-attention style).

    Returns the gradients of q_rows (plain term only), k, v, k1t, k2t, alpha, beta, then the pair
    parts of q's gradient (grad_q1, grad_q2 [B, Ha, G, C, |M|], dims f and f + F of the odd f;
    scattered into grad_q inside the graph, inductor fuses their reductions into the scatter's
    loop, ~10x slower). The plain term's q, k gradients are matmuls; E's are one reduction per
    operand (over heads for alpha, beta; keys for q; query rows for k1, k2), each written per KV
    head like E itself (see :func:`_scores`).
    """
    # 1. Probabilities again, then the softmax backward: dS = P (dP - rowsum(dO * O)).  [B, Ha, G, C, L]
    probs = torch.exp(_scores(q_rows, k, k1t, k2t, alpha, beta, bias, scale) - lse)
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out).sum(dim=2)  # [B, Ha, L, d_h]
    grad_p = torch.matmul(grad_out, v.unsqueeze(2).transpose(-1, -2))
    # Gradient of the unscaled logit q.k + E (the bias is a constant).
    grad_s = probs * (grad_p - (grad_out * out).sum(dim=-1, keepdim=True)) * scale
    # 2. Plain term: two matmuls.
    grad_q = torch.matmul(grad_s, k.unsqueeze(2))  # [B, Ha, G, C, d_h]
    grad_k = torch.matmul(grad_s.transpose(-1, -2), q_rows).sum(dim=2)  # [B, Ha, L, d_h]
    # 3. E = sum_m alpha (q1 k1 + q2 k2) + beta (q2 k1 - q1 k2), per query head (h, g).
    q1, q2 = (x.unsqueeze(-1) for x in _pair_rows(q_rows))  # [B, Ha, G, C, |M|, 1]
    k1, k2 = k1t.unsqueeze(2), k2t.unsqueeze(2)  # [B, Ha, 1, |M|, L]
    heads = [(h, g) for h in range(q_rows.shape[1]) for g in range(q_rows.shape[2])]
    ds = {hg: grad_s[:, hg[0], hg[1]].unsqueeze(-2) for hg in heads}  # [B, C, 1, L]
    # Over query heads: [B, C, |M|, L].
    grad_alpha = sum(ds[h, g] * (q1[:, h, g] * k1[:, h] + q2[:, h, g] * k2[:, h]) for h, g in heads)
    grad_beta = sum(ds[h, g] * (q2[:, h, g] * k1[:, h] - q1[:, h, g] * k2[:, h]) for h, g in heads)
    ga = {hg: ds[hg] * alpha for hg in heads}  # [B, C, |M|, L] each
    gb = {hg: ds[hg] * beta for hg in heads}
    # Over keys: [B, Ha, G, C, |M|].
    shape = (q_rows.shape[1], q_rows.shape[2])
    grad_q1 = torch.stack(
        [(ga[h, g] * k1[:, h] - gb[h, g] * k2[:, h]).sum(-1) for h, g in heads], 1
    ).unflatten(1, shape)
    grad_q2 = torch.stack(
        [(ga[h, g] * k2[:, h] + gb[h, g] * k1[:, h]).sum(-1) for h, g in heads], 1
    ).unflatten(1, shape)
    # Over group members and query rows: [B, Ha, |M|, L].
    grad_k1, grad_k2 = _key_pair_grads(ga, gb, q1, q2)
    return grad_q, grad_k, grad_v, grad_k1, grad_k2, grad_alpha, grad_beta, grad_q1, grad_q2


class CompiledPieces(NamedTuple):
    """The functions above, each to be wrapped by torch.compile (one graph per distinct shape)."""

    coefficients: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    coefficients_for_backward: Callable[..., tuple[torch.Tensor, ...]]
    coefficients_vjp: Callable[..., tuple[torch.Tensor, ...]]
    attend_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    attend_backward: Callable[..., tuple[torch.Tensor, ...]]


# Shapes each compiled piece may be traced for before dynamo stops compiling it (and runs it
# eagerly, same numbers, ~3x slower): every (batch, active heads, sequence width) is one. Dynamo's
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
def compiled_pieces() -> CompiledPieces:
    """Built on first use, never at import. Region 1 (alpha, beta) and region 2 (attention) are
    separate graphs: fused, inductor recomputes the sin/tanh chain once per head (PERF.md).
    """
    fns = (coefficients, coefficients_for_backward, coefficients_vjp, attend_forward, attend_backward)
    return CompiledPieces(*(_compiled(fn) for fn in fns))


class CompiledBlockAttention(torch.autograd.Function):
    """One query block: forward saves inputs, output and log-sum-exp; backward recomputes.

    Inputs: q_rows [B, Ha, G, C, d_h]; k, v [B, Ha, L, d_h]; k1t, k2t [B, Ha, |M|, L]; a_rows,
    d_rows [B, C, F]; a_cols, d_cols [B, F, L] (contiguous); w1, b1, w2, b2; bias [B, 1, 1, 1, L]
    or None; then scale, tau_max, clip_kappa (floats). All fp32. Output [B, Ha, G, C, d_h].
    """

    @staticmethod
    def forward(ctx, q_rows, k, v, k1t, k2t, a_rows, d_rows, a_cols, d_cols, w1, b1, w2, b2, bias, *consts):
        scale, tau_max, clip_kappa = consts
        pieces = compiled_pieces()
        alpha, beta = pieces.coefficients(a_rows, d_rows, a_cols, d_cols, w1, b1, w2, b2, tau_max, clip_kappa)
        out, lse = pieces.attend_forward(q_rows, k, v, k1t, k2t, alpha, beta, bias, scale)
        region1 = (a_rows, d_rows, a_cols, d_cols, w1, b1, w2, b2)
        ctx.save_for_backward(q_rows, k, v, k1t, k2t, *region1, bias, out, lse)
        ctx.consts = consts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_rows, k, v, k1t, k2t, *region1, bias, out, lse = ctx.saved_tensors
        scale, tau_max, clip_kappa = ctx.consts
        pieces = compiled_pieces()
        needs_ad, needs_weights = any(ctx.needs_input_grad[5:9]), any(ctx.needs_input_grad[9:13])
        # 1. Recompute alpha, beta. A, D need gradients only with a learned coordinate: then
        # autograd differentiates region 1; otherwise the hand-derived vjp (cheaper) does.
        leaves = saved = None
        if needs_ad:
            leaves = [t.detach().requires_grad_(need) for t, need in zip(region1, ctx.needs_input_grad[5:13])]
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
            lse,
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
            s, u, z = saved
            grads_region1[4:] = pieces.coefficients_vjp(s, u, z, region1[6], tau_max, grad_alpha, grad_beta)
        return grad_q, grad_k, grad_v, grad_k1, grad_k2, *grads_region1, None, None, None, None


def compiled_block_attention(
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
    """One query block through the compiled pieces, [B, Ha, G, C, d_h] (shapes as in
    :class:`CompiledBlockAttention`); without autograd only the two forward graphs run."""
    region1 = (a_rows, d_rows, a_cols, d_cols, w1, b1, w2, b2)
    if torch.is_grad_enabled():
        return CompiledBlockAttention.apply(
            q_rows, k, v, k1t, k2t, *region1, bias, scale, tau_max, clip_kappa
        )
    pieces = compiled_pieces()
    alpha, beta = pieces.coefficients(*region1, tau_max, clip_kappa)
    return pieces.attend_forward(q_rows, k, v, k1t, k2t, alpha, beta, bias, scale)[0]
