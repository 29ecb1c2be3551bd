"""Structured corruption layouts for masked-diffusion pretraining and evaluation.

Every layout is drawn from the generator of ``(seed, window index, sample)``
(``seeding.generator``; ``sample`` is the epoch in training, the draw index in
evaluation) in one fixed order: ``t``, then one uniform ``u`` per position, then three structure
uniforms ``s``. So the ``iid`` layout is bit for bit the forward process of
``tasks.pretrain.pretrain_corruption`` before layouts existed, and the same window and sample get
the same ``t`` (matched density) under every layout and for every model compared.
With ``p = (1 - eps) t + eps``:

* ``iid``: each scorable token masked iff ``u_i < p`` (LLaDA's forward process);
* ``semi_ar``: a clean prefix, one active block of ``B`` tokens (``B`` in ``SEMI_AR_BLOCKS`` picked
  by ``s1``, clipped to the row; its start uniform by ``s2``) masked iff ``u_i < p``, and every token
  after the block masked. The row scores the block only: a block-diffusion term of
  ``log p(block | prefix)``;
* ``spans``: a two-state Markov chain over positions driven by ``u`` (start masked iff ``u_0 < p``;
  a masked run ends with probability ``a = 1 / span_mean``, an unmasked run ends with probability
  ``b = a p / (1 - p)``). Its stationary masked fraction is exactly ``p`` at every position and
  masked runs have mean length ``span_mean`` (``sigma`` of MDLMPE's window by default); when
  ``b`` would exceed 1 (``p > span_mean / (span_mean + 1)``) ``b = 1`` and ``a = (1 - p) / p``,
  which keeps the density at ``p`` with longer spans;
* ``mix``: per row, ``iid`` / ``semi_ar`` / ``spans`` with probabilities ``MIX_WEIGHTS`` by ``s0``.
  A mix row is identical to the same window's draw under its chosen layout.

Loss weight (stated and tested): every scored token is weighted by ``1 / p``, where ``p`` is the
probability that a token of the row's *scope* is masked (scope: all scorable positions for
``iid`` and ``spans``, the active block for ``semi_ar``); ``p`` is each scope token's marginal mask
probability under all three layouts. Dividing ``sum_scored CE / p`` by the scope size is then an
unbiased estimate of the mean conditional CE of a scope token given the layout's context. For
``iid``, and for the ``semi_ar`` block (i.i.d. inside the block), it is the diffusion ELBO per
token; for ``spans`` it is a span-infilling cross-entropy (masks inside a row are correlated, so
it is no longer a bound on ``-log p(x)``). The realised mask fraction is not used: it would
correlate the weight with the draw and make ``iid`` differ from today's objective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from mdlmpe_ds.diffusion.elbo import noise_level
from mdlmpe_ds.seeding import generator

LAYOUTS = ("iid", "semi_ar", "spans", "mix")
ROW_LAYOUTS = ("iid", "semi_ar", "spans")  # what one row can be (mix picks one of these)
MIX_WEIGHTS = (0.5, 0.25, 0.25)
SEMI_AR_BLOCKS = (16, 32, 64)


class LayoutDraw(NamedTuple):
    """One layout draw for a batch. All CPU tensors.

    masked [B, L] bool: positions written as the mask token (the model input);
    scored [B, L] bool: masked positions that carry loss (``masked & scope``);
    scope [B, L] bool: positions whose NLL the row estimates;
    p [B] float64: mask probability of a scope token (the 1/p weight);
    t [B] float64: the noise draw (before the eps floor);
    kind [B] long: index into ``ROW_LAYOUTS`` of each row's layout.
    """

    masked: torch.Tensor
    scored: torch.Tensor
    scope: torch.Tensor
    p: torch.Tensor
    t: torch.Tensor
    kind: torch.Tensor


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"corruption layout {layout!r}; expected one of {LAYOUTS}")
    return layout


# MDLMPE's default window (pe/config.py: window_ratio 3/16, rho 1/4), whose sigma is the spans'
# mean length. Written here so the corruption needs no position-encoding code; a unit test keeps
# the two equal (tests/unit/test_layouts.py).
SPAN_WINDOW_RATIO = 3 / 16
SPAN_RHO = 0.25


def default_span_mean(length: int) -> float:
    """sigma of MDLMPE's default Gaussian window for L_ref = ``length``: W = round(3L/16),
    sigma = max(W/4, 1) (paper Eq. (2))."""
    window = math.floor(SPAN_WINDOW_RATIO * max(int(length), 2) + 0.5)
    return float(max(SPAN_RHO * window, 1.0))


def layout_draws(
    seed: int, data_indices: Sequence[int] | torch.Tensor, length: int, sample: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` [B], ``u`` [B, length], ``s`` [B, 3] (float64, CPU) of each window, in that order from
    ``seeding.generator(seed, index, sample)``: ``t`` and ``u`` equal ``seeding.corruption_draws``."""
    idx = data_indices.tolist() if isinstance(data_indices, torch.Tensor) else list(data_indices)
    t = torch.empty(len(idx), dtype=torch.float64)
    u = torch.empty(len(idx), length, dtype=torch.float64)
    s = torch.empty(len(idx), 3, dtype=torch.float64)
    for row, i in enumerate(idx):
        g = generator(seed, int(i), sample)
        t[row] = torch.rand((), generator=g, dtype=torch.float64)
        u[row] = torch.rand(length, generator=g, dtype=torch.float64)
        s[row] = torch.rand(3, generator=g, dtype=torch.float64)
    return t, u, s


