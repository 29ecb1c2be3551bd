"""Paired statistics of the benchmark against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mdlmpe_ds.evaluation.benchmark import stats


def test_mcnemar_exact_matches_hand_computed_binomial_tails():
    # 2 vs 10 discordant items: p = 2 * P(X <= 2), X ~ Bin(12, 1/2) = 2 * (1 + 12 + 66) / 4096.
    assert stats.mcnemar_exact(2, 10) == pytest.approx(158 / 4096, abs=1e-15)
    assert stats.mcnemar_exact(10, 2) == stats.mcnemar_exact(2, 10)  # symmetric
    # 0 vs 3: 2 * (1/8) = 0.25; 0 vs 5: 2/32.
    assert stats.mcnemar_exact(0, 3) == 0.25
    assert stats.mcnemar_exact(0, 5) == 2 / 32
    # balanced tables and no discordance: p = 1 (capped, never above).
    assert stats.mcnemar_exact(4, 4) == 1.0
    assert stats.mcnemar_exact(0, 0) == 1.0
    # large counts stay exact (integer arithmetic, no underflow): 400 vs 600.
    expected = 2 * sum(math.comb(1000, i) for i in range(401)) / 2**1000
    assert stats.mcnemar_exact(400, 600) == pytest.approx(expected, rel=1e-12)
    assert 0 < stats.mcnemar_exact(400, 600) < 1e-9
    with pytest.raises(ValueError):
        stats.mcnemar_exact(-1, 2)


def test_paired_counts_scores_and_pvalue_on_a_known_table():
    # both right 5, only A 2, only B 10, neither 3 (n = 20)
    a = [1] * 5 + [1] * 2 + [0] * 10 + [0] * 3
    b = [1] * 5 + [0] * 2 + [1] * 10 + [0] * 3
    r = stats.paired(a, b, resamples=2000, seed=3)
    assert (r.both, r.only_a, r.only_b, r.neither, r.n) == (5, 2, 10, 3, 20)
    assert (r.score_a, r.score_b) == (7 / 20, 15 / 20)
    assert r.diff == pytest.approx(0.4)
    assert r.mcnemar_p == pytest.approx(158 / 4096)
    assert r.ci_low <= r.diff <= r.ci_high
    # non-binary scores: interval yes, McNemar no
    r = stats.paired([0.5, 0.2], [0.1, 0.9], resamples=200)
    assert r.mcnemar_p is None and r.only_a is None
    with pytest.raises(ValueError, match="same items"):
        stats.paired([1, 0], [1])


def test_bootstrap_is_reproducible_and_close_to_the_normal_interval():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, 400)
    b = np.where(rng.random(400) < 0.8, a, 1 - a)  # 20% of items flipped
    first = stats.bootstrap_diff(a, b, resamples=4000, seed=11)
    assert stats.bootstrap_diff(a, b, resamples=4000, seed=11) == first  # same seed, same interval
    assert stats.bootstrap_diff(a, b, resamples=4000, seed=12) != first
    d = b - a
    half = 1.96 * d.std(ddof=0) / math.sqrt(d.size)  # the CLT interval the percentile one approaches
    assert first[0] == pytest.approx(d.mean() - half, abs=0.01)
    assert first[1] == pytest.approx(d.mean() + half, abs=0.01)
    assert stats.bootstrap_diff([1, 1, 0], [1, 1, 0], resamples=100) == (0.0, 0.0)  # no discordance


def test_bootstrap_interval_covers_the_true_difference_about_95_percent_of_the_time():
    """Coverage over 200 simulated paired benchmarks of 150 items with a true difference of +0.05."""
    rng = np.random.default_rng(1)
    hits, trials = 0, 200
    for t in range(trials):
        a = (rng.random(150) < 0.55).astype(float)
        flip_up = (
            rng.random(150) < 0.15
        )  # B right where A was wrong w.p. .15, wrong where A right w.p. ~.0727
        flip_down = rng.random(150) < 0.15 * 0.45 / 0.55 - 0.05 / 0.55
        b = np.where(a == 0, flip_up, ~flip_down).astype(float)
        true = 0.45 * 0.15 - 0.55 * (0.15 * 0.45 / 0.55 - 0.05 / 0.55)
        low, high = stats.bootstrap_diff(a, b, resamples=600, seed=t)
        hits += low <= true <= high
    assert true == pytest.approx(0.05)
    # Binomial(200, .95) sd ~ 3.1 items; the percentile interval runs slightly narrow at n = 150.
    assert 0.88 <= hits / trials <= 0.99, hits
