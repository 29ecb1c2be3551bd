"""SFT head schedule (Eq. (27)) and the nested, evenly spread KV-head order (docs/method.md
"Head schedule")."""

from __future__ import annotations

import itertools

import pytest
import torch

from mdlmpe_ds.pe.heads import (
    activation_order,
    active_head_count,
    active_kv_heads,
    head_fraction,
    query_head_mask,
    scheduled_kv_heads,
)


@pytest.mark.parametrize(
    "progress,expected",
    [
        (0.0, 0.0),
        (0.05, 0.0),
        (0.1, 0.0),
        (0.15, 0.0625),
        (0.5, 0.5),
        (0.85, 0.9375),
        (0.3, 0.25),
        (0.9, 1.0),
        (1.0, 1.0),
    ],
)
def test_head_fraction_eq_sft_head_warmup(progress, expected):
    assert head_fraction(round(progress * 1000), 1000) == pytest.approx(expected)


def test_head_fraction_is_monotone_and_rejects_bad_total():
    values = [head_fraction(n, 97) for n in range(98)]
    assert values == sorted(values)
    with pytest.raises(ValueError):
        head_fraction(1, 0)


def test_activation_order_bit_reversal():
    assert activation_order(8) == [0, 4, 2, 6, 1, 5, 3, 7]
    assert activation_order(4) == [0, 2, 1, 3]
    assert activation_order(1) == [0]
    for n in (1, 3, 4, 5, 12, 28, 32):
        assert sorted(activation_order(n)) == list(range(n))


@pytest.mark.parametrize("num_heads", [4, 8, 12, 28, 32])
def test_prefixes_are_nested_and_evenly_spread(num_heads):
    previous = torch.zeros(num_heads, dtype=torch.bool)
    for count in range(num_heads + 1):
        mask = active_kv_heads(count, num_heads)
        assert int(mask.sum()) == count
        assert torch.all(mask[previous])  # a head never switches off as alpha grows
        previous = mask
        if count >= 2:
            chosen = mask.nonzero().flatten().tolist()
            gaps = [b - a for a, b in itertools.pairwise(chosen)] + [chosen[0] + num_heads - chosen[-1]]
            assert max(gaps) <= 2 * num_heads / count + 1  # roughly uniform over [0, H_kv - 1]


def test_scheduled_counts_hit_zero_half_all():
    total, heads = 100, 8
    assert int(scheduled_kv_heads(0, total, heads).sum()) == 0
    assert int(scheduled_kv_heads(9, total, heads).sum()) == 0
    assert int(scheduled_kv_heads(50, total, heads).sum()) == 4
    assert int(scheduled_kv_heads(90, total, heads).sum()) == 8
    assert active_head_count(0.0625, 8) == 1  # halves round up, not to even


def test_gqa_query_heads_follow_their_kv_head():
    kv = torch.tensor([True, False, False, True])
    assert query_head_mask(kv, 8).tolist() == [True, True, False, False, False, False, True, True]
    with pytest.raises(ValueError):
        query_head_mask(kv, 6)
