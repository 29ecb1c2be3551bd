"""The per-step rules of masked-diffusion samplers: how many tokens to reveal, what to propose, how sure.

Pure functions, used by ``sampling.generate`` (docs/models.md §4):

- transfer schedules: how many masked tokens a block reveals at each of its steps;
  ``linear_transfer_counts`` is LLaDA's ``get_num_transfer_tokens`` (equal shares, remainder on the
  first steps), ``dream_transfer_counts`` is Dream's ``int(m * (1 - s/t))`` on
  ``t = linspace(1, eps, steps + 1)`` with everything left revealed at the last step;
- proposals: a candidate token and a confidence for every position of the active block. LLaDA
  (``low_confidence`` / ``random``): Gumbel-max at temperature T in float64, confidence = the
  softmax probability of the candidate (or a uniform draw). Dream (``maskgit_plus`` / ``margin`` /
  ``entropy``): temperature, top-p, top-k, then a categorical draw (argmax at T = 0); confidence =
  top-1 probability, top-1 minus top-2, or negative entropy;
- ``select_positions``: the k most confident eligible positions per row (or Dream's ``alg_temp``
  draw without replacement); ``origin_positions``: Dream's ``origin`` rule, each masked position
  revealed independently with probability 1 - s/t (so the count per step is random).

All randomness comes from one ``torch.Generator`` per batch row, drawn in a shape that depends only on
that row's block, so a row gives the same tokens alone or inside any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

LLADA_ALGORITHMS = ("low_confidence", "random")
DREAM_ALGORITHMS = ("maskgit_plus", "margin", "entropy", "origin")
ALGORITHM_ALIASES = {"top_prob": "maskgit_plus", "topk_margin": "margin"}
ALGORITHMS = LLADA_ALGORITHMS + DREAM_ALGORITHMS + tuple(ALGORITHM_ALIASES)
SCHEDULES = ("linear", "dream")


def canonical_algorithm(name: str) -> str:
    """The algorithm's canonical name (``top_prob`` -> ``maskgit_plus``, ``topk_margin`` -> ``margin``)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown sampling algorithm {name!r}; choose one of {ALGORITHMS}")
    return ALGORITHM_ALIASES.get(name, name)


