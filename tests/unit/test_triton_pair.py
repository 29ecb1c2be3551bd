"""The ``triton-pair`` backend (pair-bias kernels + SDPA with an additive bias) equals the
reference (the spec), forward and every gradient, under poisoned allocations.

The kernels run in Triton's CPU interpreter in a child process (TRITON_INTERPRET must be set
before triton decorates them, see test_triton_attention.py), with the poison and the inputs of
test_attention_shapes.py: every uninitialised torch allocation is NaN, so an element no kernel
wrote fails the comparison. Each case compares the output and the gradients of q, k, v and the
phase MLP's four tensors. The interpreter runs every program in Python, so the cases are tiny.

What the cases reach: lengths that the tile does not divide (48 at tile 32: a ragged last row
and key tile in every kernel), ragged key padding and a padding-only sequence, GQA 2:1 (the key
kernel's sum over the query heads of a KV head), some KV heads inactive (routed to plain SDPA),
none active, bf16 (the bias stored in bf16), and the sm_90 launch settings at L = 1, 33, 42 and
272 (the pair arrays padded to whole tiles: 31 padding rows at L = 1).

Tolerances as in test_attention_shapes.py (fp32: 2e-5 on O(1) values; bf16: 3e-2).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
import torch
from test_attention_shapes import (
    OUTPUTS,
    Case,
    _check,
    _inputs,
    attention_runner,
    pair_chunks,
    poisoned_allocations,
)

#: launch: 'tile=N' (N x N tiles, pairs in chunks of 2; the backward's loop splits chosen per call,
#: ``launch.pair_backward_splits``: 2 to 3 here), 'tile=N,keys=S,rows=R' (the same with S key
#: splits for the query side, R row splits for the key side), 'sm90' (what the launcher picks on an
#: H100).
PAIR_CASES = [
    # L = 48 at tile 32; batch 3, ragged padding, the last sequence all padding; GQA 2:1.
    Case(48, pads=(0, 5, -1), hq=4, hkv=2, launch="tile=32"),
    # bf16 (bias and its gradient in bf16), half the KV heads active, L = 21 at tile 8.
    Case(21, pads=(2, 0), hq=4, hkv=2, active="01", dtype="bfloat16", launch="tile=8"),
    # no KV head active: plain RoPE SDPA, no kernel launched.
    Case(19, pads=(0, 4), hq=2, hkv=2, active="00", launch="tile=8"),
    # the sm_90 launch settings (16 x 8 tiles, the key side 32 x 8, chunk 16) at L = 42: the last row
    # and key tiles ragged in all three kernels.
    Case(42, pads=(7,), hq=2, hkv=1, active="1", dtype="bfloat16", launch="sm90"),
    # the pair arrays padded to LP = 32 at the sm_90 tiles: one position (31 rows of padding), and
    # 33 (one past a whole key-side tile; the second sequence padded).
    Case(1, pads=(0,), hq=2, hkv=1, active="1", dtype="bfloat16", launch="sm90"),
    Case(33, pads=(0, 3), hq=2, hkv=2, active="11", dtype="bfloat16", launch="sm90"),
    # d_h 16: 4 MDLMPE pairs in chunks of 2, so each kernel's pair-chunk loop runs twice (as with
    # LLaDA's 32 pairs in chunks of 16 on a GPU); GQA 2:1.
    Case(21, pads=(0, 3), hq=4, hkv=2, head_dim=16, launch="tile=8"),
    # PairLaunchConfig.half_pairs: the forward's and the query side's pair arithmetic in fp16 at the
    # sm_90 settings (L = 42: ragged tiles); all three kernels' with two pair chunks and GQA 2:1.
    Case(42, pads=(7,), hq=2, hkv=1, active="1", dtype="bfloat16", launch="sm90,half"),
    Case(
        26,
        pads=(2,),
        hq=2,
        hkv=1,
        active="1",
        head_dim=16,
        dtype="bfloat16",
        launch="tile=8,keys=2,rows=2,half=all",
    ),
    # fp32 inputs under half_pairs run the fp32 kernels: fp32's tolerance (fp16 arithmetic errs ~1e-3)
    Case(21, pads=(0, 3), hq=2, hkv=1, active="1", launch="tile=8,half=all"),
]
#: The backward's split loops forced: L = 52 at tile 8 is 7 row and 7 key tiles; 3 splits are
#: 3 + 3 + 1 tiles (the last split ragged, its last tile too), 1 split the whole loop. Batch 2 with
#: padding, GQA 2:1 (the key side's partials summed over both query heads of a KV head).
SPLIT_CASES = [
    Case(52, pads=(0, 9), hq=4, hkv=2, launch="tile=8,keys=3,rows=3"),
    Case(52, pads=(4, 0), hq=4, hkv=2, launch="tile=8,keys=1,rows=1"),
    # two pair chunks (d_h 16) under forced splits, bf16, GQA 2:1 with one KV head.
    Case(
        26, pads=(2, 0), hq=2, hkv=1, active="1", head_dim=16, dtype="bfloat16", launch="tile=8,keys=2,rows=2"
    ),
]
#: ``make test-all`` (marker ``slow``): the sm_90 settings at L = 272 (~90 s on an idle core).
SLOW_CASES = [Case(272, pads=(7,), hq=2, hkv=1, active="1", dtype="bfloat16", launch="sm90")]


def _launch(case: Case):
    """The case's PairLaunchConfig. ',half' after the settings: the pair arithmetic of
    ``HALF_PAIR_KERNELS`` in fp16; ',half=all': of all three kernels (``half_pairs``)."""
    from dataclasses import replace

    from mdlmpe_ds.attention.triton.launch import (
        HALF_PAIR_KERNELS,
        PAIR_KERNELS,
        PairLaunchConfig,
        pair_launch_config,
    )

    settings, *rest = case.launch.split(",half")
    half = {"": HALF_PAIR_KERNELS, "=all": PAIR_KERNELS}[rest[0]] if rest else ()
    if settings == "sm90":
        return replace(pair_launch_config(case.head_dim, getattr(torch, case.dtype), 90), half_pairs=half)
    tile, *splits = settings.removeprefix("tile=").split(",")
    forced = {"keys": "key_splits", "rows": "row_splits"}
    extra = {forced[k]: int(v) for k, v in (item.split("=") for item in splits)}
    return PairLaunchConfig.uniform(int(tile), int(tile), pair_chunk=2, half_pairs=half, **extra)


def compare_pair(case: Case) -> dict[str, float]:
    """Max abs error of the triton-pair backend against the reference per output and gradient,
    under poisoned allocations; plus the reference's largest value ('scale')."""
    from mdlmpe_ds.attention.reference import reference_attention
    from mdlmpe_ds.attention.triton.pair_backend import pair_bias_attention

    run = attention_runner(_inputs(case))
    with poisoned_allocations():
        want = run(reference_attention)
        got = run(pair_bias_attention, launch=_launch(case))
    errors = {n: (w.float() - g.float()).abs().max().item() for n, w, g in zip(OUTPUTS, want, got)}
    errors["scale"] = max(w.float().abs().max().item() for w in want[:4])
    return errors


