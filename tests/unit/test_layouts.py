"""Corruption layouts (diffusion/layouts.py): iid is today's draw bit for bit; densities, block and
span structure; mix rows equal their layout's rows; keyed by (seed, window, sample) only; the
pretraining corruption passes the layout through and keeps the iid objective unchanged."""

from __future__ import annotations

import pytest
import torch

from mdlmpe_ds.diffusion.elbo import noise_level
from mdlmpe_ds.diffusion.layouts import (
    LAYOUTS,
    ROW_LAYOUTS,
    SEMI_AR_BLOCKS,
    corrupt_layout,
    default_span_mean,
    span_chain,
)
from mdlmpe_ds.seeding import corruption_draws
from mdlmpe_ds.tasks.pretrain import pretrain_corruption

L = 256


def _all(B: int = 64) -> torch.Tensor:
    return torch.ones(B, L, dtype=torch.bool)


def test_iid_is_the_pre_layout_draw_bit_for_bit():
    idx = torch.arange(10, 42)
    draw = corrupt_layout("iid", 7, idx, _all(32), sample=3, eps=1e-3)
    t, u = corruption_draws(7, idx, L, sample=3)
    p = noise_level(t, 1e-3)
    assert torch.equal(draw.masked, u < p[:, None])
    assert torch.equal(draw.scored, draw.masked) and bool(draw.scope.all())
    assert torch.equal(draw.p, p) and torch.equal(draw.t, t)
    # The trainer's corruption with the default layout: same masks, same p (fp32), all rows iid.
    ids = torch.randint(0, 100, (32, L))
    batch = {"input_ids": ids, "valid": torch.ones_like(ids, dtype=torch.bool), "index": idx, "epoch": 3}
    noisy, scored, p32 = pretrain_corruption(batch, 7, 1e-3, 999, "llada")
    assert torch.equal(scored, u < p[:, None]) and torch.equal(p32, p.float())
    assert torch.equal(noisy == 999, scored)


def test_semi_ar_clean_prefix_one_block_masked_tail():
    B = 200
    draw = corrupt_layout("semi_ar", 1, range(B), _all(B), eps=1e-3)
    sizes = set()
    for r in range(B):
        scope = draw.scope[r].nonzero().flatten()
        start, end = int(scope[0]), int(scope[-1]) + 1
        assert end - start == scope.numel()  # one contiguous block
        sizes.add(end - start)
        assert not draw.masked[r, :start].any()  # clean prefix
        assert draw.masked[r, end:].all()  # fully masked tail
        assert torch.equal(draw.scored[r], draw.masked[r] & draw.scope[r])
        assert not draw.scored[r, end:].any()  # the tail is input only
    assert sizes == set(SEMI_AR_BLOCKS)
    # Inside the block each token is masked with probability p: the block's realised density
    # tracks p (mean |error| of Bernoulli fractions of 16..64 tokens).
    frac = (draw.scored.sum(1) / draw.scope.sum(1)).double()
    assert (frac - draw.p).abs().mean() < 0.1
    assert abs(float((frac - draw.p).mean())) < 0.03


def test_spans_have_density_p_and_mean_length_sigma():
    sigma = default_span_mean(L)
    assert sigma == 12.0  # W = 48, sigma = W / 4 at L = 256
    gen = torch.Generator().manual_seed(0)
    n, length = 400, 4096
    for p_value in (0.3, 0.5, 0.8):
        u = torch.rand(n, length, generator=gen, dtype=torch.float64)
        masked = span_chain(u, torch.full((n,), p_value, dtype=torch.float64), sigma)
        assert abs(float(masked.double().mean()) - p_value) < 0.01
        # marginal at the first and a middle position: stationary from the start
        assert abs(float(masked[:, 0].double().mean()) - p_value) < 0.06
        # interior masked runs (not touching either end): mean length sigma
        runs = []
        for row in masked[:40]:
            edges = torch.diff(row.to(torch.int8), prepend=torch.tensor([0], dtype=torch.int8))
            starts = (edges == 1).nonzero().flatten().tolist()
            ends = (edges == -1).nonzero().flatten().tolist()
            runs += [e - s for s, e in zip(starts[1:], ends[1:]) if s > 0]
        assert abs(sum(runs) / len(runs) - sigma) < 1.5, p_value
    # Above sigma / (sigma + 1) the runs lengthen and the density stays p.
    u = torch.rand(n, length, generator=gen, dtype=torch.float64)
    masked = span_chain(u, torch.full((n,), 0.97, dtype=torch.float64), sigma)
    assert abs(float(masked.double().mean()) - 0.97) < 0.01