# ------------------------------------------------------------------------------------ schedules
def linear_transfer_counts(num_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's schedule: ``num_masked // steps`` per step, the remainder one each on the first steps.

    num_masked [B] long -> counts [B, steps] long, each row summing to its ``num_masked``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    base = num_masked // steps  # [B]
    rem = num_masked % steps  # [B]
    k = torch.arange(steps, device=num_masked.device)  # [steps]
    return base[:, None] + (k[None, :] < rem[:, None]).long()  # [B, steps]


def dream_transfer_counts(num_masked: torch.Tensor, steps: int, eps: float = 1e-3) -> torch.Tensor:
    """Dream's schedule: at step k (t = t_k, s = t_{k+1}, t = linspace(1, eps, steps+1)) reveal
    ``int(m * (1 - s/t))`` of the m still-masked tokens, and all that are left at the last step.

    Dream uses the batch-average masked count; here m is the row's own count so that a row's output
    does not depend on what else is in the batch. num_masked [B] long -> counts [B, steps] long.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    t = torch.linspace(1.0, eps, steps + 1, dtype=torch.float64)  # [steps+1]
    remaining = num_masked.to(torch.float64).cpu()  # [B]
    counts = torch.zeros(num_masked.shape[0], steps, dtype=torch.long)
    for k in range(steps):
        if k == steps - 1:
            c = remaining.clone()
        else:
            c = torch.floor(remaining * (1.0 - t[k + 1] / t[k]))
        counts[:, k] = c.long()
        remaining = remaining - c
    return counts.to(num_masked.device)


def transfer_counts(num_masked: torch.Tensor, steps: int, schedule: str, eps: float = 1e-3) -> torch.Tensor:
    """Dispatch on ``schedule`` ('linear' | 'dream'); [B] -> [B, steps]."""
    if schedule == "linear":
        return linear_transfer_counts(num_masked, steps)
    if schedule == "dream":
        return dream_transfer_counts(num_masked, steps, eps)
    raise ValueError(f"unknown transfer schedule {schedule!r}; choose one of {SCHEDULES}")


# ------------------------------------------------------------------------------------ proposals
class Proposal(NamedTuple):
    """Candidate tokens ``x0`` [B, N] long and their confidence [B, N] float (higher = surer)."""

    x0: torch.Tensor
    confidence: torch.Tensor


def _row_uniform(
    generators: Sequence[torch.Generator], shape: tuple[int, ...], device, dtype
) -> torch.Tensor:
    """One U[0, 1) draw of ``shape`` per row, each from that row's generator; [B, *shape]."""
    draws = [torch.rand(shape, generator=g, device=g.device, dtype=dtype) for g in generators]
    return torch.stack(draws).to(device)


def llada_proposal(
    logits: torch.Tensor,
    algorithm: str,
    temperature: float,
    generators: Sequence[torch.Generator],
) -> Proposal:
    """LLaDA ``generate()``: Gumbel-max in float64 and ``low_confidence`` / ``random`` confidence.

    logits [B, N, V]. LLaDA writes the draw as ``argmax exp(l) / (-log U)^T``; taking logs gives
    ``argmax l - T log(-log U)``, the same argmax without overflowing ``exp`` for logits > 709, so
    that form is used (float64 as upstream). T = 0 is plain argmax and draws no Gumbel noise.
    Confidence (``low_confidence``) is the untempered softmax probability of the candidate.
    """
    logits64 = logits.to(torch.float64)  # [B, N, V]
    if temperature > 0:
        u = _row_uniform(generators, tuple(logits.shape[1:]), logits.device, torch.float64)  # [B, N, V]
        x0 = torch.argmax(logits64 - temperature * torch.log(-torch.log(u)), dim=-1)  # [B, N]
    else:
        x0 = torch.argmax(logits64, dim=-1)  # [B, N]
    if algorithm == "low_confidence":
        probs = torch.softmax(logits64, dim=-1)  # [B, N, V]
        confidence = torch.gather(probs, -1, x0[..., None]).squeeze(-1)  # [B, N]
    elif algorithm == "random":
        confidence = _row_uniform(generators, (logits.shape[1],), logits.device, torch.float64)  # [B, N]
    else:
        raise ValueError(f"llada_proposal: algorithm must be one of {LLADA_ALGORITHMS}, got {algorithm!r}")
    return Proposal(x0, confidence)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter as in Dream's ``top_p_logits``: drop tokens once the cumulative probability of
    the higher ones exceeds ``top_p`` (the top token always stays). [..., V] -> [..., V]."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    drop_sorted = cumulative > top_p
    drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, torch.finfo(logits.dtype).min)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest logits of each row. [..., V] -> [..., V]."""
    top_k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def dream_proposal(
    logits: torch.Tensor,
    algorithm: str,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    generators: Sequence[torch.Generator],
) -> Proposal:
    """Dream ``sample_tokens``: temperature, top-p, top-k, categorical draw (argmax at T = 0).

    logits [B, N, V]. Confidence is computed from the filtered, tempered distribution p:
    ``maskgit_plus`` = p(x0), ``margin`` = p_(1) - p_(2), ``entropy`` = sum_v p log p (negative
    entropy, higher = surer). Computed in fp32.
    """
    work = logits.float()  # [B, N, V]
    if temperature > 0:
        work = work / temperature
    if top_p is not None and top_p < 1.0:
        work = top_p_filter(work, top_p)
    if top_k is not None:
        work = top_k_filter(work, top_k)
    probs = torch.softmax(work, dim=-1)  # [B, N, V]
    if temperature > 0:
        draws = [
            torch.multinomial(probs[r].to(g.device), 1, generator=g).squeeze(-1)
            for r, g in enumerate(generators)
        ]
        x0 = torch.stack(draws).to(logits.device)  # [B, N]
        top1 = torch.gather(probs, -1, x0[..., None]).squeeze(-1)  # [B, N]
    else:
        top1, x0 = probs.max(dim=-1)  # [B, N]
    if algorithm in ("maskgit_plus", "origin"):  # origin does not rank; its confidence is unused
        confidence = top1
    elif algorithm == "margin":
        best2 = torch.topk(probs, 2, dim=-1).values  # [B, N, 2]
        confidence = best2[..., 0] - best2[..., 1]
    elif algorithm == "entropy":
        confidence = (probs * torch.log(probs + 1e-10)).sum(-1)  # [B, N]
    else:
        raise ValueError(f"dream_proposal: algorithm must be one of {DREAM_ALGORITHMS}, got {algorithm!r}")
    return Proposal(x0, confidence)


# ------------------------------------------------------------------------------------ selection
def select_positions(
    confidence: torch.Tensor,
    eligible: torch.Tensor,
    counts: torch.Tensor,
    alg_temp: float = 0.0,
    generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """Which positions to reveal: per row the ``counts[r]`` most confident eligible positions.

    confidence [B, N] float, eligible [B, N] bool, counts [B] long -> [B, N] bool with exactly
    ``counts[r]`` True per row, all eligible. Ties break by position (stable sort). With
    ``alg_temp > 0`` (Dream), the positions are drawn without replacement from
    softmax(confidence / alg_temp) over the eligible ones instead.
    """
    if bool((counts > eligible.sum(-1)).any()):
        raise ValueError(
            f"cannot reveal {counts.tolist()} tokens with only {eligible.sum(-1).tolist()} eligible positions"
        )
    B, N = confidence.shape
    conf = confidence.to(torch.float64).masked_fill(~eligible, float("-inf"))  # [B, N]
    chosen = torch.zeros(B, N, dtype=torch.bool, device=confidence.device)
    if alg_temp > 0:
        if generators is None:
            raise ValueError("select_positions: alg_temp > 0 needs the per-row generators")
        for r, g in enumerate(generators):
            k = int(counts[r])
            if k == 0:
                continue
            weights = torch.softmax(conf[r] / alg_temp, dim=-1)  # [N], 0 on ineligible
            # An eligible position whose weight underflowed must stay drawable (k <= eligible count).
            weights = torch.where(eligible[r], weights.clamp_min(1e-300), torch.zeros_like(weights))
            picked = torch.multinomial(weights.to(g.device), k, replacement=False, generator=g)
            chosen[r, picked.to(chosen.device)] = True
        return chosen
    order = torch.argsort(conf, dim=-1, descending=True, stable=True)  # [B, N]
    rank_ok = torch.arange(N, device=confidence.device)[None, :] < counts[:, None]  # [B, N]
    return chosen.scatter(1, order, rank_ok)


def origin_positions(
    eligible: torch.Tensor, step: int, steps: int, eps: float, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """Dream's ``origin``: each eligible position is revealed with probability 1 - s/t, where
    t = linspace(1, eps, steps+1)[step], s the next one; every eligible position at the last step.

    eligible [B, N] bool -> [B, N] bool. One U[0, 1) per position from the row's generator.
    """
    if step == steps - 1:
        return eligible.clone()
    t = torch.linspace(1.0, eps, steps + 1, dtype=torch.float64)
    p = float(1.0 - t[step + 1] / t[step])
    u = _row_uniform(generators, (eligible.shape[1],), eligible.device, torch.float64)  # [B, N]
    return eligible & (u < p)
