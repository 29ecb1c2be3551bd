"""Appendix F invariants of the availability encoder, checked on the product's own functions."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mdlmpe_ds.pe.availability import availability, dense_weights, gaussian_taps, sine_basis, token_summaries
from mdlmpe_ds.pe.config import MDLMPEConfig
from mdlmpe_ds.pe.encoder import MDLMPEEncoder
from mdlmpe_ds.pe.phase import angularize, pair_ratio

EPS = 1e-6
MASK = 0


def summaries(
    b: torch.Tensor, a: torch.Tensor, window: int, sigma: float, head_dim: int = 16, theta=500000.0
):
    c = sine_basis(b.shape[-1], head_dim, theta)
    return token_summaries(b, a, c, gaussian_taps(window, sigma), EPS)


def test_ratio_bounds_eq_ratio_bound():
    g = torch.Generator().manual_seed(0)
    b = (torch.rand(8, 64, generator=g) < 0.5).float()
    a = torch.ones_like(b)
    a[:, 50:] = 0
    b = b * a
    A, D = summaries(b, a, 12, 3.0)
    r = A / D
    assert r.min() >= 0 and r.max() <= 1
    rp = pair_ratio(A, D, A, D)
    assert rp.min() >= 0 and rp.max() <= 1


@pytest.mark.parametrize("length,window,sigma", [(64, 12, 3.0), (256, 64, 16.0), (7, 20, 5.0)])
def test_endpoints_all_masked_zero_all_revealed_one(length, window, sigma):
    """Row normalisation makes the endpoint ratios position independent, boundaries included (F.5)."""
    a = torch.ones(1, length)
    A0, _ = summaries(torch.zeros(1, length), a, window, sigma)
    assert torch.all(A0 == 0)  # all masked: exactly 0 everywhere
    A1, D1 = summaries(a.clone(), a, window, sigma)
    r1 = A1 / D1
    # all revealed: 1 up to the denominator safeguard, r = 1 - eps / D
    torch.testing.assert_close(r1, 1 - EPS / D1, rtol=0, atol=1e-6)
    assert (1 - r1).max() < 1e-3
    assert r1[0, 0].min() > 1 - 1e-3 and r1[0, -1].min() > 1 - 1e-3


def test_normalised_kernels_have_unit_mass_at_boundaries():
    w = dense_weights(torch.ones(1, 256), 64, 16.0, EPS)[0]
    mass = w.sum(-1)
    torch.testing.assert_close(mass, torch.ones(256), rtol=0, atol=1e-5)
    raw = dense_weights(torch.ones(1, 256), 64, 16.0, 1e30)[0] * 1e30  # unnormalised row mass
    assert raw.sum(-1)[0] < 0.6 * raw.sum(-1)[128]  # truncation halves the edge mass before normalising


def test_jacobian_eq_single_state_influence():
    """du_i/db_t = w_{i,t} c_t exactly, and its norm <= w_{i,t} sqrt(F) (Eq. (35))."""
    length, head_dim, window, sigma = 24, 8, 5, 2.0
    num_pairs = head_dim // 2
    a = torch.ones(1, length)
    b = (torch.arange(length) % 3 == 0).float().unsqueeze(0).requires_grad_(True)
    c = sine_basis(length, head_dim, 100.0)
    w = dense_weights(a, window, sigma, EPS)[0]
    i = 11
    jac = torch.zeros(num_pairs, length)
    for f in range(num_pairs):
        A, _ = token_summaries(b, a, c, gaussian_taps(window, sigma), EPS)
        (grad,) = torch.autograd.grad(A[0, i, f], b)
        jac[f] = grad[0]
    torch.testing.assert_close(jac, (w[i].unsqueeze(0) * c.T), rtol=1e-5, atol=1e-7)
    norms = jac.norm(dim=0)
    assert torch.all(norms <= w[i] * math.sqrt(num_pairs) + 1e-7)
    assert torch.all(jac[:, (torch.arange(length) - i).abs() > window] == 0)


def test_no_effect_beyond_window():
    length, window, sigma = 80, 10, 2.5
    a = torch.ones(1, length)
    b = (torch.rand(1, length, generator=torch.Generator().manual_seed(1)) < 0.5).float()
    A, _ = summaries(b, a, window, sigma)
    i = 40
    for t in (i - window - 1, i + window + 1, 0, length - 1):
        flipped = b.clone()
        flipped[0, t] = 1 - flipped[0, t]
        A2, _ = summaries(flipped, a, window, sigma)
        assert torch.equal(A2[0, i], A[0, i])
    inside = b.clone()
    inside[0, i + window] = 1 - inside[0, i + window]
    A3, _ = summaries(inside, a, window, sigma)
    assert not torch.equal(A3[0, i], A[0, i])


def test_angle_derivative_eq_ratio_angle_derivative():
    r = torch.tensor([0.05, 0.2, 0.5, 0.7, 0.93], dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(angularize(r, 1e-4).sum(), r)
    torch.testing.assert_close(grad, -1 / torch.sqrt(r * (1 - r)).detach())
    assert grad[2].item() == pytest.approx(-2.0)  # |ds/dr| is minimal (= 2) at r = 1/2
    s = angularize(torch.tensor([0.0, 0.5, 1.0]), 1e-4)
    assert s[1].item() == pytest.approx(0.0, abs=1e-7)
    assert s[0].item() == pytest.approx(math.pi / 2, abs=0.02) and s[2].item() == pytest.approx(
        -math.pi / 2, abs=0.02
    )
    endpoint = torch.tensor([1.0, 0.0], requires_grad=True)
    (g_end,) = torch.autograd.grad(angularize(endpoint, 1e-4).sum(), endpoint)
    assert torch.isfinite(g_end).all()  # clipping removes the endpoint singularity


def test_exact_envelope_by_sorted_partial_sums_matches_brute_force():
    """F.1: over every mask with k revealed, max/min of r_{i,f} = sorted partial sums of alpha_{i,t,f}."""
    length, window, sigma, head_dim, f, i = 10, 4, 1.5, 8, 1, 5
    a = torch.ones(1, length)
    c = sine_basis(length, head_dim, 10.0)[:, f]
    w = dense_weights(a, window, sigma, 0.0)[0, i]
    alpha = w * c / (w * c).sum()
    ordered = alpha.sort(descending=True).values
    masks = torch.tensor(list(itertools.product([0.0, 1.0], repeat=length)))
    A, D = token_summaries(
        masks, torch.ones_like(masks), sine_basis(length, head_dim, 10.0), gaussian_taps(window, sigma), 1e-12
    )
    r = (A / D)[:, i, f]
    counts = masks.sum(-1)
    for k in range(length + 1):
        sel = r[counts == k]
        upper, lower = ordered[:k].sum(), ordered.flip(0)[:k].sum()
        assert sel.max().item() == pytest.approx(upper.item(), abs=1e-5)
        assert sel.min().item() == pytest.approx(lower.item(), abs=1e-5)
        if 0 < k < length:
            assert sel.max() - sel.min() > 1e-3  # interior width: density alone does not fix r


def test_equal_density_topologies_are_distinct():
    length, revealed = 256, 64
    cfg = MDLMPEConfig(max_seq_len=length)
    layouts = {
        "local": torch.arange(length).ge(96) & torch.arange(length).lt(160),
        "uniform": torch.arange(length) % 4 == 0,
        "edge": (torch.arange(length) < 32) | (torch.arange(length) >= length - 32),
        "periodic": (torch.arange(length) % 32) < 8,
    }
    vectors = {}
    for name, mask in layouts.items():
        assert int(mask.sum()) == revealed
        b = mask.float().unsqueeze(0)
        A, D = summaries(b, torch.ones_like(b), cfg.window, cfg.sigma, head_dim=128)
        vectors[name] = (A / D)[0, length // 2]
    names = list(vectors)
    for x, y in itertools.combinations(names, 2):
        assert (vectors[x] - vectors[y]).abs().max() > 1e-3, (x, y)


def test_features_follow_mask_state_and_ignore_content():
    enc = MDLMPEEncoder(
        MDLMPEConfig(max_seq_len=32), head_dim=8, hidden_size=4, rope_theta=1e4, mask_token_id=MASK
    )
    ids = torch.tensor([[5, MASK, 6, 7, MASK, 8, 9, MASK, 3, 4]])
    base = enc.features(ids)
    revealed = ids.clone()
    revealed[0, 1] = 11  # a masked position flips to revealed
    assert not torch.equal(enc.features(revealed).A, base.A)
    renamed = ids.clone()
    renamed[0, 0], renamed[0, 5] = 42, 17  # revealed tokens change identity only
    for x, y in zip(enc.features(renamed), base):
        assert torch.equal(x, y)


def test_padding_amount_does_not_change_features_of_real_positions():
    enc = MDLMPEEncoder(
        MDLMPEConfig(max_seq_len=64), head_dim=8, hidden_size=4, rope_theta=1e4, mask_token_id=MASK
    )
    ids = torch.tensor([[5, MASK, 6, 7, MASK, 8, 9, MASK]])
    short = enc.features(ids, torch.ones_like(ids, dtype=torch.bool))
    padded_ids = torch.cat([ids, torch.full((1, 9), 3)], dim=1)
    valid = torch.cat([torch.ones(1, 8, dtype=torch.bool), torch.zeros(1, 9, dtype=torch.bool)], dim=1)
    padded = enc.features(padded_ids, valid)
    torch.testing.assert_close(padded.A[:, :8], short.A, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(padded.D[:, :8], short.D, rtol=1e-6, atol=1e-7)


def test_ablation_switches_change_the_summaries():
    ids = torch.tensor([[5, MASK, 6, 7, MASK, 8, 9, MASK, 1, 2, MASK, 3]])

    def feats(**kw):
        cfg = MDLMPEConfig(max_seq_len=32, **kw)
        return MDLMPEEncoder(cfg, head_dim=8, hidden_size=4, rope_theta=1e4, mask_token_id=MASK).features(ids)

    binary = feats(use_gaussian=False, coordinate="none")
    b, _ = availability(ids, MASK)
    # binary only: each token sees its own state, identical across pairs
    torch.testing.assert_close(binary.A / binary.D, b.unsqueeze(-1).expand(-1, -1, 4), atol=1e-5, rtol=0)
    gauss = feats(coordinate="none")
    assert torch.allclose(gauss.A[..., 0], gauss.A[..., 3])  # no basis: one value for every pair
    assert not torch.allclose(gauss.A, binary.A)
    sine = feats()
    assert not torch.allclose(sine.A[..., 0], sine.A[..., 3])
    learned = feats(coordinate="mlp")
    ratio = (learned.A / learned.D).detach()
    assert learned.A.requires_grad and 0 <= float(ratio.min()) <= float(ratio.max()) <= 1


def test_left_padding_with_positions_gives_unpadded_features():
    enc = MDLMPEEncoder(
        MDLMPEConfig(max_seq_len=64), head_dim=8, hidden_size=4, rope_theta=1e4, mask_token_id=MASK
    )
    ids = torch.tensor([[5, MASK, 6, 7, MASK, 8, 9, MASK]])
    plain = enc.features(ids)
    padded_ids = torch.cat([torch.full((1, 5), 3), ids], dim=1)
    valid = torch.cat([torch.zeros(1, 5, dtype=torch.bool), torch.ones(1, 8, dtype=torch.bool)], dim=1)
    positions = valid.long().cumsum(-1) - 1
    padded = enc.features(padded_ids, valid, positions)
    torch.testing.assert_close(padded.A[:, 5:], plain.A, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(padded.D[:, 5:], plain.D, rtol=1e-6, atol=1e-7)
    shifted = enc.features(padded_ids, valid)  # without positions the basis shifts with the padding
    assert not torch.allclose(shifted.A[:, 5:], plain.A, atol=1e-5)
