"""The blocked MDLMPE attention against the spec (reference_attention) and against plain RoPE.

Tiny fp32 shapes on CPU. Tolerances: both paths compute the same fp32 sums in a different order
(blocked: RoPE matmul + correction E; reference: rotated keys, one sum), so forward values and
gradients agree to a few fp32 ulps of O(1) numbers: 2e-5 absolute and relative is ~100 ulps of
headroom and still far below the size of the MDLMPE effect (|delta| ~ 0.1-0.25 rad here).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mdlmpe_ds.attention import blocked, blocked_coefficients, blocked_math, blocked_scores
from mdlmpe_ds.attention.blocked import blocked_attention
from mdlmpe_ds.attention.common import repeat_kv, rope_attention
from mdlmpe_ds.attention.reference import reference_attention
from mdlmpe_ds.pe.availability import availability, gaussian_taps, sine_basis, token_summaries
from mdlmpe_ds.pe.heads import query_head_mask
from mdlmpe_ds.pe.phase import PhaseMLP, mdlmpe_pairs, pair_phase
from mdlmpe_ds.pe.rope import apply_rotary, inverse_frequencies, rotary_angles

TAU_MAX = 0.25
KAPPA = 1e-4
THETA = 10000.0
MASK_ID = 0
TOL = {"atol": 2e-5, "rtol": 2e-5}


def _features(ids: torch.Tensor, valid: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A, D [B, L, F] from token ids through the real availability path (W = 3, sigma = 1)."""
    b, a = availability(ids, MASK_ID, valid)
    basis = sine_basis(ids.shape[1], head_dim, THETA)
    return token_summaries(b, a, basis, gaussian_taps(3, 1.0), 1e-6)


def _phase(num_pairs: int, seed: int, random: bool = True) -> PhaseMLP:
    """Phase MLP; ``random`` replaces the zero-initialised output layer so delta is far from 0."""
    torch.manual_seed(seed)
    mlp = PhaseMLP(num_pairs, 8)
    if random:
        with torch.no_grad():
            mlp.fc2.weight.normal_(0.0, 1.5)
            mlp.fc2.bias.normal_(0.0, 0.5)
    return mlp


