"""Run-length infilling: a task where the mask layout is the only clue.

A row is a sequence of segments ``[SEP, L_k x k]`` with k uniform in 1..K, cut at the row length.
Token ids: 0 = SEP, k = L_k (1..K), K + 1 = the mask. Two maskings of the same rows:

* ``runs`` (the task): each run is masked as a whole with probability t (one t per row), SEPs stay
  visible. A masked token's answer k is the distance between the visible SEPs around it minus one,
  so the Bayes cross-entropy is 0, while a predictor blind to the layout can only use the
  size-biased distribution of k (a masked token sits in a run of length k with probability
  proportional to k): :func:`layout_blind_entropy`, 1.95 nats at K = 8. It is the SFT masking
  pattern (a whole span hidden) in miniature.
* ``iid`` (the control): every run token is masked independently with probability t, SEPs stay
  visible, and only masked tokens whose run keeps at least one visible token are scored: a visible
  L_k of the same run gives the answer, so the layout adds nothing a model could not copy.

Runs cut by the row end, or reaching it (no visible SEP after them), are never scored. Everything
is drawn from explicit generators, so a seed
fixes the rows, the masks and the evaluation set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SEP = 0
MASKINGS = ("runs", "iid")


@dataclass(frozen=True)
class Geometry:
    """Row length L and the largest run K of one study geometry."""

    length: int
    max_run: int

    @property
    def name(self) -> str:
        return f"L{self.length}-K{self.max_run}"

    @property
    def mask_id(self) -> int:
        return self.max_run + 1

    @property
    def vocab_size(self) -> int:
        return self.max_run + 2


# The study's two geometries, and a seconds-sized one for --toy and the tests.
GEOMETRIES = {g.name: g for g in (Geometry(64, 8), Geometry(128, 16), Geometry(16, 3))}


@dataclass
class Batch:
    """One batch of rows. ``clean``, ``ids`` (masked input), ``run_length`` (k of each position's
    run, 0 on SEPs), ``gap`` (length of the masked stretch a masked position sits in, 0 where
    visible: the oracle's feature): [B, L] long; ``scored`` [B, L] bool."""

    clean: torch.Tensor
    ids: torch.Tensor
    run_length: torch.Tensor
    gap: torch.Tensor
    scored: torch.Tensor


def layout_blind_entropy(max_run: int) -> float:
    """Entropy (nats) of k at a masked position for a predictor that cannot see the layout:
    p(k) = k / sum(1..K), the size-biased distribution."""
    total = max_run * (max_run + 1) / 2
    return -sum((k / total) * math.log(k / total) for k in range(1, max_run + 1))


def clean_rows(geometry: Geometry, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Clean rows [rows, L], the run length of every position (0 on SEPs) and whether its run is
    complete (not cut by the row end) [rows, L] bool."""
    length, kmax = geometry.length, geometry.max_run
    clean = torch.empty(rows, length, dtype=torch.long)
    run_length = torch.empty(rows, length, dtype=torch.long)
    complete = torch.empty(rows, length, dtype=torch.bool)
    # enough segments to fill any row: each is at least 2 tokens long
    draws = torch.randint(1, kmax + 1, (rows, length // 2 + 1), generator=generator)
    for r in range(rows):
        tokens, runs, whole = [], [], []
        for k in draws[r].tolist():
            # complete: the next SEP is inside the row (a run that reaches the row end might go on)
            fits = len(tokens) + 1 + k < length
            tokens += [SEP] + [k] * k
            runs += [0] + [k] * k
            whole += [True] + [fits] * k
            if len(tokens) >= length:
                break
        clean[r], run_length[r] = torch.tensor(tokens[:length]), torch.tensor(runs[:length])
        complete[r] = torch.tensor(whole[:length])
    return clean, run_length, complete


def _run_index(clean: torch.Tensor) -> torch.Tensor:
    """The index of each position's segment in its row (SEP and its run share one). [B, L]"""
    return torch.cumsum((clean == SEP).long(), dim=1)


def masked_stretch(masked: torch.Tensor) -> torch.Tensor:
    """Length of the maximal run of masked positions each masked position sits in, 0 where visible.
    masked [B, L] bool -> [B, L] long."""
    out = torch.zeros(masked.shape, dtype=torch.long)
    for r in range(masked.shape[0]):
        row, start = masked[r].tolist(), None
        for i, m in enumerate([*row, False]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                out[r, start:i] = i - start
                start = None
    return out


def make_batch(
    geometry: Geometry,
    masking: str,
    rows: int,
    generator: torch.Generator,
    t: torch.Tensor | None = None,
) -> Batch:
    """A batch of ``rows`` rows under ``masking`` (module doc); ``t`` [rows] the masking rates
    (default: uniform in [0.05, 1])."""
    if masking not in MASKINGS:
        raise ValueError(f"masking {masking!r}; expected one of {MASKINGS}")
    clean, run_length, complete = clean_rows(geometry, rows, generator)
    if t is None:
        t = 0.05 + 0.95 * torch.rand(rows, generator=generator)
    is_run = clean != SEP
    segment = _run_index(clean)  # [B, L]
    if masking == "runs":
        hide = torch.rand(rows, geometry.length // 2 + 2, generator=generator) < t[:, None]  # per segment
        masked = hide.gather(1, segment) & is_run
        scored = masked & complete
    else:
        masked = (torch.rand(rows, geometry.length, generator=generator) < t[:, None]) & is_run
        visible_run = (is_run & ~masked).long()
        seen = torch.zeros(rows, geometry.length + 2, dtype=torch.long).scatter_add_(1, segment, visible_run)
        scored = masked & complete & (seen.gather(1, segment) > 0)
    ids = clean.masked_fill(masked, geometry.mask_id)
    return Batch(clean, ids, run_length, masked_stretch(masked), scored)


def eval_batches(geometry: Geometry, masking: str, rows: int, batch: int, seed: int) -> list[Batch]:
    """The fixed evaluation set: ``rows`` rows from ``seed``, with rates t on an even grid over
    (0, 1] so every rate is represented alike, split into batches of ``batch`` rows."""
    generator = torch.Generator().manual_seed(seed)
    rates = (torch.arange(rows, dtype=torch.float32) + 1.0) / rows
    rates = rates[torch.randperm(rows, generator=generator)]
    return [
        make_batch(geometry, masking, min(batch, rows - s), generator, rates[s : s + batch])
        for s in range(0, rows, batch)
    ]
