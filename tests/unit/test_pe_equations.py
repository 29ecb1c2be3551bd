"""Every MDLMPE equation against a direct, loop-level restatement of the paper (Appendix A).

Sizes are tiny and the loops are written from the equations, not from the vectorised code, so a
wrong constant, a transposed index or a wrong pair layout shows up as a mismatch.
"""

from __future__ import annotations

import math

import pytest
import torch

from mdlmpe_ds.attention.reference import reference_attention
from mdlmpe_ds.pe.availability import (
    availability,
    dense_weights,
    gaussian_taps,
    sine_basis,
    token_summaries,
)
from mdlmpe_ds.pe.config import MDLMPEConfig
from mdlmpe_ds.pe.encoder import MDLMPEEncoder
from mdlmpe_ds.pe.phase import PhaseMLP, angularize, mdlmpe_pairs, pair_phase, pair_ratio
from mdlmpe_ds.pe.rope import apply_rotary, inverse_frequencies

EPS = 1e-6
MASK = 7


def loop_weights(a: list[float], window: int, sigma: float, eps: float) -> list[list[float]]:
    """Eqs. (21) + (22), one entry at a time."""
    length = len(a)
    raw = [
        [math.exp(-((i - t) ** 2) / (2 * sigma**2)) * (abs(i - t) <= window) * a[t] for t in range(length)]
        for i in range(length)
    ]
    return [[raw[i][t] / (sum(raw[i]) + eps) for t in range(length)] for i in range(length)]


def loop_basis(length: int, head_dim: int, theta: float) -> list[list[float]]:
    """Eq. (15) with omega_f = theta^(-2f/d_h)."""
    return [
        [0.5 * (1 + math.sin(t * theta ** (-2 * f / head_dim))) for f in range(head_dim // 2)]
        for t in range(length)
    ]


def random_state(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5, (1, length), generator=g)
    ids[torch.rand(1, length, generator=g) < 0.4] = MASK
    valid = torch.ones(1, length, dtype=torch.bool)
    valid[0, -2:] = False  # two padding positions
    return ids, valid


def test_availability_eq_binary():
    ids = torch.tensor([[1, MASK, 3, MASK, 2]])
    valid = torch.tensor([[True, True, True, True, False]])
    b, a = availability(ids, MASK, valid)
    assert b.tolist() == [[1.0, 0.0, 1.0, 0.0, 0.0]]  # b = 1[x != mask] * a: padding is never available
    assert a.tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0]]


def test_window_and_sigma_defaults():
    cfg = MDLMPEConfig(max_seq_len=1024)
    assert cfg.window == 192 and cfg.sigma == 48.0  # the paper's example (W=192, sigma=48 at L=1024)
    assert MDLMPEConfig(max_seq_len=16).window == 3 and MDLMPEConfig(max_seq_len=16).sigma == 1.0
    assert MDLMPEConfig(max_seq_len=1024, use_gaussian=False).window == 0
    assert MDLMPEConfig(max_seq_len=8).window == 2  # round(1.5) rounds half up, not down or to even
    assert MDLMPEConfig(max_seq_len=24).window == 5  # round(4.5)
    assert MDLMPEConfig().hidden_width(64) == 32 and MDLMPEConfig().hidden_width(8) == 16


def test_gaussian_weights_eq_normalize():
    _, valid = random_state(12, 0)
    a = valid.float()
    window, sigma = 4, 1.5
    expected = torch.tensor(loop_weights(a[0].tolist(), window, sigma, EPS))
    torch.testing.assert_close(dense_weights(a, window, sigma, EPS)[0], expected, rtol=1e-6, atol=1e-7)
    taps = gaussian_taps(window, sigma)
    assert taps.numel() == 2 * window + 1
    torch.testing.assert_close(taps[window + 2], torch.tensor(math.exp(-4 / (2 * sigma**2))))