def span_chain(u: torch.Tensor, p: torch.Tensor, span_mean: float) -> torch.Tensor:
    """Masked spans from uniforms ``u`` [B, L] at density ``p`` [B] (module doc). [B, L] bool."""
    if span_mean < 1.0:
        raise ValueError(f"span_mean must be >= 1, got {span_mean}")
    p = p.to(torch.float64)
    a = torch.full_like(p, 1.0 / span_mean)  # P(masked -> unmasked)
    full = p >= 1.0
    b = torch.where(full, torch.ones_like(p), a * p / (1.0 - p).clamp(min=1e-300))  # P(unmasked -> masked)
    long = b > 1.0
    a = torch.where(long, (1.0 - p) / p, a)
    b = torch.where(long, torch.ones_like(b), b)
    a = torch.where(full, torch.zeros_like(a), a)
    out = torch.empty(u.shape, dtype=torch.bool)
    state = u[:, 0] < p  # [B] stationary start
    out[:, 0] = state
    for i in range(1, u.shape[1]):
        state = torch.where(state, u[:, i] < 1.0 - a, u[:, i] < b)
        out[:, i] = state
    return out


def corrupt_layout(
    layout: str,
    seed: int,
    data_indices: Sequence[int] | torch.Tensor,
    maskable: torch.Tensor,
    sample: int = 0,
    *,
    eps: float = 1e-3,
    t: torch.Tensor | None = None,
    span_mean: float | None = None,
) -> LayoutDraw:
    """The ``layout`` masks of each window (module doc). ``maskable`` [B, L] bool: positions that
    may be masked and scored (e.g. not a Dream BOS). ``t`` [B] overrides the noise draw (antithetic
    or stratified evaluation); the structure draws stay the window's own."""

    check_layout(layout)
    maskable = maskable.to(device="cpu", dtype=torch.bool)
    B, L = maskable.shape
    t_draw, u, s = layout_draws(seed, data_indices, L, sample)
    if t is not None:
        t_draw = t.to(torch.float64).cpu()
    p = noise_level(t_draw, eps)  # [B] float64
    if layout == "mix":
        edges = torch.tensor(MIX_WEIGHTS, dtype=torch.float64).cumsum(0)[:-1]
        kind = torch.bucketize(s[:, 0].contiguous(), edges, right=True)  # [B] 0 iid, 1 semi_ar, 2 spans
    else:
        kind = torch.full((B,), ROW_LAYOUTS.index(layout), dtype=torch.long)
    iid = u < p[:, None]  # [B, L]
    masked = iid.clone()
    scope = torch.ones(B, L, dtype=torch.bool)
    semi = kind == 1
    if bool(semi.any()):
        pos = torch.arange(L)
        choice = (s[:, 1] * len(SEMI_AR_BLOCKS)).long().clamp(max=len(SEMI_AR_BLOCKS) - 1)
        block = torch.tensor(SEMI_AR_BLOCKS)[choice].clamp(max=L)  # [B]
        start = (s[:, 2] * (L - block + 1)).long().clamp(max=L - block)  # [B]
        in_block = (pos >= start[:, None]) & (pos < (start + block)[:, None])  # [B, L]
        after = pos >= (start + block)[:, None]
        scope = torch.where(semi[:, None], in_block, scope)
        masked = torch.where(semi[:, None], (in_block & iid) | after, masked)
    spans = kind == 2
    if bool(spans.any()):
        mean = default_span_mean(L) if span_mean is None else float(span_mean)
        masked[spans] = span_chain(u[spans], p[spans], mean)
    masked &= maskable
    scope &= maskable
    return LayoutDraw(masked, masked & scope, scope, p, t_draw, kind)
