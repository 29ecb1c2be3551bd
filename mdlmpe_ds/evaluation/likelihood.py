"""Conditional log-likelihood of a continuation given a context: the Monte-Carlo diffusion ELBO.

LLaDA's estimator (docs/models.md §3.3, ``get_log_likelihood.py``): the context is never masked; each
Monte-Carlo row masks k of the T continuation tokens (positions uniformly at random), with k
stratified over a batch (``linspace`` from a random start, wrapped into 1..T); a row contributes
``sum_masked CE * T / k`` and the estimate is ``-mean`` over rows. It lower-bounds log p(cont | ctx)
in expectation. With aligned logits (Dream's shift is applied inside the model) the same code serves
both families; Dream inputs should start with a BOS, which is part of the never-masked context.

Written here rather than reusing a training-ELBO module because lm-eval needs the *conditional*
form (context kept clean, stratified k over the continuation only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from mdlmpe_ds.diffusion.sampling import SamplerConfig, generate


def stratified_mask_counts(target_len: int, batch: int, generator: torch.Generator) -> torch.Tensor:
    """k for each of ``batch`` rows: k0 ~ U{1..T}, then ``stratified_from(k0, T, batch)``. [batch] long."""
    if target_len < 1:
        raise ValueError("the continuation is empty")
    k0 = int(torch.randint(1, target_len + 1, (), generator=generator))
    return stratified_from(k0, target_len, batch)


def stratified_from(k0: int, target_len: int, batch: int) -> torch.Tensor:
    """floor(k0 + i T/b + 1/2) for i = 0..b-1, wrapped into 1..T. [batch] long.

    LLaDA rounds with ``torch.round`` (ties to even), which maps two k0 to the same k when i T/b ends
    in .5, so a row's k is not uniform over 1..T and the estimator is slightly biased. Rounding half
    up gives k = k0 + const(i) (mod T): each row's k is uniform when k0 is, so the ELBO is unbiased.
    """
    offsets = torch.arange(batch, dtype=torch.float64) * (target_len / batch)  # [batch]
    x = k0 + torch.floor(offsets + 0.5).long()
    return ((x - 1) % target_len) + 1


@torch.no_grad()
def conditional_elbo(
    model: Callable[..., torch.Tensor],
    context: Sequence[int],
    continuation: Sequence[int],
    mask_id: int,
    generator: torch.Generator,
    mc_num: int = 128,
    batch_size: int = 32,
    trailing_masks: int = 0,
) -> float:
    """Monte-Carlo ELBO estimate of log p(continuation | context) (nats), ``mc_num`` rows in batches.

    ``model(ids [b, P+T+n], valid=None) -> aligned logits``. Randomness (k and the masked positions)
    comes from ``generator`` (CPU), so a request's estimate is reproducible. ``trailing_masks`` = n
    mask tokens follow the continuation in every row, never scored (later blocks not yet decoded).
    """
    if mc_num < 1 or batch_size < 1:
        raise ValueError(f"mc_num={mc_num} and batch_size={batch_size} must be >= 1")
    if mask_id in context or mask_id in continuation:
        raise ValueError(f"the context or continuation contains the mask token id {mask_id}")
    device = next(model.parameters()).device if isinstance(model, torch.nn.Module) else torch.device("cpu")
    P, T, n = len(context), len(continuation), int(trailing_masks)
    seq = torch.tensor([*context, *continuation, *[mask_id] * n], dtype=torch.long)  # [P+T+n]
    total, rows = 0.0, 0
    while rows < mc_num:
        b = min(batch_size, mc_num - rows)
        k = stratified_mask_counts(T, b, generator)  # [b]
        # 1. Mask k_i random continuation positions in row i; the context stays clean.
        ranks = torch.stack([torch.randperm(T, generator=generator) for _ in range(b)])  # [b, T]
        masked = torch.zeros(b, P + T + n, dtype=torch.bool)
        masked[:, P : P + T] = ranks < k[:, None]  # [b, P+T+n]
        noisy = torch.where(masked, torch.full_like(seq, mask_id), seq.expand(b, -1))
        # 2. Sum_masked CE * T / k per row (CE in fp32).
        logits = model(noisy.to(device))  # [b, P+T+n, V]
        rows_i, cols = masked.nonzero(as_tuple=True)
        ce = F.cross_entropy(
            logits[rows_i.to(device), cols.to(device)].float(), seq[cols].to(device), reduction="none"
        )
        weight = (T / k.to(torch.float64))[rows_i].to(device)  # [M]
        total += float((ce.double() * weight).sum())
        rows += b
    return -total / mc_num


def blockwise_elbo(
    model: Callable[..., torch.Tensor],
    context: Sequence[int],
    continuation: Sequence[int],
    mask_id: int,
    generator: torch.Generator,
    block_length: int,
    block_context: str = "full",
    mc_num: int = 128,
    batch_size: int = 32,
) -> float:
    """log p(continuation | context) as block diffusion factorises it: the sum over blocks of
    ``block_length`` tokens (counted from the continuation's start) of the conditional ELBO of a block
    given the context and the blocks before it (exact: log p(x) = sum_b log p(x_b | x_<b)).

    ``block_context``: ``full`` keeps the later blocks in the input as masks (LLaDA's semi-
    autoregressive decoding sees them so); ``blocked`` leaves them out (they are invisible).
    """
    if block_length < 1:
        raise ValueError(f"block_length must be >= 1, got {block_length}")
    if block_context not in ("full", "blocked"):
        raise ValueError(f"block_context must be 'full' or 'blocked', got {block_context!r}")
    T, total = len(continuation), 0.0
    for start in range(0, T, block_length):
        end = min(start + block_length, T)
        later = T - end if block_context == "full" else 0
        total += conditional_elbo(
            model,
            [*context, *continuation[:start]],
            continuation[start:end],
            mask_id,
            generator,
            mc_num,
            batch_size,
            trailing_masks=later,
        )
    return total


@torch.no_grad()
def greedy_matches(
    model: Callable[..., torch.Tensor],
    context: Sequence[int],
    continuation: Sequence[int],
    mask_id: int,
) -> bool:
    """Whether LLaDA-style greedy decoding (one token per step, low confidence, T = 0, one block)
    of ``len(continuation)`` tokens after ``context`` reproduces the continuation exactly."""

    T = len(continuation)
    config = SamplerConfig(gen_length=T, steps=T, algorithm="low_confidence", stop_at_eos=False)
    out = generate(model, [list(context)], config, mask_id=mask_id)  # EOS / pad ids from model.config
    return out.responses[0].tolist() == list(continuation)