def test_sine_basis_eq_nonnegative_coordinate():
    expected = torch.tensor(loop_basis(10, 8, 10000.0))
    torch.testing.assert_close(sine_basis(10, 8, 10000.0), expected, rtol=1e-6, atol=1e-7)
    # the frequency grid is RoPE's own
    omega = inverse_frequencies(8, 10000.0)
    torch.testing.assert_close(omega, torch.tensor([10000.0 ** (-2 * f / 8) for f in range(4)]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_summaries_eq_availability_ratio_explicit(seed):
    length, head_dim, theta, window, sigma = 11, 8, 100.0, 3, 1.25
    ids, valid = random_state(length, seed)
    b, a = availability(ids, MASK, valid)
    A, D = token_summaries(b, a, sine_basis(length, head_dim, theta), gaussian_taps(window, sigma), EPS)
    w = loop_weights(a[0].tolist(), window, sigma, EPS)
    c = loop_basis(length, head_dim, theta)
    for i in range(length):
        for f in range(head_dim // 2):
            u = sum(w[i][t] * b[0, t].item() * c[t][f] for t in range(length))
            d = sum(w[i][t] * a[0, t].item() * c[t][f] for t in range(length)) + EPS
            assert A[0, i, f].item() == pytest.approx(u, rel=1e-5, abs=1e-7)
            assert D[0, i, f].item() == pytest.approx(d, rel=1e-5, abs=1e-7)


def test_pair_ratio_angle_and_phase_mlp_loops():
    torch.manual_seed(0)
    num_pairs, hidden = 4, 16
    A = torch.rand(1, 3, num_pairs) * 0.5
    D = A + torch.rand(1, 3, num_pairs) * 0.5 + 0.01
    mlp = PhaseMLP(num_pairs, hidden)
    torch.nn.init.normal_(mlp.fc2.weight, std=0.5)
    torch.nn.init.normal_(mlp.fc2.bias, std=0.5)
    p = mlp.params()
    kappa, tau = 1e-4, 0.25
    r = pair_ratio(A, D, A, D)
    s = angularize(r, kappa)
    delta = pair_phase(A, D, A, D, p, tau, kappa)
    assert delta.shape == (1, 3, 3, num_pairs // 2)
    for i in range(3):
        for j in range(3):
            rij = [(A[0, i, f] + A[0, j, f]) / (D[0, i, f] + D[0, j, f]) for f in range(num_pairs)]
            sij = [math.acos(min(max(2 * x.item() - 1, -1 + kappa), 1 - kappa)) - math.pi / 2 for x in rij]
            hid = []
            for h in range(hidden):
                pre = sum(p.w1[h, f].item() * sij[f] for f in range(num_pairs)) + p.b1[h].item()
                hid.append(pre / (1 + math.exp(-pre)))  # SiLU
            for m in range(num_pairs // 2):
                pre = sum(p.w2[m, h].item() * hid[h] for h in range(hidden)) + p.b2[m].item()
                assert delta[0, i, j, m].item() == pytest.approx(tau * math.tanh(pre), rel=1e-5, abs=1e-6)
            for f in range(num_pairs):
                assert r[0, i, j, f].item() == pytest.approx(rij[f].item(), rel=1e-6)
                assert s[0, i, j, f].item() == pytest.approx(sij[f], rel=1e-5, abs=1e-6)


def test_phase_mlp_shapes_split_and_zero_init():
    mlp = PhaseMLP(num_pairs=8, hidden=16)
    assert mdlmpe_pairs(8).tolist() == [1, 3, 5, 7]  # odd pairs carry the residual, even stay RoPE
    assert tuple(mlp.fc1.weight.shape) == (16, 8) and tuple(mlp.fc2.weight.shape) == (4, 16)
    assert mlp.fc2.weight.abs().sum() == 0 and mlp.fc2.bias.abs().sum() == 0
    s = torch.randn(5, 8)
    assert (
        pair_phase(
            s[None, :, :4].abs(),
            s[None, :, :4].abs() + 1,
            s[None, :, :4].abs(),
            s[None, :, :4].abs() + 1,
            PhaseMLP(4, 16).params(),
            0.25,
            1e-4,
        )
        .abs()
        .max()
        == 0
    )


def test_embedding_path_eq_embedding_injection():
    cfg = MDLMPEConfig(max_seq_len=16)
    enc = MDLMPEEncoder(cfg, head_dim=8, hidden_size=6, rope_theta=100.0, mask_token_id=MASK)
    assert enc.gamma.item() == pytest.approx(0.01, rel=1e-6)  # gamma initialised to 0.01
    assert enc.proj.bias.abs().sum() == 0  # b_p = 0
    with torch.no_grad():
        enc.gate_logit.fill_(50.0)
    assert enc.gamma.item() == pytest.approx(0.10, rel=1e-6)  # bounded by gamma_max
    with torch.no_grad():
        enc.gate_logit.fill_(0.3)
        enc.proj.bias.normal_()
    ids, valid = random_state(10, 3)
    feats = enc.features(ids, valid)
    e = torch.randn(1, 10, 6)
    out = enc.embed(e, feats)
    gamma = 0.1 / (1 + math.exp(-0.3))
    for i in range(10):
        z = [
            sum(enc.proj.weight[d, f].item() * feats.A[0, i, f].item() for f in range(4))
            + enc.proj.bias[d].item()
            for d in range(6)
        ]
        for d in range(6):
            assert out[0, i, d].item() == pytest.approx(e[0, i, d].item() + gamma * z[d], rel=1e-5, abs=1e-6)


def test_rotary_pair_layout_is_half_split():
    x = torch.zeros(1, 1, 3, 8)
    x[..., 1] = 1.0  # first component of pair f=1 lives in dim 1, its partner in dim 1 + F = 5
    cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    angle = torch.tensor([0.0, 0.3, 0.0, 0.0])
    cos, sin = cos * angle.cos(), torch.zeros(3, 4) + angle.sin()
    out = apply_rotary(x, cos, sin)
    assert out[0, 0, 0, 1].item() == pytest.approx(math.cos(0.3))
    assert out[0, 0, 0, 5].item() == pytest.approx(math.sin(0.3))
    assert out[0, 0, 0, [0, 2, 3, 4, 6, 7]].abs().sum() == 0


def test_reference_scores_eq_main_final_angle():
    """S_ij from the reference attention equals the loop sum of q_f^T R(delta_ij,f) k_f (odd f only,
    active heads only), read through one-hot values so the output rows are the softmax rows."""
    torch.manual_seed(1)
    length, head_dim, num_pairs = 5, 8, 4
    q = torch.randn(1, 2, length, head_dim)
    k = torch.randn(1, 1, length, head_dim)
    v = torch.eye(length, head_dim).expand(1, 1, length, head_dim).contiguous()
    A = torch.rand(1, length, num_pairs) * 0.5
    D = A + 0.3
    mlp = PhaseMLP(num_pairs, 16)
    torch.nn.init.normal_(mlp.fc2.weight, std=1.0)
    delta = pair_phase(A, D, A, D, mlp.params(), 0.25, 1e-4)
    probs = reference_attention(q, k, v, A, D, mlp.params(), tau_max=0.25, clip_kappa=1e-4)[..., :length]
    for h in range(2):
        for i in range(length):
            scores = []
            for j in range(length):
                total = 0.0
                for f in range(num_pairs):
                    q1, q2 = q[0, h, i, f].item(), q[0, h, i, f + num_pairs].item()
                    k1, k2 = k[0, 0, j, f].item(), k[0, 0, j, f + num_pairs].item()
                    ang = delta[0, i, j, (f - 1) // 2].item() if f % 2 == 1 else 0.0
                    rk1 = math.cos(ang) * k1 - math.sin(ang) * k2
                    rk2 = math.sin(ang) * k1 + math.cos(ang) * k2
                    total += q1 * rk1 + q2 * rk2
                scores.append(total / math.sqrt(head_dim))
            z = max(scores)
            expected = [math.exp(x - z) / sum(math.exp(y - z) for y in scores) for x in scores]
            assert probs[0, h, i].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_reference_relative_angle_is_rope_plus_delta():
    """Pair f of S_ij sees the relative angle (j - i) w_f + delta_ij,f (Eq. (8))."""
    torch.manual_seed(2)
    length, head_dim, theta = 4, 4, 10.0
    num_pairs = head_dim // 2
    q0, k0 = torch.randn(1, 1, length, head_dim), torch.randn(1, 1, length, head_dim)
    pos = torch.arange(length, dtype=torch.float32)
    ang = torch.outer(pos, inverse_frequencies(head_dim, theta))
    q, k = apply_rotary(q0, ang.cos(), ang.sin()), apply_rotary(k0, ang.cos(), ang.sin())
    v = torch.eye(length, head_dim).expand(1, 1, length, head_dim).contiguous()
    A = torch.rand(1, length, num_pairs) * 0.4
    D = A + 0.5
    mlp = PhaseMLP(num_pairs, 16)
    torch.nn.init.normal_(mlp.fc2.weight, std=1.0)
    delta = pair_phase(A, D, A, D, mlp.params(), 0.25, 1e-4)
    probs = reference_attention(q, k, v, A, D, mlp.params(), tau_max=0.25, clip_kappa=1e-4)[0, 0]
    omega = inverse_frequencies(head_dim, theta)
    scores = torch.zeros(length, length)
    for i in range(length):
        for j in range(length):
            for f in range(num_pairs):
                rel = (j - i) * omega[f] + (delta[0, i, j, 0] if f == 1 else 0.0)
                q1, q2 = q0[0, 0, i, f], q0[0, 0, i, f + num_pairs]
                k1, k2 = k0[0, 0, j, f], k0[0, 0, j, f + num_pairs]
                scores[i, j] += q1 * (rel.cos() * k1 - rel.sin() * k2) + q2 * (
                    rel.sin() * k1 + rel.cos() * k2
                )
    torch.testing.assert_close(
        probs[:, :length], torch.softmax(scores / math.sqrt(head_dim), -1), rtol=1e-5, atol=1e-6
    )


def test_reference_padding_ignores_padded_keys_and_stays_finite():
    """Real queries of a padded batch equal the unpadded computation; a padding-only row is finite."""
    torch.manual_seed(3)
    length, pad, head_dim, num_pairs = 6, 3, 8, 4
    q = torch.randn(2, 2, length + pad, head_dim)
    k = torch.randn(2, 1, length + pad, head_dim)
    v = torch.randn(2, 1, length + pad, head_dim)
    A = torch.rand(2, length + pad, num_pairs) * 0.5
    D = A + 0.3
    mlp = PhaseMLP(num_pairs, 16)
    torch.nn.init.normal_(mlp.fc2.weight, std=1.0)
    key_valid = torch.ones(2, length + pad, dtype=torch.bool)
    key_valid[0, length:] = False
    key_valid[1] = False  # a padding-only row
    out = reference_attention(q, k, v, A, D, mlp.params(), tau_max=0.25, clip_kappa=1e-4, key_valid=key_valid)
    short = reference_attention(
        q[:1, :, :length],
        k[:1, :, :length],
        v[:1, :, :length],
        A[:1, :length],
        D[:1, :length],
        mlp.params(),
        tau_max=0.25,
        clip_kappa=1e-4,
    )
    torch.testing.assert_close(out[:1, :, :length], short, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all()
