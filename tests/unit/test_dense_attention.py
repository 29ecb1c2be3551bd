"""The dense MDLMPE attention (pair phases once per call, correction as a bias) against the spec.

Forward and every gradient equal reference_attention's to fp32 rounding (same sums in another
order; tolerance as in test_blocked_attention.py), for GQA, partial head masks, padding, a
padding-only row and L = 1, and the model gives the same logits through it as through the blocked
path.
"""

from __future__ import annotations

import pytest
import torch

from mdlmpe_ds.attention import AttentionImpl, mdlmpe_attention
from mdlmpe_ds.attention.common import rope_attention
from mdlmpe_ds.attention.dense import dense_attention
from mdlmpe_ds.attention.reference import reference_attention
from mdlmpe_ds.models import DiffusionLM, preset
from mdlmpe_ds.pe.availability import availability, gaussian_taps, sine_basis, token_summaries
from mdlmpe_ds.pe.config import MDLMPEConfig
from mdlmpe_ds.pe.phase import PhaseMLP, pair_phase

TAU_MAX, KAPPA, MASK_ID = 0.25, 1e-4, 0
TOL = {"atol": 2e-5, "rtol": 2e-5}


def _case(batch, q_heads, kv_heads, length, head_dim, seed, pad):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (batch, length), generator=gen)
    ids[torch.rand(batch, length, generator=gen) < 0.5] = MASK_ID
    valid = torch.ones(batch, length, dtype=torch.bool)
    if pad:
        valid[-1, length // 2 :] = False
    b, a = availability(ids, MASK_ID, valid)
    A, D = token_summaries(b, a, sine_basis(length, head_dim, 10000.0), gaussian_taps(3, 1.0), 1e-6)
    q = torch.randn(batch, q_heads, length, head_dim, generator=gen).requires_grad_()
    k = torch.randn(batch, kv_heads, length, head_dim, generator=gen).requires_grad_()
    v = torch.randn(batch, kv_heads, length, head_dim, generator=gen).requires_grad_()
    torch.manual_seed(seed)
    mlp = PhaseMLP(head_dim // 2, 8)
    with torch.no_grad():  # a residual far from 0, so a wrong pair or sign shows
        mlp.fc2.weight.normal_(0.0, 1.5)
        mlp.fc2.bias.normal_(0.0, 0.5)
    return q, k, v, A, D, valid if pad else None, mlp


def _grads(out, leaves):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return torch.autograd.grad((out * weight).sum(), leaves)


@pytest.mark.parametrize(
    ("batch", "q_heads", "kv_heads", "length", "head_dim", "pattern", "pad"),
    [
        (2, 4, 2, 11, 8, None, True),  # GQA 2:1, right padding
        (1, 6, 2, 9, 12, (False, True), False),  # GQA 3:1, one KV head active, F = 6 (|M| = 3)
        (3, 4, 4, 7, 8, (True, False, True, False), True),  # MHA, half the heads
        (2, 4, 1, 5, 16, None, False),  # one KV head for every query head
    ],
)
def test_matches_reference(batch, q_heads, kv_heads, length, head_dim, pattern, pad):
    q, k, v, A, D, key_valid, mlp = _case(batch, q_heads, kv_heads, length, head_dim, length, pad)
    A, D = A.detach().requires_grad_(), D.detach().requires_grad_()  # as with a learned coordinate
    assert pair_phase(A, D, A, D, mlp.params(), TAU_MAX, KAPPA).abs().max() > 0.1
    active = None if pattern is None else torch.tensor(pattern)
    kwargs = {"tau_max": TAU_MAX, "clip_kappa": KAPPA, "active_kv": active, "key_valid": key_valid}
    ref = reference_attention(q, k, v, A, D, mlp.params(), **kwargs)
    out = dense_attention(q, k, v, A, D, mlp.params(), **kwargs)
    torch.testing.assert_close(out, ref, **TOL)
    assert (out - rope_attention(q, k, v, key_valid)).abs().max() > 1e-3  # the correction matters
    leaves = [q, k, v, *mlp.params(), A, D]
    names = ("q", "k", "v", "w1", "b1", "w2", "b2", "A", "D")
    for name, got, want in zip(names, _grads(out, leaves), _grads(ref, leaves)):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_padding_only_row_and_single_token():
    q, k, v, A, D, key_valid, mlp = _case(2, 4, 2, 8, 8, 3, True)
    key_valid[0] = False  # the first sequence is padding only
    kwargs = {"tau_max": TAU_MAX, "clip_kappa": KAPPA, "key_valid": key_valid}
    out = dense_attention(q, k, v, A, D, mlp.params(), **kwargs)
    ref = reference_attention(q, k, v, A, D, mlp.params(), **kwargs)
    torch.testing.assert_close(out, ref, **TOL)
    leaves = [q, k, v, *mlp.params()]
    for got, want in zip(_grads(out, leaves), _grads(ref, leaves)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **TOL)
    q, k, v, A, D, _, mlp = _case(1, 2, 2, 1, 8, 4, False)
    out = dense_attention(q, k, v, A, D, mlp.params(), tau_max=TAU_MAX, clip_kappa=KAPPA)
    torch.testing.assert_close(out, rope_attention(q, k, v))  # one key: all the weight on it


def test_dispatcher_and_model_agree_with_blocked():
    """Selected by name through the dispatcher, and a whole model gives the blocked path's logits
    and gradients through it."""
    q, k, v, A, D, key_valid, mlp = _case(2, 4, 2, 11, 8, 5, True)
    config = MDLMPEConfig(max_seq_len=16, tau_max=TAU_MAX, clip_kappa=KAPPA)
    got = mdlmpe_attention(
        q, k, v, A, D, mlp.params(), config, AttentionImpl(backend="dense"), key_valid=key_valid
    )
    want = reference_attention(
        q, k, v, A, D, mlp.params(), tau_max=TAU_MAX, clip_kappa=KAPPA, key_valid=key_valid
    )
    torch.testing.assert_close(got, want, **TOL)
    assert AttentionImpl(backend="dense").keeps_pair_tensors
    cfg = preset("llada-tiny", position_encoding="mdlmpe")
    torch.manual_seed(0)
    dense = DiffusionLM(cfg, impl=AttentionImpl(backend="dense"))
    blocked = DiffusionLM(cfg, impl=AttentionImpl(backend="blocked", query_block=4))
    blocked.load_state_dict(dense.state_dict())
    for model in (dense, blocked):
        with torch.no_grad():
            for layer in model.layers:
                layer.attn.phase.fc2.weight.copy_(
                    torch.linspace(-2.0, 2.0, layer.attn.phase.fc2.weight.numel()).view_as(
                        layer.attn.phase.fc2.weight
                    )
                )
    ids = torch.randint(0, cfg.vocab_size - 2, (2, 13), generator=torch.Generator().manual_seed(2))
    ids[:, ::3] = cfg.mask_token_id
    a, b = dense(ids), blocked(ids)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, p), q_ in zip(dense.named_parameters(), blocked.parameters()):
        torch.testing.assert_close(p.grad, q_.grad, atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
