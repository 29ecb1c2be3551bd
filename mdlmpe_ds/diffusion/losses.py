"""Masked-diffusion training losses of LLaDA and Dream (docs/models.md §3.1, §3.2, §3.5).

All take ALIGNED logits [B, L, V]: logit i predicts token i. Dream's shift (the logit at i-1
predicts token i) is applied inside the model, so the losses are the same code for both families.

Cross-entropy is computed in fp32 and only at masked positions: the [M, V] rows of the M masked
tokens are gathered first, so the fp32 copy is M x V, not B x L x V.

Training passes a ``ScoredCE`` instead of logits: the model's scored-positions forward
(``DiffusionLM.forward(..., scored=masked, targets=ids)``) has already computed that fp32 CE at the
masked positions, chunk by chunk, without any [B, L, V] tensor; the weighting, normalisation and
statistics below are the same code for both inputs.

Each loss returns ``(loss, LossStats)``; the stats are detached sums (not means) so the trainer can
all-reduce them across ranks and micro-batches before dividing.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F


class ScoredCE(NamedTuple):
    """Per-position fp32 cross-entropy at the scored positions, in row-major order of the scored
    mask (the order of ``mask.nonzero()``). ``ce`` [M] fp32 (differentiable), ``rows``, ``cols`` [M]."""

    ce: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor


T_BUCKETS = 10


class LossStats(NamedTuple):
    """Detached statistics of one loss call (sums, so they add across ranks and micro-batches).

    ``num_masked`` scalar: masked tokens in the loss; ``nll_sum`` scalar: unweighted CE summed over
    them; ``bucket_nll`` [T_BUCKETS]: the same sum split by the row's noise level t into equal-width
    buckets of [0, 1]; ``bucket_count`` [T_BUCKETS]: masked tokens per bucket. bucket_nll /
    bucket_count is the per-token NLL as a function of t.
    """

    num_masked: torch.Tensor
    nll_sum: torch.Tensor
    bucket_nll: torch.Tensor
    bucket_count: torch.Tensor


def _check(logits: torch.Tensor | ScoredCE, targets: torch.Tensor, masked: torch.Tensor) -> None:
    if isinstance(logits, ScoredCE):
        if masked.shape != targets.shape or logits.ce.dim() != 1 or targets.dim() != 2:
            raise ValueError(
                f"expected targets, masked [B, L] and ScoredCE.ce [M]; got targets {tuple(targets.shape)}, "
                f"masked {tuple(masked.shape)}, ce {tuple(logits.ce.shape)}"
            )
        return
    if logits.dim() != 3 or targets.shape != logits.shape[:2] or masked.shape != targets.shape:
        raise ValueError(
            f"expected logits [B, L, V], targets and masked [B, L]; got logits {tuple(logits.shape)}, "
            f"targets {tuple(targets.shape)}, masked {tuple(masked.shape)}"
        )


def masked_cross_entropy(
    logits: torch.Tensor | ScoredCE, targets: torch.Tensor, masked: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 CE at the masked positions only: (ce [M], row index [M]) in row-major order.

    A ``ScoredCE`` must have been computed for exactly these positions (same count and rows); its
    ``ce`` is returned as is."""
    _check(logits, targets, masked)
    if isinstance(logits, ScoredCE):
        rows, cols = masked.nonzero(as_tuple=True)  # [M], [M]
        if logits.rows.shape != rows.shape or not (
            torch.equal(logits.rows, rows) and torch.equal(logits.cols, cols)
        ):
            raise ValueError(
                f"ScoredCE holds {logits.rows.numel()} positions but the loss mask has {rows.numel()} "
                "(or other ones): pass the same mask as the model's `scored`"
            )
        return logits.ce, rows
    rows, cols = masked.nonzero(as_tuple=True)  # [M], [M]
    selected = logits[rows, cols].float()  # [M, V]
    ce = F.cross_entropy(selected, targets[rows, cols], reduction="none")  # [M]
    return ce, rows


def _stats(ce: torch.Tensor, rows: torch.Tensor, t: torch.Tensor) -> LossStats:
    with torch.no_grad():
        ce = ce.detach()
        bucket = (t.detach().float() * T_BUCKETS).long().clamp(0, T_BUCKETS - 1)[rows]  # [M]
        bucket_nll = torch.zeros(T_BUCKETS, dtype=torch.float32, device=ce.device)
        bucket_nll.index_add_(0, bucket, ce)
        bucket_count = torch.bincount(bucket, minlength=T_BUCKETS).to(torch.float32)
        return LossStats(
            num_masked=torch.tensor(ce.numel(), device=ce.device, dtype=torch.long),
            nll_sum=ce.sum(),
            bucket_nll=bucket_nll,
            bucket_count=bucket_count,
        )


def _zero_like_graph(logits: torch.Tensor | ScoredCE) -> torch.Tensor:
    """A 0 that stays connected to ``logits`` (backward gives zero gradients, not an error)."""
    if isinstance(logits, ScoredCE):  # M = 0: the empty CE still hangs off the head's graph
        return logits.ce.sum() * 0.0
    return logits.flatten()[:1].float().sum() * 0.0