def _inputs(
    batch: int = 2,
    q_heads: int = 4,
    kv_heads: int = 2,
    length: int = 11,
    head_dim: int = 8,
    seed: int = 0,
    pad: bool = True,
    dtype: torch.dtype = torch.float32,
    mask_fraction: float = 0.5,
):
    """Rotated q, k, v (leaf tensors), A, D from a random mask pattern, and key_valid."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (batch, length), generator=gen)
    ids[torch.rand(batch, length, generator=gen) < mask_fraction] = MASK_ID
    valid = torch.ones(batch, length, dtype=torch.bool)
    if pad and length > 3:
        valid[-1, -3:] = False  # right padding on the last sequence
    A, D = _features(ids, valid, head_dim)
    q = torch.randn(batch, q_heads, length, head_dim, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(batch, kv_heads, length, head_dim, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(batch, kv_heads, length, head_dim, generator=gen).to(dtype).requires_grad_()
    return q, k, v, A, D, valid


def _grads(out: torch.Tensor, tensors: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return list(torch.autograd.grad((out.float() * weight).sum(), tensors))


def test_zero_phase_equals_rope():
    """PhaseMLP as built (W2 = b2 = 0): delta = 0, so the layer is RoPE attention (docs/method.md
    "Initialisation")."""
    q, k, v, A, D, valid = _inputs(q_heads=6, kv_heads=3)
    mlp = _phase(4, seed=3, random=False)
    active = torch.tensor([True, False, True])
    out = blocked_attention(
        q,
        k,
        v,
        A,
        D,
        mlp.params(),
        tau_max=TAU_MAX,
        clip_kappa=KAPPA,
        active_kv=active,
        key_valid=valid,
        block_size=4,
    )
    torch.testing.assert_close(out, rope_attention(q, k, v, valid), atol=1e-6, rtol=1e-6)


CASES = [
    # (block_size, q_heads, kv_heads, active pattern or None, pad)
    (4, 4, 2, None, True),  # C does not divide L = 11
    (1, 4, 2, (True, False), True),  # C = 1, partial head mask
    (11, 4, 4, (False, True, True, False), True),  # C = L, MHA
    (32, 6, 2, (False, True), False),  # C > L, GQA 3:1
    (3, 4, 1, None, True),  # one KV head for all queries
    (5, 8, 4, (True, False, False, True), True),
]


@pytest.fixture(params=["eager", "summed"])
def layout(request, monkeypatch):
    """Runs a test on the eager pieces and again on the pieces torch.compile wraps (region 2 in its
    per-head-sums layout), uncompiled: their maths checked in milliseconds."""
    if request.param == "summed":
        monkeypatch.setattr(blocked, "EAGER", blocked_math.SUMMED)
        monkeypatch.setattr(blocked_scores, "KEY_CHUNK", 4)  # several key chunks in the k gradient
    return request.param


@pytest.mark.parametrize(("block_size", "q_heads", "kv_heads", "pattern", "pad"), CASES)
def test_matches_reference(layout, block_size, q_heads, kv_heads, pattern, pad):
    """Forward and the gradients of q, k, v, every phase-MLP parameter (and A, D when they are
    differentiable) equal the spec's, for C dividing L or not, C = 1, C >= L, GQA, head masks."""
    q, k, v, A, D, valid = _inputs(q_heads=q_heads, kv_heads=kv_heads, pad=pad, seed=block_size)
    mlp = _phase(4, seed=block_size)
    delta = pair_phase(A, D, A, D, mlp.params(), TAU_MAX, KAPPA)
    assert 0.1 < delta.abs().max() <= TAU_MAX  # the residual is large enough to matter
    active = None if pattern is None else torch.tensor(pattern)
    key_valid = valid if pad else None
    kwargs = {"tau_max": TAU_MAX, "clip_kappa": KAPPA, "active_kv": active, "key_valid": key_valid}
    leaves = [q, k, v, *mlp.params()]
    if block_size % 2:  # A, D differentiable, as with the learned ("mlp") coordinate
        A, D = A.detach().requires_grad_(), D.detach().requires_grad_()
        leaves += [A, D]
    ref = reference_attention(q, k, v, A, D, mlp.params(), **kwargs)
    out = blocked_attention(q, k, v, A, D, mlp.params(), block_size=block_size, **kwargs)
    torch.testing.assert_close(out, ref, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(
            blocked_attention(q, k, v, A, D, mlp.params(), block_size=block_size, **kwargs), ref, **TOL
        )
    # The correction is not negligible: blocked differs from plain RoPE by far more than TOL.
    if pattern is None or any(pattern):
        assert (out - rope_attention(q, k, v, key_valid)).abs().max() > 1e-3
    names = ("q", "k", "v", "w1", "b1", "w2", "b2", "A", "D")
    for name, got, want in zip(names, _grads(out, leaves), _grads(ref, leaves)):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_eager_cache_slices_match_reference(monkeypatch):
    """The eager path splits each block into cache-sized row slices (8 rows here: a 20-row block of
    L = 27 runs as 8 + 8 + 4, the last block as 7); forward and every gradient still equal the spec."""
    monkeypatch.setattr(blocked, "EAGER_SLICE_BYTES", 1)
    assert blocked._cache_rows(2, 8, 27) == 8
    q, k, v, A, D, valid = _inputs(batch=2, q_heads=6, kv_heads=3, length=27, seed=41)
    mlp = _phase(4, seed=41)
    kwargs = {"tau_max": TAU_MAX, "clip_kappa": KAPPA, "active_kv": torch.tensor([True, False, True])}
    kwargs["key_valid"] = valid
    A, D = A.detach().requires_grad_(), D.detach().requires_grad_()
    leaves = [q, k, v, *mlp.params(), A, D]
    ref = reference_attention(q, k, v, A, D, mlp.params(), **kwargs)
    out = blocked_attention(q, k, v, A, D, mlp.params(), block_size=20, **kwargs)
    torch.testing.assert_close(out, ref, **TOL)
    names = ("q", "k", "v", "w1", "b1", "w2", "b2", "A", "D")
    for name, got, want in zip(names, _grads(out, leaves), _grads(ref, leaves)):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_sign_convention_total_angle():
    """q^T R(delta) k on RoPE-rotated vectors = the un-rotated pair turned by (j - i) w_f + delta_ij,f."""
    batch, heads, length, head_dim = 1, 2, 9, 8
    num_pairs = head_dim // 2
    gen = torch.Generator().manual_seed(7)
    q0 = torch.randn(batch, heads, length, head_dim, generator=gen)
    k0 = torch.randn(batch, heads, length, head_dim, generator=gen)
    v = torch.randn(batch, heads, length, head_dim, generator=gen)
    ids = torch.randint(0, 3, (batch, length), generator=gen)  # ~1/3 masked (MASK_ID = 0)
    A, D = _features(ids, torch.ones(batch, length, dtype=torch.bool), head_dim)
    mlp = _phase(num_pairs, seed=5)
    cos, sin = rotary_angles(length, head_dim, THETA)
    out = blocked_attention(
        apply_rotary(q0, cos, sin),
        apply_rotary(k0, cos, sin),
        v,
        A,
        D,
        mlp.params(),
        tau_max=TAU_MAX,
        clip_kappa=KAPPA,
        block_size=4,
    )
    # Independent construction: total angle per (i, j, f), rotate the raw key pair, dot the raw query pair.
    pos = torch.arange(length, dtype=torch.float32)
    angle = (pos[None, :] - pos[:, None])[..., None] * inverse_frequencies(head_dim, THETA)  # [L, L, F]
    angle = angle.expand(batch, length, length, num_pairs).clone()
    angle[..., mdlmpe_pairs(num_pairs)] += pair_phase(A, D, A, D, mlp.params(), TAU_MAX, KAPPA)
    c, s = angle.cos().unsqueeze(1), angle.sin().unsqueeze(1)  # [B, 1, L, L, F]
    q1, q2 = q0[..., :num_pairs].unsqueeze(3), q0[..., num_pairs:].unsqueeze(3)  # [B, H, L, 1, F]
    k1, k2 = k0[..., :num_pairs].unsqueeze(2), k0[..., num_pairs:].unsqueeze(2)  # [B, H, 1, L, F]
    scores = (q1 * (c * k1 - s * k2) + q2 * (s * k1 + c * k2)).sum(-1) / math.sqrt(head_dim)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v, **TOL)


