"""The probe kernel of ``half_pairs``: ``pair_bias.pair_bias_fwd_kernel`` with its pair arithmetic in
fp16. The pair components arrive as fp16 (qpair, kpair [B, H, LP, 2 NMP] fp16, the layout of
``pair_backend.pair_components``), alpha and beta are rounded to fp16 once per tile, every head's
per-pair products and the sum over the pair chunks stay in fp16 (packed two to a register: HFMA2,
HMUL2, HADD2 on sm_90), and the sum over the pairs of a chunk runs in fp32. Nothing in mdlmpe_ds
launches it: it exists to be compiled for sm_90 and read (``half_pairs.probe_loops``) and run in the
Triton interpreter against the fp32 kernel (tests/unit/test_half_pairs.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from mdlmpe_ds.attention.triton.kernels import _load_w1
from mdlmpe_ds.attention.triton.pair_bias import (
    _pairs_across,
    _plane,
    _plane_ptr,
    _tile_features,
    _tile_phases,
)


@triton.jit
def half_pair_fwd_kernel(
    a_ptr, d_ptr, w1, b1, w2, b2, qpair, kpair, kbias, bias, L, LP, HQ, HKV, F, HID, NM, scale, tau_max,
    clip_kappa, REP: tl.constexpr, FP: tl.constexpr, HP: tl.constexpr, MC: tl.constexpr, NC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, POLY: tl.constexpr,
):  # fmt: skip
    """bias[b, h, i, j] = E_h[i, j] * scale + kbias[b, j], the pair products in fp16 (module doc)."""
    NMP: tl.constexpr = NC * MC
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    b = tl.program_id(2)
    row_ok = rows < L
    col_ok = cols < L
    f = tl.arange(0, FP)
    f_ok = f < F
    mm = tl.arange(0, MC)
    a_i, d_i = _tile_features(a_ptr, d_ptr, b, rows, f, L, F, f_ok)
    a_j, d_j = _tile_features(a_ptr, d_ptr, b, cols, f, L, F, f_ok)
    w1t, b1v = _load_w1(w1, b1, F, HID, FP, HP)
    _, alphas, betas = _tile_phases(
        a_i, d_i, a_j, d_j, f_ok, w1t, b1v, w2, b2, clip_kappa, tau_max, HID, NM,
        BM, BN, FP, HP, MC, NC, PREC, POLY,
    )  # fmt: skip
    halves_a = ()
    halves_b = ()
    for c in tl.static_range(NC):
        halves_a = halves_a + (alphas[c].to(tl.float16),)  # noqa: RUF005
        halves_b = halves_b + (betas[c].to(tl.float16),)  # noqa: RUF005
    key_bias = tl.load(kbias + b * L + cols, mask=col_ok, other=0.0)  # [BN]
    for h in range(HQ):
        q_plane = _plane_ptr(qpair, b, h, HQ, LP, NMP)
        k_plane = _plane_ptr(kpair, b, h // REP, HKV, LP, NMP)
        e3 = tl.zeros((BM, BN, MC), tl.float16)
        for c in tl.static_range(NC):
            q1, q2 = _pairs_across(q_plane, rows, c * MC + mm, cols, NMP, True)  # [BM, BN, MC] fp16
            k1, k2 = _pairs_across(k_plane, cols, c * MC + mm, rows, NMP, False)
            u1 = halves_a[c] * k1 - halves_b[c] * k2  # alpha k1 - beta k2
            u2 = halves_a[c] * k2 + halves_b[c] * k1
            e3 += q1 * u1 + q2 * u2  # alpha C + beta S per pair, fp16
        e = tl.sum(e3.to(tl.float32), axis=2)
        ptrs, mask = _plane(bias, b, h, rows, cols, HQ, L, row_ok, col_ok)
        tl.store(ptrs, (e * scale + key_bias[None, :]).to(bias.dtype.element_ty), mask=mask)