def llada_sft_loss(
    logits: torch.Tensor | ScoredCE,
    targets: torch.Tensor,
    masked: torch.Tensor,
    p_mask: torch.Tensor,
    answer_len: torch.Tensor,
) -> tuple[torch.Tensor, LossStats]:
    """LLaDA SFT: (1/B) Σ_b Σ_{i masked in b} CE_bi / p_b / answer_len_b (docs/models.md §3.2).

    ``answer_len`` [B] counts the row's maskable tokens INCLUDING its EOS padding (``SFTCollator``'s
    ``answer_len``); ``p_mask`` [B] is the row's mask probability. B counts every row, masked or not.
    Under gradient accumulation average the micro-batch losses (each is already a per-row mean).
    """
    ce, rows = masked_cross_entropy(logits, targets, masked)
    B = targets.shape[0]
    if answer_len.shape != (B,) or p_mask.shape != (B,):
        raise ValueError(
            f"p_mask {tuple(p_mask.shape)} and answer_len {tuple(answer_len.shape)} must both be ({B},)"
        )
    if bool((answer_len[rows] <= 0).any()):
        raise ValueError("a row with masked tokens has answer_len 0")
    weight = 1.0 / (p_mask.float()[rows] * answer_len.float()[rows])  # [M]
    loss = (ce * weight).sum() / B if ce.numel() else _zero_like_graph(logits)
    return loss, _stats(ce, rows, p_mask)


def llada_pretrain_loss(
    logits: torch.Tensor | ScoredCE, targets: torch.Tensor, masked: torch.Tensor, p_mask: torch.Tensor
) -> tuple[torch.Tensor, LossStats]:
    """LLaDA pretraining: Σ_{masked} CE / p_b, divided by B·L, all tokens masked or not (docs/models.md
    §3.1)."""
    ce, rows = masked_cross_entropy(logits, targets, masked)
    B, L = targets.shape
    if p_mask.shape != (B,):
        raise ValueError(f"p_mask has shape {tuple(p_mask.shape)}, expected ({B},)")
    weight = 1.0 / p_mask.float()[rows]  # [M]
    loss = (ce * weight).sum() / (B * L) if ce.numel() else _zero_like_graph(logits)
    return loss, _stats(ce, rows, p_mask)


def cart_weights(masked: torch.Tensor, p: float = 0.1, valid: torch.Tensor | None = None) -> torch.Tensor:
    """CART weights w_i = Σ_{j≠i, j unmasked, j valid} ½·p·(1−p)^{|i−j|−1} (docs/models.md §3.5). fp32 [B, L].

    A symmetric geometric kernel over the distance to every unmasked token (prompt included): a
    masked token with much revealed context nearby gets a larger weight. Independent of t.
    Computed as a linear convolution of the unmasked indicator with the full (2L−1)-tap kernel by
    FFT in fp64: O(B·L·log L), no L x L tensor, no kernel truncation, round-off ~1e-15 (w ≤ 1).
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"cart p must be in (0, 1], got {p}")
    L = masked.shape[1]
    context = ~masked.to(torch.bool)
    if valid is not None:
        context = context & valid.to(torch.bool)
    d = torch.arange(-(L - 1), L, device=masked.device, dtype=torch.float64).abs()  # [2L-1], offset j - i
    kernel = torch.where(d > 0, 0.5 * p * (1.0 - p) ** (d - 1.0), torch.zeros_like(d))
    # Output i is entry i + L - 1 of the linear convolution (length 3L - 2). A circular one of length
    # n = 2L - 1 folds entry k + n onto k, and k + n >= 3L - 2 for every k >= L - 1 we keep: exact.
    n = 2 * L - 1
    spectrum = torch.fft.rfft(context.to(torch.float64), n=n) * torch.fft.rfft(kernel, n=n)  # [B, L]
    full = torch.fft.irfft(spectrum, n=n)  # [B, 2L-1]
    return full[:, L - 1 :].to(torch.float32)


def dream_sft_loss(
    logits: torch.Tensor | ScoredCE,
    targets: torch.Tensor,
    masked: torch.Tensor,
    t: torch.Tensor,
    maskable: torch.Tensor,
    weighting: Literal["original", "cart", "linear", "none"] = "original",
    cart_p: float = 0.1,
    valid: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Dream SFT (Dream-train): Σ_{masked} w_i·CE_i / (number of masked tokens) (docs/models.md §3.5).

    ``weighting``: ``original`` w = 1/t (row's t), ``linear`` w = 1 − t, ``cart`` w = ``cart_weights``
    (``cart_p``, context = unmasked and ``valid`` tokens), ``none`` w = 1. ``hidden`` [B, L]: every
    position whose input is the mask token, when that is more than ``masked`` (block diffusion with
    ``block_context="full"``: the later blocks are masked inputs the model sees but no loss
    covers); CART counts none of them as context. Default: ``masked``. ``maskable`` [B, L] is
    checked to contain ``masked``. The normaliser is this micro-batch's masked count, as Dream-train
    does per rank; under gradient accumulation average the micro-batch losses (DeepSpeed's
    gradient-accumulation scaling does exactly that), or, for a global token mean, use
    ``stats.num_masked`` all-reduced instead.
    """
    _check(logits, targets, masked)
    B = targets.shape[0]
    if t.shape != (B,):
        raise ValueError(f"t has shape {tuple(t.shape)}, expected ({B},)")
    if bool((masked & ~maskable.to(torch.bool)).any()):
        raise ValueError("a masked position is not maskable (prompt or excluded padding was corrupted)")
    ce, rows = masked_cross_entropy(logits, targets, masked)
    tf = t.float()
    if weighting == "original":
        weight = 1.0 / tf[rows]
    elif weighting == "linear":
        weight = 1.0 - tf[rows]
    elif weighting == "cart":
        weight = cart_weights(masked if hidden is None else hidden, cart_p, valid)[masked]  # as ce
    elif weighting == "none":
        weight = torch.ones_like(ce)
    else:
        raise ValueError(f"weighting must be original, cart, linear or none; got {weighting!r}")
    loss = (ce * weight).sum() / ce.numel() if ce.numel() else _zero_like_graph(logits)
    return loss, _stats(ce, rows, t)
