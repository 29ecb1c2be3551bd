"""Corruption (masks, noise levels, seeding) and the LLaDA / Dream losses against loop restatements."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mdlmpe_ds.diffusion.corruption import corrupt, noise_generator, sample_t
from mdlmpe_ds.diffusion.losses import (
    T_BUCKETS,
    cart_weights,
    dream_sft_loss,
    llada_pretrain_loss,
    llada_sft_loss,
)
from mdlmpe_ds.pe.availability import availability
from mdlmpe_ds.seeding import mix_seed

MASK_ID = 99


def _batch(B=4, L=24, seed=0):
    """Clean ids in [0, 50), prompt lengths 3..8, all positions valid (EOS pads attended)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (B, L), generator=g)
    prompt_len = torch.randint(3, 9, (B,), generator=g)
    prompt = torch.arange(L)[None, :] < prompt_len[:, None]
    return ids, prompt, ~prompt


# ---------------------------------------------------------------------------------------------- corruption


def test_prompt_never_masked_over_many_draws():
    ids, prompt, maskable = _batch()
    maskable[0, -3:] = False  # excluded padding (attend_padding=False) must not be masked either
    ever = torch.zeros_like(maskable)
    for step in range(300):
        c = corrupt(ids, maskable, MASK_ID, noise_generator(1, 0, step))
        assert not (c.masked & ~maskable).any()
        assert torch.equal(c.noisy_ids[~c.masked], ids[~c.masked])
        assert (c.noisy_ids[c.masked] == MASK_ID).all()
        assert torch.equal(c.noisy_ids[prompt], ids[prompt])
        ever |= c.masked
    assert torch.equal(ever, maskable)  # every maskable token is masked at some draw


def test_mask_rate_matches_p_and_t_range():
    B, L = 4, 20000
    ids = torch.zeros(B, L, dtype=torch.long)
    maskable = torch.ones(B, L, dtype=torch.bool)
    t = torch.tensor([0.05, 0.3, 0.7, 1.0])
    c = corrupt(ids, maskable, MASK_ID, noise_generator(0, 0, 0), t=t)
    rate = c.masked.float().mean(dim=1)
    tol = 5 * torch.sqrt(t * (1 - t) / L) + 1e-6
    assert ((rate - t).abs() <= tol).all(), (rate, t)
    assert torch.equal(c.p_mask, t)

    eps = 0.2
    draws = torch.cat([sample_t(1000, noise_generator(3, 0, s), eps) for s in range(4)])
    assert draws.min() >= eps and draws.max() < 1.0
    assert abs(draws.mean().item() - (1 + eps) / 2) < 5 * (1 - eps) / math.sqrt(12 * draws.numel())
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        corrupt(ids, maskable, MASK_ID, noise_generator(0, 0, 0), t=torch.tensor([0.0, 0.5, 0.5, 0.5]))


def test_noise_is_a_function_of_seed_rank_step():
    ids, _, maskable = _batch(L=64)

    def masks(seed, rank, step):
        return corrupt(ids, maskable, MASK_ID, noise_generator(seed, rank, step)).masked

    assert torch.equal(masks(7, 1, 5), masks(7, 1, 5))
    assert not torch.equal(masks(7, 1, 5), masks(7, 0, 5))
    assert not torch.equal(masks(7, 1, 5), masks(7, 1, 6))
    assert not torch.equal(masks(7, 1, 5), masks(8, 1, 5))
    assert mix_seed(1, 2, 3) != mix_seed(2, 1, 3)
    assert len({mix_seed(0, r, s) for r in range(8) for s in range(64)}) == 8 * 64
    assert 0 <= mix_seed(2**70, 5) < 2**63


def test_availability_from_corrupted_input():
    ids, prompt, maskable = _batch()
    valid = torch.ones_like(prompt)
    valid[1, -4:] = False  # padding excluded from attention
    maskable &= valid
    c = corrupt(ids, maskable, MASK_ID, noise_generator(0, 0, 1), t=torch.full((4,), 0.5))
    b, a = availability(c.noisy_ids, MASK_ID, valid)
    revealed = maskable & ~c.masked
    assert torch.equal(b.bool(), (prompt | revealed) & valid)
    assert (b[c.masked] == 0).all() and (b[prompt] == 1).all()
    assert torch.equal(a.bool(), valid)


# ---------------------------------------------------------------------------------------------- losses


def _loss_case(B=3, L=10, V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (B, L), generator=g)
    prompt_len = torch.tensor([2, 4, 3])
    maskable = torch.arange(L)[None, :] >= prompt_len[:, None]
    masked = (torch.rand(B, L, generator=g) < 0.5) & maskable
    masked[0, 5] = True  # at least one masked token per row
    masked[2, 9] = True
    t = torch.tensor([0.25, 0.6, 0.9])
    return logits, targets, masked, maskable, t


def _ce(logits, targets, b, i):
    return -torch.log_softmax(logits[b, i].double(), dim=-1)[targets[b, i]].item()