@pytest.mark.parametrize("mask_fraction", [0.0, 1.0], ids=["all_revealed", "all_masked"])
def test_extreme_availability_is_finite_and_exact(mask_fraction):
    """r = 0 or 1 everywhere: the clip keeps arccos differentiable; still equal to the reference."""
    q, k, v, A, D, valid = _inputs(mask_fraction=mask_fraction, seed=11)
    mlp = _phase(4, seed=11)
    kwargs = {"tau_max": TAU_MAX, "clip_kappa": KAPPA, "key_valid": valid}
    out = blocked_attention(q, k, v, A, D, mlp.params(), block_size=4, **kwargs)
    grads = _grads(out, [q, k, v, *mlp.params()])
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(out, reference_attention(q, k, v, A, D, mlp.params(), **kwargs), **TOL)


def test_bf16_inputs_track_fp32_reference():
    """bf16 q, k, v with the pair path in fp32: output is bf16 and within bf16 rounding of fp32.

    Tolerance: inputs are rounded to bf16 by construction, so the only extra error is the final
    cast of O(1) outputs to bf16 (relative step 2^-8 = 0.4%): atol = rtol = 1e-2.
    """
    q, k, v, A, D, valid = _inputs(dtype=torch.bfloat16, seed=13)
    mlp = _phase(4, seed=13)
    kwargs = {"tau_max": TAU_MAX, "clip_kappa": KAPPA, "key_valid": valid}
    out = blocked_attention(q, k, v, A, D, mlp.params(), block_size=4, **kwargs)
    assert out.dtype == torch.bfloat16
    ref = reference_attention(q.float(), k.float(), v.float(), A, D, mlp.params(), **kwargs)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    grads = _grads(out, [q, k, v])
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


def test_single_token_and_padding_only_rows(layout):
    """L = 1, and a batch row whose keys are all padding: outputs and gradients stay finite and
    equal the spec's (the padding-only row averages V uniformly, like the reference's softmax over
    equal finfo.min-biased scores, not a sum), gradients included."""
    q, k, v, A, D, _ = _inputs(length=1, pad=False, seed=17)
    mlp = _phase(4, seed=17)
    out = blocked_attention(q, k, v, A, D, mlp.params(), tau_max=TAU_MAX, clip_kappa=KAPPA)
    torch.testing.assert_close(out, rope_attention(q, k, v))  # one key: softmax weight 1 on it
    q, k, v, A, D, valid = _inputs(seed=19)
    valid[0] = False  # the first sequence is padding only
    A, D = _features(torch.randint(0, 5, valid.shape), valid, 8)
    kwargs = {"tau_max": TAU_MAX, "clip_kappa": KAPPA, "key_valid": valid}
    out = blocked_attention(q, k, v, A, D, mlp.params(), block_size=4, **kwargs)
    leaves = [q, k, v, *mlp.params()]
    grads = _grads(out, leaves)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    ref = reference_attention(q, k, v, A, D, mlp.params(), **kwargs)
    torch.testing.assert_close(out, ref, **TOL)
    uniform = repeat_kv(v, q.shape[1])[0].mean(dim=1, keepdim=True)  # [Hq, 1, d_h]
    torch.testing.assert_close(out[0], uniform.expand_as(out[0]), **TOL)
    for got, want in zip(grads, _grads(ref, leaves)):
        torch.testing.assert_close(got, want, **TOL)


