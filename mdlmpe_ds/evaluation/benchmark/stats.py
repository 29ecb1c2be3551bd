"""Paired statistics of two models scored on the same items.

Items are the independent units: both models answered the same documents with the same prompts, so
the per-item difference ``d_i = b_i - a_i`` carries everything. Its mean is the score difference;
resampling items (with replacement, the same resample for both models) gives a percentile bootstrap
interval in which the difficulty shared by both models cancels. For 0/1 scores, McNemar's exact
test looks only at the discordant items: under "no difference" each of the ``n01 + n10`` items
where exactly one model is right is equally likely to favour either, so ``min(n01, n10)`` is
Binomial(n01 + n10, 1/2) and the two-sided p-value is twice its lower tail (at most 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_RESAMPLES = 10_000


@dataclass(frozen=True)
class PairedResult:
    """Model B against model A on ``n`` shared items (scores in [0, 1]; accuracies for 0/1 items)."""

    n: int
    score_a: float
    score_b: float
    diff: float  # score_b - score_a
    ci_low: float  # percentile bootstrap interval of diff over items
    ci_high: float
    confidence: float
    resamples: int
    seed: int
    only_a: int  # items A got right and B did not (0/1 scores only; else None)
    only_b: int
    both: int
    neither: int
    mcnemar_p: float | None  # exact two-sided McNemar p (0/1 scores only)

    def to_dict(self) -> dict:
        return asdict(self)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (1.0 when there are none)."""
    if only_a < 0 or only_b < 0:
        raise ValueError(f"discordant counts must be >= 0, got {only_a}, {only_b}")
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1))  # exact integers: no underflow for large n
    return min(1.0, 2 * tail / 2**n)


def bootstrap_diff(
    a: Sequence[float],
    b: Sequence[float],
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile interval of mean(b - a) over item resamples; reproducible for a given seed."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)  # [n]
    if d.ndim != 1 or d.size == 0:
        raise ValueError("bootstrap_diff needs two equal-length, non-empty score lists")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 2**22 // d.size)  # bound the [chunk, n] index matrix to ~32 MiB
    for start in range(0, resamples, chunk):
        rows = min(chunk, resamples - start)
        idx = rng.integers(0, d.size, size=(rows, d.size))  # [rows, n]
        means[start : start + rows] = d[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(low), float(high)


def paired(
    a: Sequence[float],
    b: Sequence[float],
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
) -> PairedResult:
    """Scores, difference, bootstrap interval and (for 0/1 scores) McNemar counts and exact p."""
    if len(a) != len(b):
        raise ValueError(f"paired scores need the same items: {len(a)} vs {len(b)}")
    if not len(a):
        raise ValueError("no items to compare")
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    low, high = bootstrap_diff(x, y, resamples, confidence, seed)
    binary = bool(np.isin(x, (0.0, 1.0)).all() and np.isin(y, (0.0, 1.0)).all())
    counts = dict(only_a=None, only_b=None, both=None, neither=None)
    p = None
    if binary:
        counts = dict(
            only_a=int(((x == 1) & (y == 0)).sum()),
            only_b=int(((x == 0) & (y == 1)).sum()),
            both=int(((x == 1) & (y == 1)).sum()),
            neither=int(((x == 0) & (y == 0)).sum()),
        )
        p = mcnemar_exact(counts["only_a"], counts["only_b"])
    return PairedResult(
        n=len(x),
        score_a=float(x.mean()),
        score_b=float(y.mean()),
        diff=float(y.mean() - x.mean()),
        ci_low=low,
        ci_high=high,
        confidence=confidence,
        resamples=resamples,
        seed=seed,
        mcnemar_p=p,
        **counts,
    )
