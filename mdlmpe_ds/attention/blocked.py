"""Blocked MDLMPE attention: the training path (SPEC §2 "Blocked attention", paper Appendix D).

Same signature and numbers as :func:`mdlmpe_ds.attention.reference.reference_attention`, but the
L x L x F pair tensor is never formed. The logit is written as RoPE plus a correction
(paper Eq. main_final_angle expanded, shared/PERF.md):

    S_ij = (q_i . k_j + E_ij) / sqrt(d_h),
    E_ij = sum_{f in M} alpha_ijf (q1 k1 + q2 k2)_f + beta_ijf (q2 k1 - q1 k2)_f,
    alpha = cos(delta) - 1 = -2 sin^2(delta / 2),  beta = sin(delta),

which is q^T R(delta) k with R(delta) = [[cos, -sin], [sin, cos]] on the pair (dim f, dim f + F).
The plain term stays one matmul over all of d_h; only E needs the pair phases delta_ij
(Eq. app_pair_phase). Queries are processed in blocks of C rows:

- region 1 (shared by every head and GQA group): alpha, beta [B, C, |M|, L] from row slices of A, D;
- region 2 (per block, all active heads): E, the key-padding bias, softmax, PV.

Each block runs under activation checkpointing (or, compiled, as a flash-style Function that
saves only its inputs, output and log-sum-exp), so the pair phases are recomputed in backward:
O(C L F) extra live memory instead of O(L^2 F). Inactive heads never enter the pair path; they
are plain RoPE SDPA over the whole sequence.

Eager (the default) runs region 1 and E through autograd Functions with hand-written backward
passes (:class:`PairCoefficients`, :class:`PairCorrection`) that keep few intermediates and make
few passes over the [rows, width, L] tensors, and on the CPU caps its blocks at the rows that
keep those tensors in the per-core L2 cache (:func:`_cache_rows`; C is then an upper bound): there
a pass from L2 is ~4x faster than from L3, and a block's recompute is still cached when its
backward runs. On other devices (GPU) blocks keep C rows (:func:`caps_block_rows`): each op is a
kernel launch. Measured at L = 1024, toy layer: ~0.6 KB of extra memory per (i, j) of a C = 128 block.
``compile=True`` (with ``checkpoint``, the default) runs each block as one
flash-style autograd Function of :mod:`mdlmpe_ds.attention.blocked_fused` instead: torch.compile
graphs for region 1, its hand-derived backward, and region 2 forward / backward; a block keeps
only its output and log-sum-exp for backward, like a checkpointed block, and costs ~half as much
as checkpointing around autograd-compiled regions (12x RoPE instead of 24x at L = 1024, toy
layer). ``compile=True, checkpoint=False`` keeps the older form: the plain expressions
(:func:`pair_coefficients`, :func:`pair_correction` with ``fused=False``) compiled and
differentiated by inductor, O(L^2) saved. Graphs are specialised on shapes (``dynamic=False``):
each distinct (B, H, L) compiles once (every block of a sequence has one shape, see
:func:`_block_starts`). The flash pieces may compile up to ``blocked_fused.GRAPH_BUDGET`` shapes
each (the older form, dynamo's default 8) before running eagerly, so with ``compile`` keep sequence
widths to a few buckets (SFT: ``data.pad_to_multiple_of``).

The pair path (r, s, the phase MLP, alpha, beta, E) and the scores run in fp32 whatever the
dtype of q, k, v (all-bf16 pair math loses ~13% of the correction, PERF.md); the output is cast
back to q's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from mdlmpe_ds.attention.blocked_fused import compiled_block_attention
from mdlmpe_ds.attention.common import key_padding_bias, rope_attention
from mdlmpe_ds.pe.phase import PhaseParams, angularize, mdlmpe_pairs


def pair_coefficients(
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
    """Region 1: alpha = cos(delta) - 1 and beta = sin(delta) for one query block, head-shared.

    a_rows, d_rows: [B, C, F] (the block's rows of A, D); a_cols, d_cols: [B, F, L] (A, D
    transposed, so the key index is the fast axis); w1 [H, F], b1 [H], w2 [|M|, H], b2 [|M|] fp32.
    Returns alpha, beta [B, C, |M|, L] fp32.

    Same maths as :func:`mdlmpe_ds.pe.phase.pair_phase` (Eqs. pair_availability_ratio, mdangle,
    phase_mlp) laid out feature-major: the MLP layers are batched matmuls [H, F] @ [F, L] per
    query row instead of F.linear over a trailing feature axis, which avoids transposing the
    [C, L, |M|] result for region 2.
    """
    # 1. Pair ratio r_ij,f = (A_i + A_j) / (D_i + D_j) and its angle s (Eqs. 4-5).   [B, C, F, L]
    r = (a_rows.unsqueeze(-1) + a_cols.unsqueeze(1)) / (d_rows.unsqueeze(-1) + d_cols.unsqueeze(1))
    s = angularize(r, clip_kappa)
    del r  # locals would keep every [C, F, L] intermediate alive until return
    # 2. Phase MLP delta = tau_max tanh(W2 SiLU(W1 s + b1) + b2) (Eq. phase_mlp).   [B, C, |M|, L]
    hidden = F.silu(torch.matmul(w1, s) + b1.unsqueeze(-1))  # [B, C, H, L]
    del s
    delta = tau_max * torch.tanh(torch.matmul(w2, hidden) + b2.unsqueeze(-1))
    del hidden
    # 3. alpha as -2 sin^2(delta/2): cos(delta) - 1 cancels catastrophically for small delta.
    half = torch.sin(0.5 * delta)
    return -2.0 * half * half, torch.sin(delta)


class PairCoefficients(torch.autograd.Function):
    """Region 1 with a hand-written backward (the eager path): same maths as
    :func:`pair_coefficients`, arranged for few passes over the [B, C, width, L] tensors, since on
    CPU each pass costs about as much as the arithmetic (this runs twice per block under
    checkpointing, so work moves to the backward, which runs once):

    - x = 2r - 1 = (e_i + e_j) / (D_i + D_j) with e = 2A - D (per row / column, O(L F)), and
      s = -arcsin(clip(x)) = arccos(clip(x)) - pi / 2, with the sign folded into W1;
    - the biases ride along as a row of ones appended to s and to the SiLU output, so each MLP
      layer is one matmul and the backward's bias gradients are the last column of the weight ones;
    - the SiLU slope sigmoid(u) (1 + u (1 - sigmoid(u))) = g + h - h g (g = sigmoid(u), h = u g) is
      formed in backward from the saved g and h; u itself is not kept.

    Saved for backward: arcsin(x) with its ones row, g, h with its ones row, tanh output (and x,
    D_i + D_j when A, D need gradients, i.e. with the learned coordinate): ~1 KB per (i, j) at
    F = 32 less than autograd keeps. Under per-block checkpointing nothing outlives the block.
    """

    @staticmethod
    def forward(ctx, a_rows, d_rows, a_cols, d_cols, w1, b1, w2, b2, tau_max, clip_kappa):
        need_ad = any(ctx.needs_input_grad[:4])
        batch, rows, num_pairs = a_rows.shape
        length, hidden_width = a_cols.shape[-1], w1.shape[0]
        # 1. x = (e_i + e_j) / (D_i + D_j), clipped; arcsin(x) = -s (Eqs. 4-5).      [B, C, F + 1, L]
        denom = d_rows.unsqueeze(-1) + d_cols.unsqueeze(1)  # [B, C, F, L]
        asin_x = a_rows.new_empty(batch, rows, num_pairs + 1, length)
        x = asin_x[:, :, :num_pairs]
        if need_ad:  # as 2r - 1, the reference's rounding: d arcsin is steep next to the clip
            torch.add(a_rows.unsqueeze(-1), a_cols.unsqueeze(1), out=x).div_(denom).mul_(2.0).sub_(1.0)
        else:
            torch.add((2.0 * a_rows - d_rows).unsqueeze(-1), (2.0 * a_cols - d_cols).unsqueeze(1), out=x)
            x.div_(denom)
        ad_saved = (x.clone(), denom) if need_ad else ()
        del denom
        x.clamp_(-1.0 + clip_kappa, 1.0 - clip_kappa).asin_()
        asin_x[:, :, num_pairs].fill_(1.0)  # the bias row
        # 2. u = W1 s + b1 = [-W1 | b1] [arcsin x; 1]; h = SiLU(u) = u g (Eq. phase_mlp).  [B, C, H, L]
        u = torch.matmul(torch.cat((-w1, b1.unsqueeze(1)), dim=1), asin_x)
        gate = torch.sigmoid(u)
        hidden = u.new_empty(batch, rows, hidden_width + 1, length)
        torch.mul(u, gate, out=hidden[:, :, :hidden_width])
        hidden[:, :, hidden_width].fill_(1.0)
        del u
        # 3. t = tanh(W2 h + b2), delta = tau_max t; alpha = -2 sin^2(delta / 2) (no cancellation for
        # small delta), beta = sin(delta).                                               [B, C, |M|, L]
        t = torch.matmul(torch.cat((w2, b2.unsqueeze(1)), dim=1), hidden).tanh_()
        delta = t * tau_max
        beta = torch.sin(delta)
        alpha = delta.mul_(0.5).sin_().square_().mul_(-2.0)
        ctx.save_for_backward(w1, w2, asin_x, gate, hidden, t, *ad_saved)
        ctx.tau_max, ctx.clip_kappa = tau_max, clip_kappa
        return alpha, beta

    @staticmethod
    def backward(ctx, grad_alpha, grad_beta):
        w1, w2, asin_x, gate, hidden, t, *ad_saved = ctx.saved_tensors
        tau_max, num_pairs, hidden_width = ctx.tau_max, w1.shape[1], w1.shape[0]
        # 1. d alpha/d delta = -sin(delta), d beta/d delta = cos(delta); tanh' = 1 - t^2. [B, C, |M|, L]
        delta = t * tau_max
        sin_delta = torch.sin(delta)
        grad_z = delta.cos_().mul_(grad_beta).addcmul_(sin_delta, grad_alpha, value=-1.0)
        del sin_delta
        grad_z.mul_(1.0 - t * t).mul_(tau_max)
        grad_w2b = torch.matmul(grad_z, hidden.transpose(-1, -2)).sum(dim=(0, 1))  # [|M|, H + 1]
        # 2. Through the SiLU layer: slope = g + h - h g.                                 [B, C, H, L]
        h = hidden[:, :, :hidden_width]
        grad_u = torch.matmul(w2.transpose(0, 1), grad_z)
        del grad_z
        grad_u.mul_(torch.addcmul(h, h, gate, value=-1.0).add_(gate))
        grad_w1b = torch.matmul(grad_u, asin_x.transpose(-1, -2)).sum(dim=(0, 1))  # [H, F + 1]
        grads_ad = (None, None, None, None)
        if ad_saved:
            # 3. Through s = -arcsin(clip(x)) and x = (e_i + e_j) / denom, e = 2A - D:
            #    dx/dA = 2 / denom, dx/dD = -(1 + x) / denom; the clip passes no gradient.
            x, denom = ad_saved
            kappa = ctx.clip_kappa
            inside = (x >= -1.0 + kappa) & (x <= 1.0 - kappa)
            slope = x.clamp(-1.0 + kappa, 1.0 - kappa).square_().neg_().add_(1.0).rsqrt_().mul_(inside)
            grad_x = torch.matmul(w1.transpose(0, 1), grad_u).mul_(slope).neg_().div_(denom)  # [B, C, F, L]
            grad_a = 2.0 * grad_x
            grad_d = grad_x.mul_(x + 1.0).neg_()
            grads_ad = (grad_a.sum(-1), grad_d.sum(-1), grad_a.sum(1), grad_d.sum(1))
        grad_w1, grad_b1 = -grad_w1b[:, :num_pairs], grad_w1b[:, num_pairs]
        grad_w2, grad_b2 = grad_w2b[:, :hidden_width], grad_w2b[:, hidden_width]
        return (*grads_ad, grad_w1, grad_b1, grad_w2, grad_b2, None, None)


class PairCorrection(torch.autograd.Function):
    """E for one query block with a hand-written backward (the eager path).

    Autograd through a broadcast expression would keep the rotated keys of every head
    ([B, Ha, C, 2|M|, L], the biggest tensor of the block) for backward; this saves only its
    inputs. The forward forms one KV head's rotated keys at a time in a reused buffer; the
    backward never forms them (nor their gradient): it works from the head-shared coefficients
    weighted by the head's dE (see ``backward``).

    Shapes: qp [B, Ha, C, G, 2|M|] (q1, q2 of the MDLMPE pairs); ka = (k1, k2) and
    kb = (-k2, k1) stacked as [B, Ha, 2, |M|, L]; alpha, beta [B, C, |M|, L]. The rotated keys of
    head g are alpha ka + beta kb: row 0 is alpha k1 - beta k2, row 1 alpha k2 + beta k1, and
    E = qp @ rotated. Output [B, Ha, C, G, L].
    """

    @staticmethod
    def forward(ctx, qp, ka, kb, alpha, beta):
        ctx.save_for_backward(qp, ka, kb, alpha, beta)
        batch, rows, num_mdl, length = alpha.shape
        num_kv, group = qp.shape[1], qp.shape[3]
        a, b = alpha.unsqueeze(2), beta.unsqueeze(2)  # [B, C, 1, |M|, L]
        rotated = alpha.new_empty(batch, rows, 2, num_mdl, length)
        out = alpha.new_empty(num_kv, batch, rows, group, length)
        for g in range(num_kv):
            torch.mul(a, ka[:, g].unsqueeze(1), out=rotated).addcmul_(b, kb[:, g].unsqueeze(1))
            torch.matmul(qp[:, g], rotated.view(batch, rows, 2 * num_mdl, length), out=out[g])
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad):
        # With g = dL/dE of one query head, P = q1 k1 + q2 k2 and Q = q2 k1 - q1 k2 (per i, m, j):
        #   d alpha += g P,  d beta += g Q,
        #   d qp[i, (row, m)] = sum_j (g alpha)_imj ka_rmj + (g beta)_imj kb_rmj,
        #   d ka[row, m, j] = sum_i qp[i, (row, m)] (g alpha)_imj  (kb likewise with g beta).
        # The sums over i and j are batched matmuls over m on the weighted coefficients, so the
        # rotated keys and d(rotated) ([B, C, 2, |M|, L] each) are never formed.
        qp, ka, kb, alpha, beta = ctx.saved_tensors
        batch, rows, num_mdl, _ = alpha.shape
        num_kv, group = qp.shape[1], qp.shape[3]
        d_alpha, d_beta = torch.zeros_like(alpha), torch.zeros_like(beta)
        d_qp = torch.empty_like(qp)  # [B, Ha, C, G, 2|M|]
        d_ka, d_kb = torch.zeros_like(ka), torch.zeros_like(kb)  # [B, Ha, 2, |M|, L]
        weighted_a, weighted_b = torch.empty_like(alpha), torch.empty_like(beta)
        pair = torch.empty_like(alpha)
        wa, wb = weighted_a.transpose(1, 2), weighted_b.transpose(1, 2)  # [B, |M|, C, L] views
        for h in range(num_kv):
            ka_t, kb_t = ka[:, h].permute(0, 2, 3, 1), kb[:, h].permute(0, 2, 3, 1)  # [B, |M|, L, 2]
            for g in range(group):
                grad_g = grad[:, h, :, g].unsqueeze(2)  # [B, C, 1, L]
                q = qp[:, h, :, g].view(batch, rows, 2, num_mdl, 1)  # [B, C, 2, |M|, 1]
                torch.mul(alpha, grad_g, out=weighted_a)
                torch.mul(beta, grad_g, out=weighted_b)
                d_q = torch.matmul(wa, ka_t).add_(torch.matmul(wb, kb_t))  # [B, |M|, C, 2]
                d_qp[:, h, :, g] = d_q.permute(0, 2, 3, 1).reshape(batch, rows, 2 * num_mdl)
                q_t = q.squeeze(-1).permute(0, 3, 2, 1)  # [B, |M|, 2, C]
                d_ka[:, h] += torch.matmul(q_t, wa).transpose(1, 2)  # [B, 2, |M|, L]
                d_kb[:, h] += torch.matmul(q_t, wb).transpose(1, 2)
                for d_coeff, keys in ((d_alpha, ka), (d_beta, kb)):
                    k_rows = keys[:, h].unsqueeze(1)  # [B, 1, 2, |M|, L]
                    torch.mul(q[:, :, 0], k_rows[:, :, 0], out=pair).addcmul_(q[:, :, 1], k_rows[:, :, 1])
                    d_coeff.addcmul_(pair, grad_g)  # pair = P (keys ka) or Q (keys kb)
        return d_qp, d_ka, d_kb, d_alpha, d_beta


def pair_correction(
    qp: torch.Tensor, ka: torch.Tensor, kb: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, fused: bool
) -> torch.Tensor:
    """E_ij = sum_m q1_im (alpha k1 - beta k2)_ijm + q2_im (alpha k2 + beta k1)_ijm.   [B, Ha, C, G, L]

    Inputs as in :class:`PairCorrection`. ``fused`` uses its hand-written backward (eager);
    otherwise a broadcast-multiply-sum per KV head that torch.compile fuses into loop nests
    without materialising the rotated keys, and differentiates itself.
    """
    if fused:
        return PairCorrection.apply(qp, ka, kb, alpha, beta)
    # One broadcast-multiply-sum per KV head (unrolled in the graph): inductor's backward for a
    # single all-heads expression reduces over heads in a poor loop order (1.5x slower overall).
    batch, num_kv, rows, group, _ = qp.shape
    num_mdl = alpha.shape[2]
    a, b = alpha.unsqueeze(2), beta.unsqueeze(2)  # [B, C, 1, |M|, L]
    heads = []
    for g in range(num_kv):
        rotated = a * ka[:, g].unsqueeze(1) + b * kb[:, g].unsqueeze(1)  # [B, C, 2, |M|, L]
        q12 = qp[:, g].view(batch, rows, group, 2, num_mdl, 1)
        heads.append((q12 * rotated.unsqueeze(2)).sum(dim=(3, 4)))  # [B, C, G, L]
    return torch.stack(heads, dim=1)


def block_attention(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ka: torch.Tensor,
    kb: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    bias: torch.Tensor | None,
    pair_dims: torch.Tensor,
    scale: float,
    fused: bool,
) -> torch.Tensor:
    """Region 2: scores with the MDLMPE correction, softmax and PV for one query block.

    q_rows [B, Ha, G, C, d_h] (query heads grouped by KV head), k, v [B, Ha, L, d_h];
    ka, kb [B, Ha, 2, |M|, L] (key pairs of the MDLMPE pairs, see PairCorrection);
    alpha, beta [B, C, |M|, L]; bias [B, 1, 1, 1, L] or None; pair_dims [2|M|] (dims f, f + F of
    the odd f). All fp32. Returns [B, Ha, G, C, d_h].
    """
    # 1. Plain RoPE term, one matmul over all of d_h.                           [B, Ha, G, C, L]
    scores = torch.matmul(q_rows, k.unsqueeze(2).transpose(-1, -2))
    # 2. The MDLMPE correction E (head-shared alpha, beta; per-head key rotation).
    qp = q_rows[..., pair_dims].transpose(2, 3)  # [B, Ha, C, G, 2|M|]
    correction = pair_correction(qp, ka, kb, alpha, beta, fused)  # [B, Ha, C, G, L]
    scores = (scores + correction.transpose(2, 3)) * scale
    # 3. Key padding (finfo.min, as key_padding_bias), softmax, PV.
    if bias is not None:
        scores = scores + bias
    return torch.matmul(torch.softmax(scores, dim=-1), v.unsqueeze(2))


@lru_cache(maxsize=1)
def _compiled_regions() -> tuple[Callable[..., tuple[torch.Tensor, ...]], Callable[..., torch.Tensor]]:
    """The two regions wrapped by torch.compile, separately (fused, inductor recomputes the
    sin/tanh chain once per head: 1.7x slower, PERF.md). Built on first use, never at import.
    """
    return (
        torch.compile(pair_coefficients, dynamic=False),
        torch.compile(block_attention, dynamic=False),
    )


#: Bytes of the widest fp32 tensor of one eager slice ([B, rows, width, L], see _cache_rows): its
#: elementwise passes then run from the per-core L2 cache instead of L3 / memory, ~4x faster per
#: pass on the 2 MiB L2 of the CPUs here (measured: 3.4-3.8 s instead of 4.3 s per fwd+bwd at
#: L = 1024, C = 128, toy layer).
EAGER_SLICE_BYTES = 2 << 20


def _cache_rows(batch: int, width: int, length: int) -> int:
    """Query rows per eager slice, so a [batch, rows, width, L] fp32 tensor is about
    EAGER_SLICE_BYTES; ``width`` is the widest per-pair feature axis (F, the phase MLP's hidden
    size, 2|M| or the heads). At least 8 rows, so per-op overhead stays small next to the work."""
    return max(8, EAGER_SLICE_BYTES // (4 * batch * max(width, 1) * length))


def caps_block_rows(device: torch.device) -> bool:
    """Whether the eager path caps its blocks at a cache-sized slice on ``device``: on the CPU only.

    The cap trades kernel launches for L2 hits; on a GPU every op is a kernel launch (~3,600 aten
    ops per 8-row block at 32 heads, PERF.md), so there blocks keep ``block_size`` rows."""
    return torch.device(device).type == "cpu"


def eager_block_rows(
    block_size: int,
    batch: int,
    length: int,
    num_pairs: int,
    hidden_width: int,
    num_heads: int,
    device: torch.device | str = "cpu",
) -> int:
    """Query rows per block of the eager path on ``device``: on the CPU, ``block_size`` capped at the
    cache-sized slice of :func:`_cache_rows`, whose width is the widest per-pair axis of the block
    (F, the phase MLP's hidden size, 2|M|, or the ``num_heads`` query heads that take the pair
    path); elsewhere ``block_size`` (:func:`caps_block_rows`)."""
    if not caps_block_rows(device):
        return block_size
    width = max(num_pairs, hidden_width, 2 * len(mdlmpe_pairs(num_pairs)), num_heads)
    return min(block_size, _cache_rows(batch, width, length))


def _block_starts(length: int, block_size: int, aligned: bool) -> list[tuple[int, int]]:
    """(start, first_new_row) of every query block. ``aligned`` shifts the ragged last block back
    so it ends at L with a full C rows (its overlap with the previous block is dropped): every
    block then has one shape and a compiled region is traced once per (B, H, L), not twice.
    """
    starts = [(i, i) for i in range(0, length, block_size)]
    if aligned and length > block_size and length % block_size:
        last = starts[-1][1]
        starts[-1] = (length - block_size, last)
    return starts


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    phase: PhaseParams,
    active_kv: torch.Tensor | None,
    key_valid: torch.Tensor | None,
    block_size: int,
) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"blocked attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
            "expected q [B, Hq, L, d_h] and k, v [B, Hkv, L, d_h]"
        )
    batch, num_heads, length, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, length, head_dim) or num_heads % k.shape[1]:
        raise ValueError(
            f"blocked attention: k {tuple(k.shape)} does not fit q {tuple(q.shape)} (GQA needs "
            "Hq a multiple of Hkv)"
        )
    num_pairs = head_dim // 2
    if A.shape != (batch, length, num_pairs) or D.shape != A.shape:
        raise ValueError(
            f"blocked attention: A {tuple(A.shape)}, D {tuple(D.shape)}; expected "
            f"{(batch, length, num_pairs)}"
        )
    if phase.w2.shape[0] != len(mdlmpe_pairs(num_pairs)) or phase.w1.shape[1] != num_pairs:
        raise ValueError(
            f"blocked attention: phase MLP w1 {tuple(phase.w1.shape)}, w2 {tuple(phase.w2.shape)} "
            f"do not fit F={num_pairs}"
        )
    if active_kv is not None and active_kv.shape != (k.shape[1],):
        raise ValueError(f"blocked attention: active_kv {tuple(active_kv.shape)}, expected ({k.shape[1]},)")
    if key_valid is not None and key_valid.shape != (batch, length):
        raise ValueError(f"blocked attention: key_valid {tuple(key_valid.shape)}, expected {(batch, length)}")
    if block_size < 1:
        raise ValueError(f"blocked attention: block_size must be >= 1, got {block_size}")


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    phase: PhaseParams,
    *,
    tau_max: float,
    clip_kappa: float,
    active_kv: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    scale: float | None = None,
    block_size: int = 128,
    checkpoint: bool = True,
    compile: bool = False,
) -> torch.Tensor:
    """MDLMPE attention over query blocks of ``block_size`` rows; drop-in for ``reference_attention``.

    q [B, Hq, L, d_h], k/v [B, Hkv, L, d_h] (already RoPE-rotated); A, D [B, L, F] fp32;
    ``active_kv`` [Hkv] bool (None: all heads); ``key_valid`` [B, L] bool. Returns [B, Hq, L, d_h]
    in q's dtype. ``checkpoint`` recomputes each block in backward (O(C L F) live memory instead
    of O(L^2 F) saved); ``compile`` runs the two regions through torch.compile (same numbers).
    Eager blocks on the CPU have at most ``_cache_rows`` rows (module docstring).
    """
    _check_inputs(q, k, v, A, D, phase, active_kv, key_valid, block_size)
    num_heads, head_dim = q.shape[1], q.shape[3]
    num_kv = k.shape[1]
    group = num_heads // num_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if active_kv is None:
        active_kv = torch.ones(num_kv, dtype=torch.bool)
    active_kv = active_kv.detach().to(device="cpu", dtype=torch.bool)
    if not bool(active_kv.any()):
        return rope_attention(q, k, v, key_valid, scale)

    # 1. Split heads: active KV heads (and their query groups) take the pair path.
    kv_on = active_kv.nonzero().flatten().to(q.device)
    q_on = (kv_on.unsqueeze(1) * group + torch.arange(group, device=q.device)).flatten()
    out_on = _pair_path(
        q.index_select(1, q_on),
        k.index_select(1, kv_on),
        v.index_select(1, kv_on),
        A,
        D,
        phase,
        key_valid,
        scale,
        tau_max,
        clip_kappa,
        block_size,
        checkpoint,
        compile,
    )
    if bool(active_kv.all()):
        return out_on
    # 2. Inactive heads: plain RoPE SDPA over the whole sequence, no pair work at all.
    kv_off = (~active_kv).nonzero().flatten().to(q.device)
    q_off = (kv_off.unsqueeze(1) * group + torch.arange(group, device=q.device)).flatten()
    out_off = rope_attention(
        q.index_select(1, q_off), k.index_select(1, kv_off), v.index_select(1, kv_off), key_valid, scale
    )
    # 3. Put every head back at its own index (out-of-place, so autograd sees it).
    out = torch.cat((out_on, out_off), dim=1)
    inverse = torch.argsort(torch.cat((q_on, q_off)))
    return out.index_select(1, inverse)


def _pair_path(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    phase: PhaseParams,
    key_valid: torch.Tensor | None,
    scale: float,
    tau_max: float,
    clip_kappa: float,
    block_size: int,
    checkpoint: bool,
    compile: bool,
) -> torch.Tensor:
    """MDLMPE attention for heads that are all active. q [B, Ha*G, L, d_h], k/v [B, Ha, L, d_h]."""
    batch, num_heads, length, head_dim = q.shape
    num_kv = k.shape[1]
    num_pairs = head_dim // 2
    pairs = mdlmpe_pairs(num_pairs).to(q.device)
    pair_dims = torch.cat((pairs, num_pairs + pairs))  # [2|M|]: dims f and f + F of each odd f
    # fp32 copies, O(L d_h): the pair path and scores run in fp32 whatever the input dtype.
    qf = q.float().view(batch, num_kv, num_heads // num_kv, length, head_dim)  # [B, Ha, G, L, d_h]
    kf, vf = k.float(), v.float()  # [B, Ha, L, d_h]
    k1t = kf[..., pairs].transpose(-1, -2)  # [B, Ha, |M|, L]
    k2t = kf[..., num_pairs + pairs].transpose(-1, -2)
    a_cols, d_cols = A.float().transpose(1, 2), D.float().transpose(1, 2)  # [B, F, L]
    weights = tuple(t.float() for t in phase)
    bias = key_padding_bias(key_valid)
    bias = None if bias is None else bias.unsqueeze(1)  # [B, 1, 1, 1, L]
    flash = compile and checkpoint
    if flash:
        # Compiled flash-style blocks (blocked_fused): each block saves its output and log-sum-exp
        # and recomputes the rest in backward, which is what checkpointing is for, only cheaper.
        k1t, k2t, a_cols, d_cols = (t.contiguous() for t in (k1t, k2t, a_cols, d_cols))

        def run_block(
            q_rows: torch.Tensor, a_rows: torch.Tensor, d_rows: torch.Tensor, *params: torch.Tensor
        ):
            return compiled_block_attention(
                q_rows,
                kf,
                vf,
                k1t,
                k2t,
                a_rows,
                d_rows,
                a_cols,
                d_cols,
                *params,
                bias,
                scale,
                tau_max,
                clip_kappa,
            )

    else:
        ka = torch.stack((k1t, k2t), dim=2)  # [B, Ha, 2, |M|, L]
        kb = torch.stack((-k2t, k1t), dim=2)
        coefficients, attend = _compiled_regions() if compile else (PairCoefficients.apply, block_attention)

        def run_block(
            q_rows: torch.Tensor, a_rows: torch.Tensor, d_rows: torch.Tensor, *params: torch.Tensor
        ):
            alpha, beta = coefficients(a_rows, d_rows, a_cols, d_cols, *params, tau_max, clip_kappa)
            return attend(q_rows, kf, vf, ka, kb, alpha, beta, bias, pair_dims, scale, not compile)

    if not compile:
        # Eager blocks on the CPU are at most cache-sized: every elementwise pass then runs from L2,
        # and a block's recompute is still in cache when its backward reads it.
        hidden_width = phase.w1.shape[0]
        block_size = eager_block_rows(block_size, batch, length, num_pairs, hidden_width, num_heads, q.device)
    outputs = []
    for start, first_new in _block_starts(length, block_size, aligned=compile):
        rows = slice(start, min(start + block_size, length))
        args = (qf[:, :, :, rows], A[:, rows].float(), D[:, rows].float(), *weights)
        if checkpoint and not flash and torch.is_grad_enabled():
            block = activation_checkpoint(run_block, *args, use_reentrant=False)
        else:
            block = run_block(*args)
        outputs.append(block[:, :, :, first_new - start :])
    out = torch.cat(outputs, dim=3)  # [B, Ha, G, L, d_h]
    return out.reshape(batch, num_heads, length, head_dim).to(q.dtype)
