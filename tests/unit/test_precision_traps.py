"""Precision traps that only bite on a GPU, checked on the CPU (issue 16, item 5).

- A and D (the availability summaries) are exact fp32: their banded sums run with cuDNN's TF32
  switched off, forward and backward (TF32 is on by default for convolutions on Ampere+).
- The key-padding bias is finite in every dtype, so a padding-only row is the uniform average of V
  (no NaN) in bf16 and fp16 too.
- GQA through SDPA's native ``enable_gqa`` equals the old repeated-K/V path.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mdlmpe_ds.attention import common
from mdlmpe_ds.attention.common import alibi_attention, key_padding_bias, repeat_kv, rope_attention
from mdlmpe_ds.pe import availability as avail
from mdlmpe_ds.pe.alibi import alibi_bias


def test_availability_convolutions_request_ieee_fp32(monkeypatch):
    """Every conv1d of token_summaries (forward, and backward for a learned coordinate) runs with
    cuDNN's fp32 precision set to IEEE; the global setting is restored afterwards."""
    seen: list[str] = []
    real = F.conv1d

    def spy(*args, **kwargs):
        seen.append(torch.backends.cudnn.conv.fp32_precision)
        return real(*args, **kwargs)

    monkeypatch.setattr(avail.F, "conv1d", spy)
    before = torch.backends.cudnn.conv.fp32_precision
    b, a = avail.availability(torch.tensor([[1, 5, 2, 5, 3, 4, 5, 1]]), mask_token_id=5)
    coordinate = avail.sine_basis(8, 8, 10000.0).requires_grad_()
    A, D = avail.token_summaries(b, a, coordinate, avail.gaussian_taps(2, 1.0), 1e-6)
    (A.sum() + D.sum()).backward()
    assert len(seen) >= 3, seen  # row mass, the 2F signals, and their backward
    assert set(seen) == {"ieee"}, seen
    assert torch.backends.cudnn.conv.fp32_precision == before


def test_availability_matches_float64_at_fp32_rounding():
    """A, D against the same equations in float64 (dense row-normalised weights): the error is fp32
    rounding of sums of <= 2W+1 terms, ~(2W+1) * 2^-24 relative; TF32 would be ~1e-3."""
    gen = torch.Generator().manual_seed(0)
    length, window, sigma, eps = 64, 12, 3.0, 1e-6
    ids = torch.randint(0, 4, (2, length), generator=gen)
    valid = torch.ones(2, length, dtype=torch.bool)
    valid[1, 50:] = False
    b, a = avail.availability(ids, mask_token_id=0, valid=valid)
    coordinate = avail.sine_basis(length, 16, 10000.0)
    A, D = avail.token_summaries(b, a, coordinate, avail.gaussian_taps(window, sigma), eps)
    w = avail.dense_weights(a.double(), window, sigma, eps).double()  # [B, L, L]
    c = coordinate.double()
    A64 = torch.einsum("bit,bt,tf->bif", w, b.double(), c)
    D64 = torch.einsum("bit,bt,tf->bif", w, a.double(), c) + eps
    bound = (2 * window + 1) * 2.0**-24 * 4  # relative to the O(1) values of A, D
    assert (A.double() - A64).abs().max().item() < bound
    assert (D.double() - D64).abs().max().item() < bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_key_padding_bias_is_finite(dtype):
    valid = torch.tensor([[True, False], [False, False]])
    bias = key_padding_bias(valid, dtype)
    assert bias.dtype == dtype and bool(torch.isfinite(bias).all())
    assert bias[0, 0, 0, 1] == torch.finfo(dtype).min / 16
    # finite in fp32 after a fused kernel's log2(e) and any scale <= 1 (finfo.min itself is not)
    assert math.isfinite(float(bias[0, 0, 0, 1]) * 1.4426950408889634 * 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gqa", [False, True])
def test_padding_only_rows_are_the_uniform_average(dtype, gqa):
    """Sequence 1 is all padding: each of its rows is mean_j V_j (LLaDA's fp32 behaviour), finite,
    with finite gradients; sequence 0 (partly padded) ignores its padded keys."""
    gen = torch.Generator().manual_seed(0)
    hq, hkv = (4, 2) if gqa else (2, 2)
    q = (4 * torch.randn(2, hq, 6, 16, generator=gen)).to(dtype).requires_grad_()
    k = (4 * torch.randn(2, hkv, 6, 16, generator=gen)).to(dtype).requires_grad_()
    v = torch.randn(2, hkv, 6, 16, generator=gen).to(dtype).requires_grad_()
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0, 4:] = False
    valid[1] = False
    out = rope_attention(q, k, v, valid)
    assert bool(torch.isfinite(out).all())
    uniform = repeat_kv(v, hq)[1].float().mean(dim=1, keepdim=True).expand(hq, 6, 16)
    # One bf16/fp16 rounding of an average of O(1) values (half-ulp 2^-9 / 2^-12 at magnitude 1).
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out[1].float(), uniform, atol=tol, rtol=0)
    want0 = rope_attention(q[:1, :, :, :].float(), k[:1, :, :4].float(), v[:1, :, :4].float())
    torch.testing.assert_close(out[0:1].float(), want0, atol=5 * tol, rtol=0)
    out.float().sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_alibi_padding_bias_finite(monkeypatch, dtype):
    """ALiBi's fp32 bias reaches SDPA finite in bf16 / fp16 (no -inf rows), output finite."""
    masks: list[torch.Tensor] = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        masks.append(kwargs["attn_mask"])
        return real(*args, **kwargs)

    monkeypatch.setattr(common.F, "scaled_dot_product_attention", spy)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=gen).to(dtype) for _ in range(3))
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1] = False
    out = alibi_attention(q, k, v, alibi_bias(5, 2, valid))
    assert bool(torch.isfinite(out).all())
    assert masks and masks[0].dtype == dtype and bool(torch.isfinite(masks[0]).all())


@pytest.mark.parametrize("padded", [False, True])
def test_native_gqa_equals_repeated_kv(monkeypatch, padded):
    """rope_attention's enable_gqa path gives the numbers (and grads) of the repeated-K/V path."""
    assert common.SDPA_NATIVE_GQA  # torch >= 2.5 here: the native path is the one under test
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 10, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 10, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 10, 16, generator=gen, requires_grad=True)
    valid = torch.ones(2, 10, dtype=torch.bool)
    if padded:
        valid[1, 7:] = False
    calls: list[bool] = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(bool(kwargs.get("enable_gqa", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(common.F, "scaled_dot_product_attention", spy)
    got = rope_attention(q, k, v, valid)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    assert calls == [True]
    monkeypatch.setattr(common, "SDPA_NATIVE_GQA", False)
    want = rope_attention(q, k, v, valid)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    assert calls == [True, False]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