def test_spans_through_corrupt_layout_match_density_and_t():
    B = 256
    draw = corrupt_layout("spans", 3, range(B), _all(B), eps=1e-3)
    iid = corrupt_layout("iid", 3, range(B), _all(B), eps=1e-3)
    assert torch.equal(draw.t, iid.t) and torch.equal(draw.p, iid.p)  # matched density per window
    assert abs(float((draw.masked.double().mean(1) - draw.p).mean())) < 0.02
    assert bool(draw.scope.all()) and torch.equal(draw.scored, draw.masked)
    assert not torch.equal(draw.masked, iid.masked)


def test_mix_rows_equal_their_layouts_rows_and_proportions():
    B = 800
    mix = corrupt_layout("mix", 5, range(B), _all(B), sample=2)
    counts = torch.bincount(mix.kind, minlength=3).double() / B
    assert torch.allclose(counts, torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64), atol=0.05)
    for k, name in enumerate(ROW_LAYOUTS):
        own = corrupt_layout(name, 5, range(B), _all(B), sample=2)
        rows = mix.kind == k
        for field in ("masked", "scored", "scope", "p", "t"):
            assert torch.equal(getattr(mix, field)[rows], getattr(own, field)[rows]), (name, field)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_keyed_by_seed_window_sample_only(layout):
    a = corrupt_layout(layout, 11, [4, 9, 2, 30], _all(4), sample=1)
    b = corrupt_layout(layout, 11, [30, 2], _all(2), sample=1)  # another batch, other order
    assert torch.equal(a.masked[[3, 2]], b.masked) and torch.equal(a.p[[3, 2]], b.p)
    assert torch.equal(corrupt_layout(layout, 11, [4, 9, 2, 30], _all(4), sample=1).masked, a.masked)
    assert not torch.equal(corrupt_layout(layout, 11, [4, 9, 2, 30], _all(4), sample=2).masked, a.masked)
    # Non-maskable positions (a Dream BOS) are never masked nor scored.
    maskable = _all(4)
    maskable[:, 0] = False
    c = corrupt_layout(layout, 11, [4, 9, 2, 30], maskable, sample=1)
    assert not c.masked[:, 0].any() and not c.scope[:, 0].any()


def test_pretrain_corruption_semi_ar_weights_rows_per_scope_token():
    ids = torch.randint(0, 100, (8, L))
    idx = torch.arange(8)
    batch = {"input_ids": ids, "valid": torch.ones_like(ids, dtype=torch.bool), "index": idx, "epoch": 0}
    noisy, scored, p = pretrain_corruption(batch, 2, 1e-3, 999, "llada", "semi_ar")
    draw = corrupt_layout("semi_ar", 2, idx, _all(8))
    assert torch.equal(scored, draw.scored)
    assert bool(((noisy == 999) == draw.masked).all())
    # LLaDA's loss divides by B L: p scaled by block / L makes a row weigh as a per-block-token mean.
    assert torch.allclose(p.double(), draw.p * draw.scope.sum(1) / L)


def test_unknown_layout_is_rejected_by_name():
    with pytest.raises(ValueError, match="'blocks'"):
        corrupt_layout("blocks", 0, [0], _all(1))
    from mdlmpe_ds.config.cli import build_config

    with pytest.raises(ValueError, match=r"train\.corruption"):
        build_config(None, ["--corruption", "blocks"])
    assert build_config(None, ["--corruption", "mix"]).train.corruption == "mix"


def test_default_span_mean_is_the_default_mdlmpe_sigma():
    """The spans' mean length is sigma of MDLMPE's default window, written in diffusion/ so the
    corruption imports no position-encoding code: the two stay equal at every length."""
    from mdlmpe_ds.pe.config import MDLMPEConfig

    for length in (1, 2, 7, 16, 64, 100, 128, 256, 1000, 1024, 4096):
        assert default_span_mean(length) == float(MDLMPEConfig(max_seq_len=max(length, 2)).sigma), length
