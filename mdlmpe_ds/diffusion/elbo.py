"""The diffusion-ELBO perplexity bound of a masked diffusion LM, by Monte-Carlo over the noise level.

Forward process (LLaDA's): draw ``t ~ U[0, 1]``, set ``p = (1 - eps) t + eps``, mask each valid
token independently with probability ``p``. The negative ELBO of a sequence ``x`` of ``L`` valid tokens is

    NLL(x) <= E_t E_{x_t}[ sum_{i masked} -log p_theta(x_i | x_t) / p ],

and the reported bound per token is ``sum_x E[...] / sum_x L`` (nats), with perplexity
``exp`` of it. A Monte-Carlo estimate uses ``num_samples`` draws of ``(t, mask)`` per sequence. The
draws depend only on ``(seed, data index, sample index)`` (``mdlmpe_ds.seeding.corruption_draws``)
so every model compared is scored on the same masks, whatever the batch size or padding.

Noise levels (``t_sampling``), all unbiased; samples form groups, each group's mean is one
independent replicate:

* ``"iid"``: every sample draws its own ``t`` (groups of 1);
* ``"antithetic"``: sample ``2j + 1`` uses ``1 - t`` of sample ``2j`` (groups of 2);
* ``"stratified"``: in each group of ``group_size`` samples, ``t_i = (t_0 + i / group_size) mod 1``
  (Dream's eval uses this low-discrepancy scheme with one group per sequence).

The mask uniforms of every sample are its own in all schemes.

Standard error: replicates are independent across sequences and within a sequence, so with
``R = num_samples / group`` replicates per sequence, ``Var(estimate) = sum_x Var_r(loss_x) / (R T^2)``
where ``T`` is the total number of valid tokens; ``Var_r`` is the unbiased sample variance over the sequence's
replicates. This is the Monte-Carlo error *given the evaluated sequences* (the quantity that
matters when comparing models on the same data); it does not include sampling of the corpus.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mdlmpe_ds.seeding import corruption_draws

ModelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ELBOResult:
    """A diffusion-ELBO estimate on one corpus."""

    nll_per_token: float  # upper bound on the NLL per token, nats
    stderr: float  # Monte-Carlo standard error of nll_per_token (module doc)
    num_tokens: int  # valid tokens scored
    num_sequences: int
    num_samples: int  # (t, mask) draws per sequence
    seed: int
    t_sampling: str

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_per_token)

    @property
    def perplexity_interval(self) -> tuple[float, float]:
        """exp(nll ± 2 stderr): an approximate 95% Monte-Carlo interval on the perplexity bound."""
        return math.exp(self.nll_per_token - 2 * self.stderr), math.exp(self.nll_per_token + 2 * self.stderr)


def align_shifted_logits(logits: torch.Tensor) -> torch.Tensor:
    """Dream-style logits (position ``i`` predicts token ``i + 1``) → aligned (``i`` predicts ``i``).

    Dream's own realignment: ``[logits[:, :1], logits[:, :-1]]`` (token 0 uses position 0's logits).
    """
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # [B, L, V]


def noise_level(t: torch.Tensor, eps: float) -> torch.Tensor:
    """Masking probability ``p = (1 - eps) t + eps`` of the LLaDA forward process."""
    return (1.0 - eps) * t + eps


T_SAMPLING = ("iid", "antithetic", "stratified")


def scored_positions(valid: torch.Tensor, family: str) -> torch.Tensor:
    """Positions a model of ``family`` can be scored on: every valid token; for Dream not position
    0, which its shifted logits cannot predict (docs/models.md §2.3). [B, L] bool."""
    scored = valid.clone()
    if family == "dream":
        scored[:, 0] = False
    return scored


def replicate_group(t_sampling: str, group_size: int) -> int:
    """Samples per independent replicate under ``t_sampling`` (module doc)."""
    if t_sampling == "iid":
        return 1
    if t_sampling == "antithetic":
        return 2
    if t_sampling == "stratified":
        if group_size < 2:
            raise ValueError(f"stratified t needs group_size >= 2, got {group_size}")
        return group_size
    raise ValueError(f"t_sampling={t_sampling!r}; expected one of {T_SAMPLING}")


@torch.no_grad()
def sequence_losses(
    model_fn: ModelFn,
    input_ids: torch.Tensor,
    valid: torch.Tensor,
    data_index: torch.Tensor,
    mask_id: int,
    num_samples: int,
    seed: int,
    *,
    eps: float = 1e-3,
    t_sampling: str = "iid",
    group_size: int = 8,
    shift: bool = False,
    maskable: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence, per-sample ELBO terms ``sum_{i masked} CE_i / p`` → float64 [B, num_samples].

    input_ids [B, L] long, valid [B, L] bool (padding False), data_index [B] long; ``maskable``
    [B, L] bool (default ``valid``): the scored positions, e.g. all but a Dream BOS at position 0,
    which its shifted logits cannot predict (docs/models.md §2.3).
    ``model_fn(masked_ids, valid) -> logits [B, L, V]`` aligned (``shift=True`` realigns Dream-style).
    """
    group = replicate_group(t_sampling, group_size)
    if num_samples % group:
        raise ValueError(
            f"t_sampling={t_sampling!r} needs num_samples divisible by {group}, got {num_samples}"
        )
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    B, L = input_ids.shape
    device = input_ids.device
    valid = valid.to(device=device, dtype=torch.bool)
    scored = (valid if maskable is None else maskable.to(device=device, dtype=torch.bool) & valid).cpu()
    out = torch.zeros(B, num_samples, dtype=torch.float64)
    t_first = None
    for k in range(num_samples):
        t, u = corruption_draws(seed, data_index, L, sample=k)  # [B], [B, L] float64
        if k % group == 0:
            t_first = t  # the group's own draw
        elif t_sampling == "antithetic":
            t = 1.0 - t_first
        else:  # stratified
            t = torch.remainder(t_first + (k % group) / group, 1.0)
        p = noise_level(t, eps)  # [B]
        masked = (u < p[:, None]) & scored  # [B, L]
        sel = masked.to(device)
        noisy = torch.where(sel, torch.full_like(input_ids, mask_id), input_ids)
        logits = model_fn(noisy, valid)
        if shift:
            logits = align_shifted_logits(logits)
        if logits.shape[:2] != (B, L):
            raise ValueError(
                f"model_fn returned logits of shape {tuple(logits.shape)}, expected ({B}, {L}, V)"
            )
        # CE at masked positions only, in fp32: a full [B, L, V] fp32 copy would not fit for big V.
        ce = F.cross_entropy(logits[sel].float(), input_ids[sel], reduction="none")  # [M]
        rows = sel.nonzero()[:, 0].cpu()  # [M] batch row of each masked position
        per_row = torch.zeros(B, dtype=torch.float64).index_add_(0, rows, ce.double().cpu())  # [B]
        out[:, k] = per_row / p
    return out