def test_inactive_heads_are_plain_rope():
    """Inactive heads: outputs and the q/k/v gradients through them equal RoPE SDPA's."""
    q, k, v, A, D, valid = _inputs(q_heads=6, kv_heads=3, seed=23)
    mlp = _phase(4, seed=23)
    active = torch.tensor([False, True, False])
    off = ~query_head_mask(active, 6)  # query heads of KV heads 0 and 2
    out = blocked_attention(
        q,
        k,
        v,
        A,
        D,
        mlp.params(),
        tau_max=TAU_MAX,
        clip_kappa=KAPPA,
        active_kv=active,
        key_valid=valid,
        block_size=4,
    )
    rope = rope_attention(q, k, v, valid)
    torch.testing.assert_close(out[:, off], rope[:, off], atol=1e-6, rtol=1e-6)
    assert (out[:, ~off] - rope[:, ~off]).abs().max() > 1e-3  # the active head did change
    weight = torch.randn(out.shape) * off.view(1, -1, 1, 1)  # loss on the inactive heads only
    got = torch.autograd.grad((out * weight).sum(), [q, k, v])
    want = torch.autograd.grad((rope * weight).sum(), [q, k, v])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_no_active_head_does_no_pair_work(monkeypatch):
    """All heads off: plain RoPE, and the pair path is never entered."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a pair block ran with no active head")

    monkeypatch.setattr(blocked, "block_attention", forbidden)
    q, k, v, A, D, valid = _inputs()
    out = blocked_attention(
        q,
        k,
        v,
        A,
        D,
        _phase(4, seed=1).params(),
        tau_max=TAU_MAX,
        clip_kappa=KAPPA,
        active_kv=torch.zeros(2, dtype=torch.bool),
        key_valid=valid,
    )
    assert torch.equal(out, rope_attention(q, k, v, valid))


def _block_inputs(gen: torch.Generator, kv_heads: int, group: int, length: int, pad: bool) -> list:
    """float64 inputs of one BlockAttention call (C = 3 rows, d_h = 8), pair ratios hitting the clip."""
    batch, rows, head_dim, hidden = 2, 3, 8, 5
    num_pairs = head_dim // 2

    def leaf(*shape, low=0.0, uniform=False):
        draw = torch.rand if uniform else torch.randn
        return (draw(*shape, generator=gen, dtype=torch.float64) + low).requires_grad_()

    q_rows = leaf(batch, kv_heads, group, rows, head_dim)
    k, v = leaf(batch, kv_heads, length, head_dim), leaf(batch, kv_heads, length, head_dim)
    k1t, k2t = leaf(batch, kv_heads, num_pairs // 2, length), leaf(batch, kv_heads, num_pairs // 2, length)
    a_rows, a_cols = leaf(batch, rows, num_pairs, uniform=True), leaf(batch, num_pairs, length, uniform=True)
    d_rows = leaf(batch, rows, num_pairs, low=1.0, uniform=True)
    d_cols = leaf(batch, num_pairs, length, low=1.0, uniform=True)
    with torch.no_grad():
        a_rows[0, 0], d_rows[0, 0], a_cols[0, :, 0], d_cols[0, :, 0] = 0.0, 1.0, 0.0, 1.0  # r = 0: clipped
    weights = [
        leaf(*shape)
        for shape in ((hidden, num_pairs), (hidden,), (num_pairs // 2, hidden), (num_pairs // 2,))
    ]
    bias = None
    if pad:
        bias = torch.zeros(batch, 1, 1, 1, length, dtype=torch.float64)
        bias[-1, ..., -2:] = torch.finfo(torch.float64).min
    return [q_rows, k, v, k1t, k2t, a_rows, d_rows, a_cols, d_cols, *weights, bias]


@pytest.mark.parametrize("pieces", ["EAGER", "SUMMED"])
@pytest.mark.parametrize("ad_grad", [False, True], ids=["weights_vjp", "autograd_region1"])
def test_block_backward_gradcheck(pieces, ad_grad):
    """BlockAttention's hand-derived backward (both layouts) against finite differences in float64:
    every input, through the region-1 vjp (A, D constant) or autograd (A, D differentiable)."""
    gen = torch.Generator().manual_seed(29)
    inputs = _block_inputs(gen, kv_heads=2, group=2, length=5, pad=True)
    if not ad_grad:
        for t in inputs[5:9]:
            t.requires_grad_(False)
    run = getattr(blocked_math, pieces)

    def block(*tensors):
        return blocked_math.BlockAttention.apply(run, *tensors, 0.4, TAU_MAX, KAPPA)

    assert torch.autograd.gradcheck(block, inputs)


def test_region_one_vjp_matches_autograd():
    """coefficients_vjp (the hand-derived region-1 backward) against autograd through
    coefficients, float64, with pair ratios that hit the clip."""
    gen = torch.Generator().manual_seed(41)
    region1 = _block_inputs(gen, kv_heads=1, group=1, length=4, pad=False)[5:13]
    weights = region1[4:]
    alpha, beta, asin_x, u, z = blocked_coefficients.coefficients_for_backward(*region1, TAU_MAX, KAPPA)
    grad_alpha, grad_beta = torch.randn_like(alpha), torch.randn_like(beta)
    want = torch.autograd.grad((alpha, beta), weights, (grad_alpha, grad_beta))
    got = blocked_coefficients.coefficients_vjp(asin_x, u, z, weights[2], TAU_MAX, grad_alpha, grad_beta)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def _largest_saved_for_backward(**kwargs) -> int:
    """Elements of the largest tensor autograd keeps for backward in one blocked_attention call
    (the 48-token, 2-head case of the saved-tensor tests; ``kwargs`` pick the path)."""
    q, k, v, A, D, valid = _inputs(batch=1, q_heads=2, kv_heads=2, length=48, seed=31)
    mlp = _phase(4, seed=31)
    largest = 0

    def pack(t):
        nonlocal largest
        largest = max(largest, t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blocked_attention(
            q, k, v, A, D, mlp.params(), tau_max=TAU_MAX, clip_kappa=KAPPA, key_valid=valid, block_size=8,
            **kwargs,
        )  # fmt: skip
    return largest


def test_blocks_keep_no_pair_tensor_for_backward(layout):
    """Each block keeps only its inputs, output and log-sum-exp for backward: nothing of size
    L x L or C x L x |M| (a block's pair tensor, 8 x 48 x 2 here) is saved."""
    per_sequence = 1 * 2 * 48 * 8  # B * Hq * L * d_h: the size of an input
    assert _largest_saved_for_backward() <= per_sequence


def test_block_starts_cover_every_row_once():
    """The aligned schedule (compiled path) shifts the ragged last block back; rows stay a partition."""
    for length, size in [(11, 4), (8, 4), (3, 8), (1, 1), (130, 128)]:
        for aligned in (False, True):
            starts = blocked._block_starts(length, size, aligned)
            rows = [r for start, new in starts for r in range(new, min(start + size, length))]
            assert rows == list(range(length)), (length, size, aligned)
            if aligned and length >= size:
                assert all(min(start + size, length) - start == size for start, _ in starts)


def test_rejects_mismatched_features():
    q, k, v, A, D, _ = _inputs()
    with pytest.raises(ValueError, match="A "):
        blocked_attention(
            q, k, v, A[:, :-1], D[:, :-1], _phase(4, 1).params(), tau_max=TAU_MAX, clip_kappa=KAPPA
        )


def test_compiled_pieces_compile_past_dynamos_default_limit():
    """A training run meets more shapes than dynamo's default 8 (active-head counts x widths);
    every one of them gets its own graph instead of an eager fallback."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    piece = blocked_math._compiled(lambda x: x * 2.0 + 1.0)
    before = counters["stats"]["unique_graphs"]
    shapes = 9  # one past the default
    for n in range(1, shapes + 1):
        torch.testing.assert_close(piece(torch.ones(n)), torch.full((n,), 3.0))
    assert counters["stats"]["unique_graphs"] - before == shapes
    assert shapes <= blocked_math.GRAPH_BUDGET


def test_compiled_regions_match_eager():
    """compile=True gives the eager numbers (tiny shapes; the first call compiles, ~1 min on CPU)."""
    q, k, v, A, D, valid = _inputs(q_heads=4, kv_heads=2, length=11, seed=37)
    mlp = _phase(4, seed=37)
    kwargs = {
        "tau_max": TAU_MAX,
        "clip_kappa": KAPPA,
        "key_valid": valid,
        "block_size": 4,
        "active_kv": torch.tensor([True, False]),
    }
    leaves = [q, k, v, *mlp.params()]
    eager = blocked_attention(q, k, v, A, D, mlp.params(), **kwargs)
    compiled = blocked_attention(q, k, v, A, D, mlp.params(), compile=True, **kwargs)
    torch.testing.assert_close(compiled, eager, **TOL)
    for got, want in zip(_grads(compiled, leaves), _grads(eager, leaves)):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MDLMPE_DS_TEST_COMPILE") != "1", reason="set MDLMPE_DS_TEST_COMPILE=1")
def test_compiled_flash_blocks_match_reference():
    """compile=True through inductor on a length the key chunks divide, with A, D differentiable
    (autograd through compiled region 1) and without (hand-derived region-1 backward)."""
    for ad_grad in (False, True):
        q, k, v, A, D, valid = _inputs(q_heads=4, kv_heads=2, length=128, seed=53)
        mlp = _phase(4, seed=53)
        leaves = [q, k, v, *mlp.params()]
        if ad_grad:
            A, D = A.detach().requires_grad_(), D.detach().requires_grad_()
            leaves += [A, D]
        kwargs = {"tau_max": TAU_MAX, "clip_kappa": KAPPA, "key_valid": valid}
        ref = reference_attention(q, k, v, A, D, mlp.params(), **kwargs)
        out = blocked_attention(q, k, v, A, D, mlp.params(), block_size=32, compile=True, **kwargs)
        torch.testing.assert_close(out, ref, **TOL)
        for got, want in zip(_grads(out, leaves), _grads(ref, leaves)):
            torch.testing.assert_close(got, want, **TOL)


class _CountOps(TorchDispatchMode):
    """Counts every aten op dispatched (each one a kernel launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_block_row_cap_is_cpu_only():
    """The L2-sized row cap (8 rows at L = 1024, d_h 128) is a CPU tuning: other devices keep C."""
    shape = dict(block_size=128, batch=1, length=1024, num_pairs=64, hidden_width=32, num_heads=32)
    assert blocked.eager_block_rows(**shape, device=torch.device("cpu")) == 8
    assert blocked.eager_block_rows(**shape, device=torch.device("cuda")) == 128
    assert blocked.eager_block_rows(**shape, device=torch.device("meta")) == 128


def test_default_path_off_cpu_is_not_launch_bound():
    """Ops dispatched by one MDLMPE layer through the default config (backend 'auto') on a non-CPU
    device, fwd + bwd, LLaDA-like heads (32 heads, d_h 128) at L = 1024. Meta tensors (shapes only,
    no arithmetic) stand in for a GPU: 'auto' picks the blocked path for them, which must not apply
    the CPU's 8-row cap. With 128-row blocks one block dispatches a few thousand ops (the per-head
    loops of region 2), 8 blocks ~10,000-30,000; the capped path ran 128 blocks, ~460,000 ops.
    Bound: 40,000."""
    from mdlmpe_ds.attention import AttentionImpl, mdlmpe_attention
    from mdlmpe_ds.pe.config import MDLMPEConfig

    heads, length, head_dim = 32, 1024, 128

    def leaf(*shape):
        return torch.empty(*shape, device="meta", requires_grad=True)

    q, k, v = (
        leaf(1, heads, length, head_dim),
        leaf(1, heads, length, head_dim),
        leaf(1, heads, length, head_dim),
    )
    A = torch.empty(1, length, head_dim // 2, device="meta")
    mlp = PhaseMLP(head_dim // 2, 32, device="meta")
    with _CountOps() as ops:
        out = mdlmpe_attention(q, k, v, A, A, mlp.params(), MDLMPEConfig(), AttentionImpl())
        out.sum().backward()
    assert q.grad is not None and mlp.fc1.weight.grad is not None
    assert ops.count <= 40_000, f"{ops.count} aten ops for one layer (launch-bound on a GPU)"
