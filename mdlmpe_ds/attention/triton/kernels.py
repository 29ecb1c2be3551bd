"""The @triton.jit kernels of the fused MDLMPE attention: a forward pass and one backward pass.

Import this module only after deciding the execution mode: triton 3.9 picks interpreter vs
compiler when ``triton.jit`` decorates, so ``TRITON_INTERPRET=1`` must already be set by then.
``mdlmpe_ds.attention.triton.backend`` imports it lazily, after ``check_triton_available()``.

Layouts (made contiguous by the wrapper, all offsets 32-bit: the wrapper checks every tensor has
fewer than 2^31 elements): q, o, dO [B, Hq, L, DH]; k, v [B, Hkv, L, DH]; A, D [B, L, F] fp32;
key bias [B, L] fp32 (0 or finfo(float32).min); row statistics m, l, delta [B, Hq, L] fp32;
W1 [H, F], b1 [H], W2 [NM, H], b2 [NM] fp32. A program owns G query heads (query head
h = group * G + g reads KV head h // REP) and one tile of rows (forward) or keys (backward).

Head-independent work once per (row tile, key tile) for all G heads: the pair ratio r, the angle
s, the phase MLP's hidden layer (a tile product over the flattened [BM*BN] pairs), then per chunk
of MC MDLMPE pairs its output layer, delta, alpha = cos(delta) - 1 and beta = sin(delta)
[BM, BN, MC]. The per-head work is one broadcast over a leading head axis, [G, BM, BN, MC]:
no per-head loop, no per-head recomputation of the phase. The backward sums dE/dalpha and
dE/dbeta over the G heads before the phase MLP's backward, which thus runs once per tile.

The correction (Eq. (26); docs/method.md "The correction form") for rotary pair m (dims 2m+1 and F+2m+1):
E_ij = sum_m alpha (q1 k1 + q2 k2) + beta (q2 k1 - q1 k2) = sum_m k1 (alpha q1 + beta q2)
+ k2 (alpha q2 - beta q1).

Passes (what each one holds and why):
- forward, per row tile: q [G, BM, DH] and the online-softmax state (max, sum, O accumulator) of
  its G heads; saves O, the row max and the row sum (no L x L buffer).
- backward, per key tile: k, v [G, BN, DH] and the dK, dV accumulators of its G heads, and the
  program's phase-MLP gradients. Per row tile it recomputes the hidden layer and E (needed for P),
  then dS; dQ = dS K and the correction's dE/dq are added with atomics into fp32 buffers (rows
  are shared between key-tile programs: their order of addition is not fixed on a GPU), so no
  separate dQ pass recomputes the phase. dE/dk goes to [B, Hq, L, NM] buffers only this program
  adds to (in program order), MLP grads to per-program slots (summed in torch): deterministic.

Every power-of-two padding (DP, FP, HP, chunk tails) is masked on load; padded pairs get zero
weights, hence delta = 0 and alpha = beta = 0 there.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: |delta| bound (tau_max) below which alpha and beta come from the polynomials of ``_small_sincos``.
POLY_TAU_MAX = 0.5
#: Their truncation error bound on [-POLY_TAU_MAX, POLY_TAU_MAX] (alternating Taylor series: the
#: first omitted term), before fp32 rounding: |sin| 0.5^9 / 9! = 5.4e-9, |cos - 1| 0.5^10 / 10!.
POLY_SIN_BOUND = 0.5**9 / 362880
POLY_COS_BOUND = 0.5**10 / 3628800


@triton.jit
def _angle(u):
    """s = arccos(u) - pi/2 (Eq. (24)) for u already clipped to [-1 + kappa, 1 - kappa].

    Abramowitz & Stegun 4.4.46: arccos(x) = sqrt(1 - x) P7(x) on [0, 1], |error| <= 2e-8; Triton
    has no portable acos (libdevice's fails in the triton 3.9 interpreter).
    """
    x = tl.abs(u)
    p = x * -0.0012624911 + 0.0066700901
    p = p * x - 0.0170881256
    p = p * x + 0.0308918810
    p = p * x - 0.0501743046
    p = p * x + 0.0889789874
    p = p * x - 0.2145988016
    p = p * x + 1.5707963050
    magnitude = tl.sqrt(1.0 - x) * p - 1.5707963267948966  # arccos(|u|) - pi/2 <= 0
    return tl.where(u >= 0.0, magnitude, -magnitude)


@triton.jit
def _small_sincos(x):
    """(cos(x) - 1, sin(x)) for |x| <= POLY_TAU_MAX by Taylor polynomials (FMAs only, no MUFU, no
    range reduction): cos x - 1 = x^2 (-1/2 + x^2 (1/24 + x^2 (-1/720 + x^2 / 40320))) keeps full
    relative precision for small x (no cancellation); sin x = x (1 + x^2 (-1/6 + x^2 (1/120 +
    x^2 (-1/5040)))). Truncation error at most POLY_SIN_BOUND / POLY_COS_BOUND."""
    x2 = x * x
    alpha = x2 * (
        -0.5 + x2 * (0.041666666666666664 + x2 * (-0.001388888888888889 + x2 * 2.48015873015873e-05))
    )
    beta = x * (1.0 + x2 * (-0.16666666666666666 + x2 * (0.008333333333333333 + x2 * -0.0001984126984126984)))
    return alpha, beta


@triton.jit
def _mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Tile product with fp32 accumulation, operands in their dtype (bf16 on GPU: tensor cores).

    UPCAST is set only in the interpreter, whose bf16 tl.dot is wrong in triton 3.9: it gets the
    same values as fp32, which is exact (a product of two bf16 values fits in fp32).
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _phase_hidden(
    a_i,
    d_i,
    a_j,
    d_j,
    f_ok,
    w1t,
    b1,
    clip_kappa,
    BM: tl.constexpr,
    BN: tl.constexpr,
    FP: tl.constexpr,
    PREC: tl.constexpr,
    SWAP: tl.constexpr = False,
):
    """r -> s -> SiLU(W1 s + b1) for one (row tile, key tile), shared by all heads of the program.

    a_i, d_i [BM, FP]; a_j, d_j [BN, FP]; w1t [FP, HP]. Returns s2 [BM*BN, FP] and pre, sig, hid
    [BM*BN, HP]. SWAP writes the sums in the other (bit-identical) operand order so the compiler's
    CSE cannot fold a deliberate recomputation into the first evaluation (which would keep s2,
    pre, sig live, and spilled, through the chunk loop). Approximate division (2 ulp) for r and
    the sigmoid: r is clamped right after to [kappa/2, 1 - kappa/2] (u = 2r - 1), so its last bits
    never matter beyond fp32 rounding.
    """
    # 1. Pair ratio and angle (Eqs. (23), (24)).            [BM, BN, FP]
    if SWAP:
        r = tl.fdiv(a_j[None, :, :] + a_i[:, None, :], d_j[None, :, :] + d_i[:, None, :])
    else:
        r = tl.fdiv(a_i[:, None, :] + a_j[None, :, :], d_i[:, None, :] + d_j[None, :, :])
    u = tl.minimum(tl.maximum(2.0 * r - 1.0, -1.0 + clip_kappa), 1.0 - clip_kappa)
    s = tl.where(f_ok[None, None, :], _angle(u), 0.0)
    s2 = tl.reshape(s, (BM * BN, FP))
    # 2. Hidden layer of the phase MLP on the tensor cores (Eq. (25)).       [BM*BN, HP]
    pre = tl.dot(s2, w1t, input_precision=PREC) + b1[None, :]
    sig = tl.fdiv(tl.full(pre.shape, 1.0, tl.float32), 1.0 + tl.exp(-pre))
    return s2, pre, sig, pre * sig


@triton.jit
def _phase_chunk(
    hid,
    w2,
    b2,
    c: tl.constexpr,
    HID,
    NM,
    tau_max,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HP: tl.constexpr,
    MC: tl.constexpr,
    PREC: tl.constexpr,
    POLY: tl.constexpr,
):
    """Output pairs c*MC .. c*MC+MC-1: t = tanh(W2 hid + b2) [BM*BN, MC], alpha, beta [BM, BN, MC],
    and the W2 rows of the chunk [MC, HP] (for the backward). POLY: |tau_max| <= POLY_TAU_MAX, the
    polynomial sin/cos; else libdevice's."""
    m = c * MC + tl.arange(0, MC)
    h = tl.arange(0, HP)
    w2c = tl.load(w2 + m[:, None] * HID + h[None, :], mask=(m[:, None] < NM) & (h[None, :] < HID), other=0.0)
    b2c = tl.load(b2 + m, mask=m < NM, other=0.0)
    out = tl.dot(hid, tl.trans(w2c), input_precision=PREC) + b2c[None, :]
    t = 1.0 - tl.fdiv(tl.full(out.shape, 2.0, tl.float32), tl.exp(2.0 * out) + 1.0)  # tanh, saturates at +-1
    delta = tl.reshape(tau_max * t, (BM, BN, MC))
    if POLY:
        alpha, beta = _small_sincos(delta)
    else:
        half = tl.sin(0.5 * delta)
        alpha = -2.0 * half * half
        beta = tl.sin(delta)
    return t, alpha, beta, w2c


@triton.jit
def _pair_heads(ptr, b, heads, rows, pm, F, NM, num_heads, L, DH, row_ok):
    """Pair components x1 = x[.., 2m+1], x2 = x[.., F+2m+1] for the pairs m in ``pm`` [S] of every
    head: fp32 [G, R, S], zero outside."""
    base = ((b * num_heads + heads[:, None, None]) * L + rows[None, :, None]) * DH
    dim = (2 * pm + 1)[None, None, :]
    mask = row_ok[None, :, None] & (pm < NM)[None, None, :]
    x1 = tl.load(ptr + base + dim, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + base + dim + F, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _sub_pairs(c: tl.constexpr, part: tl.constexpr, MC: tl.constexpr, SPLIT: tl.constexpr):
    """MDLMPE pairs of sub-chunk ``part`` of chunk c: m = c*MC + SPLIT*k + part, k < MC / SPLIT."""
    return c * MC + SPLIT * tl.arange(0, MC // SPLIT) + part


@triton.jit
def _correction_sub(
    q, k, alpha, beta, b, heads, kv_heads, rows, cols, row_ok, col_ok, pm, F, HQ, HKV, L, DH, NM
):
    """sum over the pairs ``pm`` of k1 (alpha q1 + beta q2) + k2 (alpha q2 - beta q1): [G, BM, BN].
    alpha, beta [BM, BN, S] are shared by the G heads (a broadcast over the leading head axis)."""
    q1, q2 = _pair_heads(q, b, heads, rows, pm, F, NM, HQ, L, DH, row_ok)  # [G, BM, S]
    k1, k2 = _pair_heads(k, b, kv_heads, cols, pm, F, NM, HKV, L, DH, col_ok)  # [G, BN, S]
    a4 = alpha[None, :, :, :]
    b4 = beta[None, :, :, :]
    q1b = q1[:, :, None, :]
    q2b = q2[:, :, None, :]
    uq = a4 * q1b + b4 * q2b  # [G, BM, BN, S]
    wq = a4 * q2b - b4 * q1b
    return tl.sum(k1[:, None, :, :] * uq + k2[:, None, :, :] * wq, axis=3)


@triton.jit
def _correction(
    q,
    k,
    hid,
    w2,
    b2,
    b,
    heads,
    kv_heads,
    rows,
    cols,
    row_ok,
    col_ok,
    F,
    HQ,
    HKV,
    L,
    DH,
    HID,
    NM,
    tau_max,
    G: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HP: tl.constexpr,
    MC: tl.constexpr,
    NC: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    POLY: tl.constexpr,
):
    """E [G, BM, BN] of the program's heads: per pair chunk, alpha and beta once for all heads.

    E = sum_m k1 (alpha q1 + beta q2) + k2 (alpha q2 - beta q1): 6 FMAs per (head, i, j, m).
    """
    e = tl.zeros((G, BM, BN), tl.float32)
    for c in tl.static_range(NC):
        _, alpha, beta, _ = _phase_chunk(hid, w2, b2, c, HID, NM, tau_max, BM, BN, HP, MC, PREC, POLY)
        # SPLIT 2: the chunk's even and odd pairs apart (a register-level split, no data movement),
        # which halves the live [G, BM, BN, MC / SPLIT] head tiles.
        args = (b, heads, kv_heads, rows, cols, row_ok, col_ok)
        if SPLIT == 2:
            a0, a1 = tl.split(tl.reshape(alpha, (BM, BN, MC // 2, 2)))
            be0, be1 = tl.split(tl.reshape(beta, (BM, BN, MC // 2, 2)))
            e += _correction_sub(q, k, a0, be0, *args, _sub_pairs(c, 0, MC, 2), F, HQ, HKV, L, DH, NM)
            e += _correction_sub(q, k, a1, be1, *args, _sub_pairs(c, 1, MC, 2), F, HQ, HKV, L, DH, NM)
        else:
            e += _correction_sub(q, k, alpha, beta, *args, _sub_pairs(c, 0, MC, 1), F, HQ, HKV, L, DH, NM)
    return e


@triton.jit
def _grad_sub(
    q,
    k,
    ds4,
    alpha,
    beta,
    dq1_ptr,
    dq2_ptr,
    dk1_ptr,
    dk2_ptr,
    b,
    heads,
    kv_heads,
    rows,
    cols,
    row_ok,
    col_ok,
    pm,
    F,
    HQ,
    HKV,
    L,
    DH,
    NM,
):
    """The correction's gradients for the pairs ``pm`` [S] (ds4 = dS [G, BM, BN, 1]):
    dE/dk1 = alpha q1 + beta q2, dE/dk2 = alpha q2 - beta q1 (summed over rows, added to this
    program's key rows of dk1, dk2), dE/dq1 = alpha k1 - beta k2, dE/dq2 = alpha k2 + beta k1
    (summed over keys, atomically added to dq1, dq2). Returns dE/dalpha = q1 k1 + q2 k2 and
    dE/dbeta = q2 k1 - q1 k2, dS-weighted and summed over the G heads: [BM, BN, S]."""
    q1, q2 = _pair_heads(q, b, heads, rows, pm, F, NM, HQ, L, DH, row_ok)  # [G, BM, S]
    k1, k2 = _pair_heads(k, b, kv_heads, cols, pm, F, NM, HKV, L, DH, col_ok)  # [G, BN, S]
    p_ok = pm < NM
    a4 = alpha[None, :, :, :]
    b4 = beta[None, :, :, :]
    k1b = k1[:, None, :, :]
    k2b = k2[:, None, :, :]
    dsq1 = ds4 * q1[:, :, None, :]  # [G, BM, BN, S]
    dsq2 = ds4 * q2[:, :, None, :]
    dk_off = ((b * HQ + heads[:, None, None]) * L + cols[None, :, None]) * NM + pm[None, None, :]
    dk_mask = col_ok[None, :, None] & p_ok[None, None, :]
    tl.atomic_add(dk1_ptr + dk_off, tl.sum(a4 * dsq1 + b4 * dsq2, axis=1), mask=dk_mask)
    tl.atomic_add(dk2_ptr + dk_off, tl.sum(a4 * dsq2 - b4 * dsq1, axis=1), mask=dk_mask)
    dsk1 = ds4 * k1b
    dsk2 = ds4 * k2b
    dq_off = ((b * HQ + heads[:, None, None]) * L + rows[None, :, None]) * NM + pm[None, None, :]
    dq_mask = row_ok[None, :, None] & p_ok[None, None, :]
    tl.atomic_add(dq1_ptr + dq_off, tl.sum(a4 * dsk1 - b4 * dsk2, axis=2), mask=dq_mask)
    tl.atomic_add(dq2_ptr + dq_off, tl.sum(a4 * dsk2 + b4 * dsk1, axis=2), mask=dq_mask)
    d_alpha = tl.sum(dsq1 * k1b + dsq2 * k2b, axis=0)  # [BM, BN, S]
    d_beta = tl.sum(dsq2 * k1b - dsq1 * k2b, axis=0)
    return d_alpha, d_beta


@triton.jit
def _load_heads(ptr, b, heads, rows, cols, num_heads, L, DH, row_ok, col_ok):
    """x[b, heads, rows, cols] of a [B, H, L, DH] tensor in its dtype, [G, R, C]; zero outside."""
    offs = ((b * num_heads + heads[:, None, None]) * L + rows[None, :, None]) * DH + cols[None, None, :]
    mask = row_ok[None, :, None] & col_ok[None, None, :]
    return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def _load_heads_t(ptr, b, heads, rows, cols, num_heads, L, DH, row_ok, col_ok):
    """Transposed load: x[b, heads, rows, cols] in its dtype, [G, C, R] (keys for q k^T)."""
    offs = ((b * num_heads + heads[:, None, None]) * L + rows[None, None, :]) * DH + cols[None, :, None]
    mask = row_ok[None, None, :] & col_ok[None, :, None]
    return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def _load_rows(ptr, b, rows, f, L, F, row_ok, f_ok, other):
    """A or D rows: [B, L, F] -> fp32 [R, FP], ``other`` outside (1 for D keeps r finite)."""
    offs = (b * L + rows[:, None]) * F + f[None, :]
    return tl.load(ptr + offs, mask=row_ok[:, None] & f_ok[None, :], other=other)


@triton.jit
def _load_w1(w1, b1, F, HID, FP: tl.constexpr, HP: tl.constexpr):
    """W1 transposed for row-major tile products: w1t [FP, HP], and b1 [HP]."""
    f = tl.arange(0, FP)
    h = tl.arange(0, HP)
    w1t = tl.load(w1 + h[None, :] * F + f[:, None], mask=(h[None, :] < HID) & (f[:, None] < F), other=0.0)
    return w1t, tl.load(b1 + h, mask=h < HID, other=0.0)


@triton.jit
def mdlmpe_fwd_kernel(
    q,
    k,
    v,
    a_ptr,
    d_ptr,
    kbias,
    w1,
    b1,
    w2,
    b2,
    o,
    m_out,
    l_out,
    L,
    HQ,
    HKV,
    F,
    HID,
    NM,
    tau_max,
    clip_kappa,
    scale,
    REP: tl.constexpr,
    G: tl.constexpr,
    DH: tl.constexpr,
    DP: tl.constexpr,
    FP: tl.constexpr,
    HP: tl.constexpr,
    MC: tl.constexpr,
    NC: tl.constexpr,
    SPLIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    POLY: tl.constexpr,
):
    """Online-softmax forward over key tiles; saves O and the row statistics (max m, sum l)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    groups = HQ // G
    b = pid_bh // groups
    heads = (pid_bh % groups) * G + tl.arange(0, G)  # [G] query heads
    kv_heads = heads // REP
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < L
    d = tl.arange(0, DP)
    d_ok = d < DH
    f = tl.arange(0, FP)
    f_ok = f < F

    qt = _load_heads(q, b, heads, rows, d, HQ, L, DH, row_ok, d_ok)  # [G, BM, DP]
    a_i = _load_rows(a_ptr, b, rows, f, L, F, row_ok, f_ok, 0.0)  # [BM, FP]
    d_i = _load_rows(d_ptr, b, rows, f, L, F, row_ok, f_ok, 1.0)
    w1t, b1v = _load_w1(w1, b1, F, HID, FP, HP)

    m_i = tl.full((G, BM), float("-inf"), tl.float32)
    l_i = tl.zeros((G, BM), tl.float32)
    acc = tl.zeros((G, BM, DP), tl.float32)
    for start in range(0, L, BN):
        cols = start + tl.arange(0, BN)
        col_ok = cols < L
        kt = _load_heads_t(k, b, kv_heads, cols, d, HKV, L, DH, col_ok, d_ok)  # [G, DP, BN]
        vt = _load_heads(v, b, kv_heads, cols, d, HKV, L, DH, col_ok, d_ok)  # [G, BN, DP]
        a_j = _load_rows(a_ptr, b, cols, f, L, F, col_ok, f_ok, 0.0)
        d_j = _load_rows(d_ptr, b, cols, f, L, F, col_ok, f_ok, 1.0)
        bias = tl.load(kbias + b * L + cols, mask=col_ok, other=float("-inf"))  # [BN]
        _, _, _, hid = _phase_hidden(a_i, d_i, a_j, d_j, f_ok, w1t, b1v, clip_kappa, BM, BN, FP, PREC)
        e = _correction(
            q,
            k,
            hid,
            w2,
            b2,
            b,
            heads,
            kv_heads,
            rows,
            cols,
            row_ok,
            col_ok,
            F,
            HQ,
            HKV,
            L,
            DH,
            HID,
            NM,
            tau_max,
            G,
            BM,
            BN,
            HP,
            MC,
            NC,
            SPLIT,
            PREC,
            POLY,
        )
        qk = _mm(qt, kt, PREC, UPCAST)  # [G, BM, BN]
        s = (qk + e) * scale + bias[None, None, :]
        m_new = tl.maximum(m_i, tl.max(s, axis=2))
        p = tl.exp(s - m_new[:, :, None])
        corr = tl.exp(m_i - m_new)
        l_i = l_i * corr + tl.sum(p, axis=2)
        acc = acc * corr[:, :, None] + _mm(p.to(vt.dtype), vt, PREC, UPCAST)
        m_i = m_new

    out = acc / l_i[:, :, None]
    o_offs = ((b * HQ + heads[:, None, None]) * L + rows[None, :, None]) * DH + d[None, None, :]
    tl.store(o + o_offs, out.to(o.dtype.element_ty), mask=row_ok[None, :, None] & d_ok[None, None, :])
    stat = (b * HQ + heads[:, None]) * L + rows[None, :]
    tl.store(m_out + stat, m_i, mask=row_ok[None, :])
    tl.store(l_out + stat, l_i, mask=row_ok[None, :])


@triton.jit
def mdlmpe_bwd_kernel(
    q,
    k,
    v,
    a_ptr,
    d_ptr,
    kbias,
    w1,
    b1,
    w2,
    b2,
    do_ptr,
    m_ptr,
    l_ptr,
    dlt_ptr,
    dq,
    dk,
    dv,
    dq1_ptr,
    dq2_ptr,
    dk1_ptr,
    dk2_ptr,
    dw1,
    db1,
    dw2,
    db2,
    L,
    HQ,
    HKV,
    F,
    HID,
    NM,
    tau_max,
    clip_kappa,
    scale,
    REP: tl.constexpr,
    G: tl.constexpr,
    DH: tl.constexpr,
    DP: tl.constexpr,
    FP: tl.constexpr,
    HP: tl.constexpr,
    MC: tl.constexpr,
    NC: tl.constexpr,
    SPLIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    POLY: tl.constexpr,
):
    """Per key tile: dK, dV (per query head, fp32), this program's phase-MLP grads, and its share of
    dQ (atomic adds into dq [B, Hq, L, DH] and dq1, dq2 [B, Hq, L, NM], all fp32, zeroed).

    dK's correction part goes to dk1, dk2 [B, Hq, L, NM] (zeroed; only this program adds to its key
    rows) and is joined to the pair dims by the wrapper. MLP grads go to per-program slots.
    """
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    groups = HQ // G
    b = pid_bh // groups
    heads = (pid_bh % groups) * G + tl.arange(0, G)
    kv_heads = heads // REP
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < L
    d = tl.arange(0, DP)
    d_ok = d < DH
    f = tl.arange(0, FP)
    f_ok = f < F
    hh = tl.arange(0, HP)
    slot = pid_bh * tl.num_programs(0) + pid_n

    kt = _load_heads_t(k, b, kv_heads, cols, d, HKV, L, DH, col_ok, d_ok)  # [G, DP, BN]
    vt = _load_heads_t(v, b, kv_heads, cols, d, HKV, L, DH, col_ok, d_ok)  # [G, DP, BN]
    a_j = _load_rows(a_ptr, b, cols, f, L, F, col_ok, f_ok, 0.0)
    d_j = _load_rows(d_ptr, b, cols, f, L, F, col_ok, f_ok, 1.0)
    bias = tl.load(kbias + b * L + cols, mask=col_ok, other=float("-inf"))
    w1t, b1v = _load_w1(w1, b1, F, HID, FP, HP)

    dk_acc = tl.zeros((G, BN, DP), tl.float32)
    dv_acc = tl.zeros((G, BN, DP), tl.float32)
    dw1_acc = tl.zeros((HP, FP), tl.float32)
    db1_acc = tl.zeros((HP,), tl.float32)
    for start in range(0, L, BM):
        rows = start + tl.arange(0, BM)
        row_ok = rows < L
        qt = _load_heads(q, b, heads, rows, d, HQ, L, DH, row_ok, d_ok)  # [G, BM, DP]
        do = _load_heads(do_ptr, b, heads, rows, d, HQ, L, DH, row_ok, d_ok)
        stat = (b * HQ + heads[:, None]) * L + rows[None, :]
        m_i = tl.load(m_ptr + stat, mask=row_ok[None, :], other=0.0)
        l_i = tl.load(l_ptr + stat, mask=row_ok[None, :], other=1.0)
        delta_i = tl.load(dlt_ptr + stat, mask=row_ok[None, :], other=0.0)
        a_i = _load_rows(a_ptr, b, rows, f, L, F, row_ok, f_ok, 0.0)
        d_i = _load_rows(d_ptr, b, rows, f, L, F, row_ok, f_ok, 1.0)
        _, _, _, hid = _phase_hidden(a_i, d_i, a_j, d_j, f_ok, w1t, b1v, clip_kappa, BM, BN, FP, PREC)
        e = _correction(
            q,
            k,
            hid,
            w2,
            b2,
            b,
            heads,
            kv_heads,
            rows,
            cols,
            row_ok,
            col_ok,
            F,
            HQ,
            HKV,
            L,
            DH,
            HID,
            NM,
            tau_max,
            G,
            BM,
            BN,
            HP,
            MC,
            NC,
            SPLIT,
            PREC,
            POLY,
        )
        # 1. Recomputed P and dS = P (dP - delta) * scale, the gradient of q.k and of E. [G, BM, BN]
        sc = (_mm(qt, kt, PREC, UPCAST) + e) * scale + bias[None, None, :]
        p = tl.exp(sc - m_i[:, :, None]) / l_i[:, :, None]
        p = tl.where(row_ok[None, :, None], p, 0.0)
        ds = p * (_mm(do, vt, PREC, UPCAST) - delta_i[:, :, None]) * scale
        # 2. Plain attention part: dV, dK here, dQ added for the rows of this tile.  [G, BN|BM, DP]
        dv_acc += _mm(tl.trans(p, 0, 2, 1).to(do.dtype), do, PREC, UPCAST)
        dk_acc += _mm(tl.trans(ds, 0, 2, 1).to(qt.dtype), qt, PREC, UPCAST)
        dq_offs = ((b * HQ + heads[:, None, None]) * L + rows[None, :, None]) * DH + d[None, None, :]
        dq_part = _mm(ds.to(kt.dtype), tl.trans(kt, 0, 2, 1), PREC, UPCAST)
        tl.atomic_add(dq + dq_offs, dq_part, mask=row_ok[None, :, None] & d_ok[None, None, :])
        # 3. Correction, per pair chunk for all heads at once: dE/dk1 = alpha q1 + beta q2, dE/dk2 =
        #    alpha q2 - beta q1, dE/dq1 = alpha k1 - beta k2, dE/dq2 = alpha k2 + beta k1; dE/dalpha =
        #    q1 k1 + q2 k2 and dE/dbeta = q2 k1 - q1 k2 summed over heads, then once through
        #    alpha(delta), beta(delta), tanh * tau and the MLP output layer.
        ds4 = ds[:, :, :, None]  # [G, BM, BN, 1]
        d_hid = tl.zeros((BM * BN, HP), tl.float32)
        for c in tl.static_range(NC):
            pm = c * MC + tl.arange(0, MC)
            p_ok = pm < NM
            t, alpha, beta, w2c = _phase_chunk(hid, w2, b2, c, HID, NM, tau_max, BM, BN, HP, MC, PREC, POLY)
            ptrs = (dq1_ptr, dq2_ptr, dk1_ptr, dk2_ptr, b, heads, kv_heads, rows, cols, row_ok, col_ok)
            if SPLIT == 2:  # even and odd pairs apart, as in _correction
                a0, a1 = tl.split(tl.reshape(alpha, (BM, BN, MC // 2, 2)))
                be0, be1 = tl.split(tl.reshape(beta, (BM, BN, MC // 2, 2)))
                dal0, dbe0 = _grad_sub(
                    q, k, ds4, a0, be0, *ptrs, _sub_pairs(c, 0, MC, 2), F, HQ, HKV, L, DH, NM
                )
                dal1, dbe1 = _grad_sub(
                    q, k, ds4, a1, be1, *ptrs, _sub_pairs(c, 1, MC, 2), F, HQ, HKV, L, DH, NM
                )
                d_alpha = tl.reshape(tl.join(dal0, dal1), (BM, BN, MC))
                d_beta = tl.reshape(tl.join(dbe0, dbe1), (BM, BN, MC))
            else:
                sub = _sub_pairs(c, 0, MC, 1)
                d_alpha, d_beta = _grad_sub(q, k, ds4, alpha, beta, *ptrs, sub, F, HQ, HKV, L, DH, NM)
            # d alpha / d delta = -sin(delta) = -beta; d beta / d delta = cos(delta) = 1 + alpha.
            d_delta = -beta * d_alpha + (1.0 + alpha) * d_beta
            d_out = tl.reshape(d_delta, (BM * BN, MC)) * tau_max * (1.0 - t * t)  # [BM*BN, MC]
            w_mask = p_ok[:, None] & (hh[None, :] < HID)
            dw2_c = tl.dot(tl.trans(d_out), hid, input_precision=PREC)  # [MC, HP]
            tl.atomic_add(dw2 + slot * NM * HID + pm[:, None] * HID + hh[None, :], dw2_c, mask=w_mask)
            tl.atomic_add(db2 + slot * NM + pm, tl.sum(d_out, axis=0), mask=p_ok)
            d_hid += tl.dot(d_out, w2c, input_precision=PREC)  # [BM*BN, HP]
        # 4. Back through SiLU and the hidden layer, once for all heads; s2, pre, sig recomputed
        #    rather than held through the chunk loop.
        s2, pre, sig, _ = _phase_hidden(
            a_i, d_i, a_j, d_j, f_ok, w1t, b1v, clip_kappa, BM, BN, FP, PREC, True
        )
        d_pre = d_hid * sig * (1.0 + pre * (1.0 - sig))
        dw1_acc += tl.dot(tl.trans(d_pre), s2, input_precision=PREC)
        db1_acc += tl.sum(d_pre, axis=0)

    out_mask = col_ok[None, :, None] & d_ok[None, None, :]
    offs = ((b * HQ + heads[:, None, None]) * L + cols[None, :, None]) * DH + d[None, None, :]
    tl.store(dk + offs, dk_acc, mask=out_mask)
    tl.store(dv + offs, dv_acc, mask=out_mask)
    w1_mask = (hh[:, None] < HID) & f_ok[None, :]
    tl.store(dw1 + slot * HID * F + hh[:, None] * F + f[None, :], dw1_acc, mask=w1_mask)
    tl.store(db1 + slot * HID + hh, db1_acc, mask=hh < HID)