def diffusion_elbo(
    model_fn: ModelFn,
    batches: Iterable[dict],
    mask_id: int,
    num_samples: int,
    seed: int,
    *,
    eps: float = 1e-3,
    t_sampling: str = "iid",
    group_size: int = 8,
    shift: bool = False,
) -> ELBOResult:
    """Monte-Carlo diffusion-ELBO bound per token over ``batches`` (see the module doc).

    Each batch is a dict with ``input_ids`` [B, L]; optional ``valid`` [B, L] bool (default all
    True), ``maskable`` [B, L] bool (scored positions, default ``valid``) and ``index`` [B] (each
    sequence's data index; default: its running position in the stream of batches). The masks of a
    sequence depend only on ``(seed, index, sample)``; ``num_tokens`` counts the scored positions.
    """
    group = replicate_group(t_sampling, group_size)
    if num_samples < 2 * group:
        raise ValueError(
            f"num_samples={num_samples}: need >= 2 replicates of {group} samples for a standard error"
        )
    per_seq_sum = []  # [N] sum over replicates of the loss
    per_seq_var = []  # [N] sample variance over replicates
    num_tokens = 0
    seen = 0
    for batch in batches:
        ids = batch["input_ids"]
        valid = batch.get("valid")
        valid = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid.bool()
        index = batch.get("index")
        if index is None:
            index = torch.arange(seen, seen + ids.shape[0])
        seen += ids.shape[0]
        maskable = batch.get("maskable")
        scored = valid if maskable is None else valid & maskable.to(device=valid.device, dtype=torch.bool)
        losses = sequence_losses(
            model_fn, ids, valid, torch.as_tensor(index), mask_id, num_samples, seed,
            eps=eps, t_sampling=t_sampling, group_size=group_size, shift=shift, maskable=scored,
        )  # fmt: skip  # [B, K]
        reps = losses.view(ids.shape[0], num_samples // group, group).mean(-1)  # [B, R]
        per_seq_sum.append(reps.mean(dim=1))
        per_seq_var.append(reps.var(dim=1, unbiased=True) / reps.shape[1])
        num_tokens += int(scored.sum())
    if num_tokens == 0:
        raise ValueError("no valid tokens to score")
    means = torch.cat(per_seq_sum)
    var_of_means = torch.cat(per_seq_var)
    return ELBOResult(
        nll_per_token=float(means.sum() / num_tokens),
        stderr=float(var_of_means.sum().sqrt() / num_tokens),
        num_tokens=num_tokens,
        num_sequences=int(means.numel()),
        num_samples=num_samples,
        seed=seed,
        t_sampling=t_sampling,
    )