#: ',overflow' (``compare_half_fallback``): q and k scaled so that fp16 pair arithmetic overflows.
OVERFLOW_CASE = Case(
    21, pads=(0, 3), hq=2, hkv=1, active="1", dtype="bfloat16", launch="tile=8,half=all,overflow"
)


def compare_half_fallback(case: Case) -> dict[str, float]:
    """q, k scaled by 2000 (|q| |k| per pair far above what fp16 holds): max abs difference of the
    fp16 config (``half_pairs``) from the fp32 one, per output and gradient (0: the call ran in
    fp32), and the same with ``half_pairs_fit`` forced to True ('forced:' names: fp16 as asked)."""
    from dataclasses import replace

    from mdlmpe_ds.attention.triton import pair_backend

    q, k, *rest = _inputs(case)
    with torch.no_grad():
        q, k = (t.detach().mul(2000.0).requires_grad_() for t in (q, k))
    run = attention_runner((q, k, *rest))
    half = _launch(replace(case, launch=case.launch.removesuffix(",overflow")))
    fp32 = replace(half, half_pairs=())
    with poisoned_allocations():
        want = run(pair_backend.pair_bias_attention, launch=fp32)
        got = run(pair_backend.pair_bias_attention, launch=half)
        fit = pair_backend.half_pairs_fit
        pair_backend.half_pairs_fit = lambda *args: True
        try:
            forced = run(pair_backend.pair_bias_attention, launch=half)
        finally:
            pair_backend.half_pairs_fit = fit
    diff = {n: (w.float() - g.float()).abs().max().item() for n, w, g in zip(OUTPUTS, want, got)}
    diff.update(
        {f"forced:{n}": (w.float() - g.float()).abs().max().item() for n, w, g in zip(OUTPUTS, want, forced)}
    )
    return diff