def test_llada_sft_loss_matches_loop():
    logits, targets, masked, maskable, t = _loss_case()
    answer_len = maskable.sum(1)
    loss, stats = llada_sft_loss(logits, targets, masked, t, answer_len)
    B, L = targets.shape
    expected = 0.0
    for b in range(B):
        for i in range(L):
            if masked[b, i]:
                expected += _ce(logits, targets, b, i) / t[b].item() / answer_len[b].item()
    expected /= B
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert int(stats.num_masked) == int(masked.sum())
    loss.backward()
    assert logits.grad[~masked].abs().max() == 0 and logits.grad[masked].abs().sum() > 0


def test_llada_pretrain_loss_matches_loop():
    logits, targets, masked, _, t = _loss_case(seed=1)
    loss, _ = llada_pretrain_loss(logits, targets, masked, t)
    B, L = targets.shape
    expected = sum(
        _ce(logits, targets, b, i) / t[b].item() for b in range(B) for i in range(L) if masked[b, i]
    ) / (B * L)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def _cart_loop(masked, p, valid):
    B, L = masked.shape
    w = torch.zeros(B, L, dtype=torch.float64)
    for b in range(B):
        for i in range(L):
            for j in range(L):
                if j != i and not masked[b, j] and valid[b, j]:
                    w[b, i] += 0.5 * p * (1 - p) ** (abs(i - j) - 1)
    return w


def test_cart_weights_match_double_loop():
    g = torch.Generator().manual_seed(3)
    masked = torch.rand(3, 17, generator=g) < 0.6
    valid = torch.ones_like(masked)
    valid[2, -5:] = False
    for p in (0.1, 0.3, 1.0):
        got = cart_weights(masked, p, valid).double()
        assert torch.allclose(got, _cart_loop(masked, p, valid), rtol=1e-5, atol=1e-7)
    # Long sequence, masked run in the middle: weights span ~0.15 down to ~1e-12; the FFT path must
    # not wrap around (a circular convolution would leak context from the far end).
    long = torch.zeros(2, 160, dtype=torch.bool)
    long[:, 10:150] = True
    long[1, :10] = True
    got = cart_weights(long, 0.3).double()
    ref = _cart_loop(long, 0.3, torch.ones_like(long))
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-13)


@pytest.mark.parametrize("weighting", ["original", "linear", "none", "cart"])
def test_dream_sft_loss_matches_loop(weighting):
    logits, targets, masked, maskable, t = _loss_case(seed=2)
    valid = torch.ones_like(masked)
    loss, stats = dream_sft_loss(logits, targets, masked, t, maskable, weighting=weighting, cart_p=0.2)
    cart = _cart_loop(masked, 0.2, valid)
    B, L = targets.shape
    total, count = 0.0, 0
    for b in range(B):
        for i in range(L):
            if masked[b, i]:
                w = {"original": 1 / t[b].item(), "linear": 1 - t[b].item(), "none": 1.0}.get(
                    weighting, cart[b, i].item()
                )
                total += w * _ce(logits, targets, b, i)
                count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
    assert int(stats.num_masked) == count


def test_loss_stats_buckets_and_empty_batch():
    logits, targets, masked, maskable, t = _loss_case()
    _, stats = dream_sft_loss(logits, targets, masked, t, maskable)
    assert stats.bucket_count.shape == (T_BUCKETS,)
    assert stats.bucket_count.sum().item() == masked.sum().item()
    assert stats.bucket_nll.sum().item() == pytest.approx(stats.nll_sum.item(), rel=1e-6)
    for b, bucket in enumerate([2, 6, 9]):  # t = 0.25, 0.6, 0.9
        assert stats.bucket_count[bucket].item() == masked[b].sum().item()
    ce = F.cross_entropy(logits[masked].float(), targets[masked], reduction="sum")
    assert stats.nll_sum.item() == pytest.approx(ce.item(), rel=1e-6)

    none = torch.zeros_like(masked)
    loss, stats = dream_sft_loss(logits, targets, none, t, maskable)
    loss.backward()  # still connected to the graph
    assert loss.item() == 0.0 and int(stats.num_masked) == 0
    loss, _ = llada_sft_loss(logits, targets, none, t, maskable.sum(1))
    assert loss.item() == 0.0


def test_bf16_logits_use_fp32_cross_entropy():
    logits, targets, masked, maskable, t = _loss_case(V=50)
    logits16 = (logits.detach() * 8).bfloat16()
    loss16, _ = llada_sft_loss(logits16, targets, masked, t, maskable.sum(1))
    loss32, _ = llada_sft_loss(logits16.float(), targets, masked, t, maskable.sum(1))
    assert loss16.dtype == torch.float32
    assert loss16.item() == loss32.item()


def test_loss_input_checks():
    logits, targets, masked, maskable, t = _loss_case()
    bad = masked.clone()
    bad[1, 0] = True  # a prompt position
    with pytest.raises(ValueError, match="not maskable"):
        dream_sft_loss(logits, targets, bad, t, maskable)
    with pytest.raises(ValueError, match="weighting"):
        dream_sft_loss(logits, targets, masked, t, maskable, weighting="focal")
    with pytest.raises(ValueError, match=r"logits \[B, L, V\]"):
        llada_sft_loss(logits[0], targets, masked, t, maskable.sum(1))