def _interpret(cases: list[Case], timeout: int = 900) -> dict[str, dict[str, float]]:
    """Run ``cases`` through the pair kernels in an interpreter child; errors per case name."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    payload = json.dumps([asdict(c) for c in cases])
    proc = subprocess.run(
        [sys.executable, __file__], input=payload, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode:
        raise AssertionError(f"interpreter child failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def pair_results() -> dict[str, dict[str, float]]:
    return _interpret(PAIR_CASES)


@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: c.name)
def test_pair_bias_matches_reference(pair_results, case):
    _check(case, pair_results[case.name])


def test_half_pairs_fall_back_to_fp32_where_fp16_would_overflow():
    """A call whose q, k are too large for fp16 runs the fp32 kernels bit for bit, and it must: the
    same call forced into fp16 returns non-finite or far-off values."""
    diff = _interpret([OVERFLOW_CASE])[OVERFLOW_CASE.name]
    assert all(diff[n] == 0.0 for n in OUTPUTS), diff
    forced = [diff[f"forced:{n}"] for n in OUTPUTS]
    assert any(not value <= 1.0 for value in forced), diff  # NaN / inf or a wrong gradient


def test_half_pairs_fit_bounds_what_the_fp16_kernels_form():
    """At the largest q, k that ``half_pairs_fit`` accepts, the kernels' fp16 expressions (in numpy
    fp16, every operation rounded) at their worst signs and phases stay finite with room to spare,
    and the bound is not slack by more than the 2x margin it keeps; dBias's shift puts its largest
    value in [1, 2)."""
    import numpy as np

    from mdlmpe_ds.attention.triton.pair_backend import HALF_LIMIT, dbias_shift, half_pairs_fit, pair_maxima

    tau, chunks = 0.25, 2
    h = np.float16
    c = (1 - math.cos(tau)) + math.sin(tau)
    # the largest accepted q_max = k_max, found by bisection
    lo, hi = 1.0, 1e4
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if half_pairs_fit(mid, mid, mid * mid, tau, chunks) else (lo, mid)
    x = h(lo)
    assert not half_pairs_fit(lo * 1.01, lo * 1.01, (lo * 1.01) ** 2, tau, chunks)
    worst = 0.0
    for delta in np.linspace(-tau, tau, 41):
        al, be = h(math.cos(delta) - 1), h(math.sin(delta))
        for s1, s2 in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
            q1, q2, k1, k2 = x, h(s1) * x, x, h(s2) * x
            u1, u2 = al * k1 - be * k2, al * k2 + be * k1
            e = h(0)
            for _ in range(chunks):  # the forward: summed over the pair chunks in fp16
                e = e + (q1 * u1 + q2 * u2)
            ds = h(1.999)
            dq1, term = ds * u1, ds * (q2 * (k1 + u1) - q1 * (k2 + u2))  # the query side
            dk1 = ds * (al * q1 + be * q2)  # the key side
            worst = max(worst, *(abs(float(v)) for v in (e, dq1, term, dk1)))
    assert np.isfinite(worst) and worst <= HALF_LIMIT
    assert worst >= HALF_LIMIT / 4, "the bound is slacker than its 2x margin"
    assert c < 0.29 and not half_pairs_fit(float("nan"), 1.0, 1.0, tau, chunks)
    # per pair: an outlier of q in one pair and of k in another do not meet
    assert half_pairs_fit(1000.0, 1000.0, 1000.0, tau, chunks) and not half_pairs_fit(
        1000.0, 1000.0, 1e6, tau, chunks
    )
    qpair = torch.zeros(1, 2, 3, 4)  # [B, H, LP, 2 NMP]: NMP = 2 pairs
    qpair[0, 1, 2, 3], qpair[0, 0, 1, 0] = -7.0, 5.0  # component 1 of pair 1; component 0 of pair 0
    assert pair_maxima(qpair).tolist() == [5.0, 7.0]
    for top in (3e-9, 1.9e-5, 0.7, 1.0, 5e3):
        scaled = top * dbias_shift(torch.tensor([top, -top / 3]), 1.0)
        assert 1.0 <= scaled < 2.0, top
    assert dbias_shift(torch.zeros(3), 0.1) == 1.0 == dbias_shift(torch.tensor([float("inf")]), 0.1)


@pytest.fixture(scope="module")
def split_results() -> dict[str, dict[str, float]]:
    return _interpret(SPLIT_CASES)


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.name)
def test_split_backward_matches_reference(split_results, case):
    _check(case, split_results[case.name])


def test_split_cases_reach_a_ragged_last_split_and_one_split():
    from mdlmpe_ds.attention.triton.launch import pair_backward_splits

    seen = []
    for case in SPLIT_CASES[:2]:  # the third: two pair chunks under 2 + 2 splits
        config = _launch(case)
        splits = pair_backward_splits(
            config,
            length=case.length,
            batch=2,
            num_heads=4,
            num_kv=2,
            padded_pairs=2,
            bias_itemsize=4,
            sms=132,
        )
        tiles = math.ceil(case.length / config.tile_m)
        assert tiles == math.ceil(case.length / config.tile_n) == 7 and case.length % config.tile_m
        seen.append((splits["q"], splits["k"]))
    assert seen == [((3, 3), (3, 3)), ((1, 7), (1, 7))]  # 3 + 3 + 1 tiles; the whole loop


def test_backward_splits_fill_the_gpu_within_the_slot_bound():
    """The rule of ``pair_backward_splits`` at LLaDA-8B's shapes (Hq = Hkv = 32, |M| = 32, bf16)
    on an H100 (132 SMs): >= 4 waves of programs where the slot bound allows, never more fp32
    partial bytes than 1/8 of the bias and its gradient per kernel, no empty split, forced
    values taken as given."""
    from mdlmpe_ds.attention.triton.launch import (
        PAIR_SLOT_FRACTION,
        PairLaunchConfig,
        pair_backward_splits,
        pair_padded_length,
        split_loop,
    )

    config = PairLaunchConfig()
    got = {}
    for length in (1024, 2048, 4096, 8192):
        for batch in (1, 4):
            shape = dict(length=length, batch=batch, num_heads=32, num_kv=32, padded_pairs=32)
            splits = pair_backward_splits(config, **shape, bias_itemsize=2, sms=132)
            bias_bytes = batch * 2 * 32 * length**2 * 2
            # (programs' tile, loop's tile): the query side's 16 x 8, the key side's 32 x 8
            for side, tile, loop_tile in (("q", 16, 8), ("k", 8, 32)):
                parts, per = splits[side]
                loop = math.ceil(length / loop_tile)
                assert (parts - 1) * per < loop <= parts * per  # every part has tiles
                assert parts * batch * 32 * length * 64 * 4 <= PAIR_SLOT_FRACTION * bias_bytes
                programs = parts * batch * math.ceil(length / tile)
                capped = (parts + 1) * batch * 32 * length * 64 * 4 > PAIR_SLOT_FRACTION * bias_bytes
                assert programs >= 4 * 132 or capped
            got[length, batch] = (splits["q"][0], splits["k"][0])
    assert got[1024, 1] == (2, 2) and got[2048, 1] == (4, 3) and got[4096, 1] == (3, 2)  # docstring
    assert got[8192, 1] == (2, 1) and got[4096, 4] == (1, 1)
    # A d_h 32 model on a GPU: 8 pairs padded to 16 (``pair_components``), at a ragged length
    # (LP = 1024 rows for L = 1000). The bound holds for the partials' real size; counted at 8 pairs
    # and L rows, the rule gave 8 query-side splits here, twice the bound's bytes.
    for length in (1000, 1024, 2000):
        small = dict(length=length, batch=1, num_heads=8, num_kv=8, padded_pairs=16)
        splits = pair_backward_splits(config, **small, bias_itemsize=2, sms=132)
        padded = pair_padded_length(config, length)
        assert padded % 32 == 0 and padded - 32 < length <= padded
        for side in ("q", "k"):
            partial_bytes = splits[side][0] * 8 * padded * 2 * 16 * 4
            assert partial_bytes <= PAIR_SLOT_FRACTION * 2 * 8 * length**2 * 2, (length, side)
        got[length, "d_h 32"] = splits["q"][0]
    assert got[1024, "d_h 32"] == 4 and got[1000, "d_h 32"] == 3
    forced = PairLaunchConfig(key_splits=5, row_splits=2000)
    splits = pair_backward_splits(forced, **shape, bias_itemsize=2, sms=132)
    assert splits == {"q": split_loop(1024, 5), "k": (256, 1)} and split_loop(1024, 5) == (5, 205)


@pytest.mark.slow
def test_pair_bias_matches_reference_at_sm90_length_272():
    for case in SLOW_CASES:
        _check(case, _interpret([case], timeout=3600)[case.name])


def test_cases_reach_the_ragged_tiles_and_head_sets():
    from mdlmpe_ds.attention.triton.launch import PairLaunchConfig

    assert all(c.length % _launch(c).tile_m and c.length % _launch(c).tile_n for c in PAIR_CASES[:2])
    assert PAIR_CASES[3].length % 8 and PAIR_CASES[3].length % 16  # ragged at the sm_90 tiles
    assert _launch(PAIR_CASES[3]) == PairLaunchConfig() == _launch(SLOW_CASES[0])
    assert any(-1 in c.pads for c in PAIR_CASES) and any(c.hq == 2 * c.hkv for c in PAIR_CASES)
    assert {c.active for c in PAIR_CASES} >= {"11", "01", "00"}
    assert max(pair_chunks(c) for c in PAIR_CASES + SPLIT_CASES) >= 2  # chunk loops run twice


def _correction(q, k, A, D, mlp, tau_max=0.25, clip_kappa=1e-4):
    """E [B, H, L, L] of docs/method.md "The correction form", in fp32 torch (the spec's maths)."""
    from mdlmpe_ds.pe.phase import mdlmpe_pairs, pair_phase

    delta = pair_phase(A, D, A, D, mlp.params(), tau_max, clip_kappa)  # [B, L, L, NM]
    alpha, beta = torch.cos(delta) - 1.0, torch.sin(delta)
    pairs = mdlmpe_pairs(q.shape[-1] // 2)
    half = q.shape[-1] // 2
    q1, q2 = q[..., pairs].float(), q[..., pairs + half].float()  # [B, H, L, NM]
    k1, k2 = k[..., pairs].float(), k[..., pairs + half].float()
    c = torch.einsum("bhim,bhjm->bhijm", q1, k1) + torch.einsum("bhim,bhjm->bhijm", q2, k2)
    s = torch.einsum("bhim,bhjm->bhijm", q2, k1) - torch.einsum("bhim,bhjm->bhijm", q1, k2)
    return (alpha[:, None] * c + beta[:, None] * s).sum(-1)


def test_bias_in_bf16_costs_a_bounded_error():
    """Why the bias is stored in the attention's dtype (bf16 in training): with bf16 q, k, v, the
    rounding of E * scale to bf16 moves each logit by at most 2^-8 |E scale| (bf16 unit
    roundoff), which moves the output by at most 2 max|logit change| max|v| (the softmax's
    l1 sensitivity), and its error on the MDLMPE part of the output (reference minus plain RoPE)
    stays below 1% (docs/method.md "Precision": an all-bf16 pair path 13%, the fp32 one 0.4%).
    The bias as the reference's correction also pins the sign convention: in fp32 it reproduces
    the reference to rounding."""
    from mdlmpe_ds.attention.common import rope_attention
    from mdlmpe_ds.attention.reference import reference_attention
    from mdlmpe_ds.pe.phase import PhaseMLP

    gen = torch.Generator().manual_seed(3)
    batch, heads, length, head_dim = 2, 4, 64, 32
    torch.manual_seed(3)
    mlp = PhaseMLP(head_dim // 2, 16)
    with torch.no_grad():
        mlp.fc2.weight.normal_(0.0, 0.5, generator=gen)
        mlp.fc2.bias.normal_(0.0, 0.5, generator=gen)
    q, k, v = (
        torch.randn(batch, heads, length, head_dim, generator=gen).bfloat16().float() for _ in range(3)
    )
    D = torch.rand(batch, length, head_dim // 2, generator=gen) + 0.5
    A = torch.rand(batch, length, head_dim // 2, generator=gen) * D
    scale = 1.0 / math.sqrt(head_dim)
    with torch.no_grad():
        want = reference_attention(q, k, v, A, D, mlp.params(), tau_max=0.25, clip_kappa=1e-4)
        bias = _correction(q, k, A, D, mlp) * scale
        sdpa = torch.nn.functional.scaled_dot_product_attention
        exact = sdpa(q, k, v, attn_mask=bias, scale=scale)
        rounded = sdpa(q, k, v, attn_mask=bias.bfloat16().float(), scale=scale)
        plain = rope_attention(q, k, v)
    assert (exact - want).abs().max() <= 2e-5  # the bias form is the reference (sign included)
    logit_change = (bias.bfloat16().float() - bias).abs().max()
    assert logit_change <= 2**-8 * bias.abs().max()
    error = (rounded - want).abs().max()
    assert error <= 2 * logit_change * v.abs().max() + 2e-5
    part = (want - plain).norm()
    assert part > 0.05 * want.norm()  # the MDLMPE part is not negligible here (~8%)
    assert (rounded - want).norm() <= 0.01 * part


def test_pair_launch_settings_resolve(monkeypatch):
    from mdlmpe_ds.attention.triton.launch import pair_launch_config
    from mdlmpe_ds.attention.triton.pair_backend import resolve_pair_launch

    q = torch.zeros(1, 2, 4, 128, dtype=torch.bfloat16)
    assert resolve_pair_launch(q) == pair_launch_config(128, torch.bfloat16, 90)
    with pytest.raises(ValueError, match="d_h=256"):
        pair_launch_config(256, torch.bfloat16, 90)


@pytest.mark.parametrize("mask", ["one_too_many", "head_indices", "float_mask"])
def test_refuses_a_wrong_head_mask(monkeypatch, mask):
    """The dispatcher's head-mask check holds for this backend too, before any kernel."""
    from test_attention_shapes import WRONG_HEAD_MASKS

    from mdlmpe_ds.attention.triton.pair_backend import pair_bias_attention

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # passes the availability check; no kernel runs
    q, k, v, A, D, _, _, mlp, _ = _inputs(Case(6, pads=(0,), hq=4, hkv=2))
    with pytest.raises(ValueError, match="active_kv"):
        pair_bias_attention(
            q, k, v, A, D, mlp.params(), tau_max=0.25, clip_kappa=1e-4, active_kv=WRONG_HEAD_MASKS[mask]
        )


def test_run_time_choice_reaches_the_backend(monkeypatch):
    """``--attention.backend triton-pair`` is a valid run-time choice, never picked by 'auto', and
    ``mdlmpe_attention`` calls this backend with the run's maths settings."""
    from mdlmpe_ds.attention import AttentionImpl, choose_backend, mdlmpe_attention
    from mdlmpe_ds.attention.triton import pair_backend
    from mdlmpe_ds.pe.config import MDLMPEConfig

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    monkeypatch.setattr(pair_backend, "pair_bias_attention", lambda *a, **kw: calls.append(kw) or a[0])
    impl = AttentionImpl.from_dict({"backend": "triton-pair"})
    assert choose_backend("triton-pair", "cpu") == "triton-pair"
    assert choose_backend("auto", "cuda") == "triton"  # not the default
    q, k, v, A, D, _, active, mlp, _ = _inputs(Case(6, pads=(1,), hq=4, hkv=2, active="01"))
    mdlmpe_attention(q, k, v, A, D, mlp.params(), MDLMPEConfig(tau_max=0.3), impl, active_kv=active)
    assert len(calls) == 1 and calls[0]["tau_max"] == 0.3 and calls[0]["active_kv"] is active


def test_memory_plan_counts_the_bias_and_its_gradient():
    """E (kept by SDPA) and dE are H_q L^2 per sequence and layer in the activation dtype; layer
    checkpointing keeps the attention inside its recomputed segment (one layer's E at a time)."""
    from mdlmpe_ds.attention import AttentionImpl
    from mdlmpe_ds.models.presets import preset
    from mdlmpe_ds.models.recompute import Recompute
    from mdlmpe_ds.training.activation_bytes import attention_transient_bytes, layer_activation_bytes

    impl = AttentionImpl(backend="triton-pair")
    assert impl.keeps_pair_tensors
    cfg = preset("llada-8b", position_encoding="mdlmpe", max_seq_len=4096)
    length, batch = 4096, 4
    de = attention_transient_bytes(cfg, batch, length, "cuda", impl, p=2)
    assert de == batch * cfg.num_heads * length**2 * 2  # 4 GiB: dE at micro-batch 4, L = 4096
    plain = layer_activation_bytes(cfg, 2, batch, length, "cuda", impl)
    checkpointed = layer_activation_bytes(cfg, 2, batch, length, "cuda", impl, Recompute(layers=True))
    assert plain["kept"] >= 2 * cfg.num_heads * length  # E per token, every layer
    assert checkpointed["kept"] == 2 * cfg.hidden_size  # the layer input only
    assert checkpointed["peak"] >= 2 * 2 * cfg.num_heads * length  # E and dE of the layer in backward


if __name__ == "__main__":
    torch.set_num_threads(1)
    todo = [Case(**{**c, "pads": tuple(c["pads"])}) for c in json.loads(sys.stdin.read())]
    results = {}
    for c in todo:
        start = time.perf_counter()
        results[c.name] = compare_half_fallback(c) if c.launch.endswith(",overflow") else compare_pair(c)
        results[c.name]["seconds"] = time.perf_counter() - start
    print(json.dumps(results))
