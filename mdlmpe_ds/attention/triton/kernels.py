"""The @triton.jit kernels of the fused MDLMPE attention (forward, dK/dV + phase-MLP grads, dQ).

Import this module only after deciding the execution mode: triton 3.9 picks interpreter vs
compiler when ``triton.jit`` decorates, so ``TRITON_INTERPRET=1`` must already be set by then.
``mdlmpe_ds.attention.triton.backend`` imports it lazily, after ``check_triton_available()``.

Layouts (made contiguous by the wrapper): q, o, dO [B, Hq, L, DH]; k, v [B, Hkv, L, DH]; A, D
[B, L, F] fp32; key bias [B, L] fp32 (0 or finfo(float32).min); row statistics m, l, delta
[B, Hq, L] fp32; W1 [H, F], b1 [H], W2 [NM, H], b2 [NM] fp32. A program owns G query heads
(query head h = group * G + g reads KV head h // REP) and one tile of rows (forward, dQ) or keys
(dK/dV). Per (row tile, key tile) the phase MLP's hidden layer is computed once; its output
layer, alpha and beta are produced in chunks of MC MDLMPE pairs (NC chunks), and each chunk is
reused by a static loop over the G heads, so only [BM, BN, MC] pair tiles are live at a time.
Every power-of-two padding (DP, FP, HP, chunk tails) is masked on load; padded pairs get zero
weights, hence delta = 0 and alpha = beta = 0 there.

The correction (SPEC §2, Eq. app_pair_phase) for rotary pair m (dims 2m+1 and F+2m+1):
E_ij = sum_m alpha (q1 k1 + q2 k2) + beta (q2 k1 - q1 k2) = sum_m k1 (alpha q1 + beta q2)
+ k2 (alpha q2 - beta q1), with alpha = cos(delta) - 1 = -2 sin^2(delta / 2) (no cancellation for
small delta) and beta = sin(delta).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _angle(u):
    """s = arccos(u) - pi/2 (Eq. mdangle) for u already clipped to [-1 + kappa, 1 - kappa].

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
    pre, sig live, and spilled, through the head loops).
    """
    # 1. Pair ratio and angle (Eqs. pair_availability_ratio, mdangle).            [BM, BN, FP]
    if SWAP:
        r = (a_j[None, :, :] + a_i[:, None, :]) / (d_j[None, :, :] + d_i[:, None, :])
    else:
        r = (a_i[:, None, :] + a_j[None, :, :]) / (d_i[:, None, :] + d_j[None, :, :])
    u = tl.minimum(tl.maximum(2.0 * r - 1.0, -1.0 + clip_kappa), 1.0 - clip_kappa)
    s = tl.where(f_ok[None, None, :], _angle(u), 0.0)
    s2 = tl.reshape(s, (BM * BN, FP))
    # 2. Hidden layer of the phase MLP on the tensor cores (Eq. phase_mlp).       [BM*BN, HP]
    pre = tl.dot(s2, w1t, input_precision=PREC) + b1[None, :]
    sig = 1.0 / (1.0 + tl.exp(-pre))
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
):
    """Output pairs c*MC .. c*MC+MC-1: t = tanh(W2 hid + b2) [BM*BN, MC], alpha, beta [BM, BN, MC],
    and the W2 rows of the chunk [MC, HP] (for the backward)."""
    m = c * MC + tl.arange(0, MC)
    h = tl.arange(0, HP)
    w2c = tl.load(w2 + m[:, None] * HID + h[None, :], mask=(m[:, None] < NM) & (h[None, :] < HID), other=0.0)
    b2c = tl.load(b2 + m, mask=m < NM, other=0.0)
    out = tl.dot(hid, tl.trans(w2c), input_precision=PREC) + b2c[None, :]
    t = 1.0 - 2.0 / (tl.exp(2.0 * out) + 1.0)  # tanh(out), saturates cleanly at +-1
    delta = tau_max * t
    half = tl.sin(0.5 * delta)
    alpha = tl.reshape(-2.0 * half * half, (BM, BN, MC))
    beta = tl.reshape(tl.sin(delta), (BM, BN, MC))
    return t, alpha, beta, w2c


@triton.jit
def _pairs(c: tl.constexpr, NM, MC: tl.constexpr):
    """MDLMPE pair indices m of chunk c, their first dim 2m+1 (odd f), and which m < NM exist."""
    m = c * MC + tl.arange(0, MC)
    return m, 2 * m + 1, m < NM


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
def _pair_rows(ptr, b, head, rows, pair1, F, num_heads, L, DH, row_ok, p_ok):
    """Pair components x1 = x[.., 2m+1], x2 = x[.., F+2m+1] of one head of [B, H, L, DH]: fp32 [R, MC]."""
    base = ((b * num_heads + head) * L + rows[:, None]) * DH
    mask = row_ok[:, None] & p_ok[None, :]
    x1 = tl.load(ptr + base + pair1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + base + F + pair1[None, :], mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _head_factors(q1, q2, alpha, beta):
    """dE/dk1 = alpha q1 + beta q2 and dE/dk2 = alpha q2 - beta q1 for one head. [BM, BN, MC]."""
    uq = alpha * q1[:, None, :] + beta * q2[:, None, :]
    wq = alpha * q2[:, None, :] - beta * q1[:, None, :]
    return uq, wq


@triton.jit
def _head_slice(x, g: tl.constexpr, G: tl.constexpr):
    """x[g] of a [G, R, C] register tensor (no dynamic indexing in Triton): a masked sum."""
    return tl.sum(tl.where((tl.arange(0, G) == g)[:, None, None], x, 0.0), axis=0)


@triton.jit
def _correction(
    q,
    k,
    hid,
    w2,
    b2,
    b,
    head0,
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
    REP: tl.constexpr,
    G: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HP: tl.constexpr,
    MC: tl.constexpr,
    NC: tl.constexpr,
    PREC: tl.constexpr,
):
    """E [G, BM, BN] of the program's heads: per pair chunk, alpha and beta once, then head by head.

    E = sum_m k1 (alpha q1 + beta q2) + k2 (alpha q2 - beta q1).
    """
    head_axis = tl.arange(0, G)
    e = tl.zeros((G, BM, BN), tl.float32)
    for c in tl.static_range(NC):
        _, pair1, p_ok = _pairs(c, NM, MC)
        _, alpha, beta, _ = _phase_chunk(hid, w2, b2, c, HID, NM, tau_max, BM, BN, HP, MC, PREC)
        for g in tl.static_range(G):
            q1, q2 = _pair_rows(q, b, head0 + g, rows, pair1, F, HQ, L, DH, row_ok, p_ok)
            k1, k2 = _pair_rows(k, b, (head0 + g) // REP, cols, pair1, F, HKV, L, DH, col_ok, p_ok)
            uq, wq = _head_factors(q1, q2, alpha, beta)
            e_g = tl.sum(uq * k1[None, :, :] + wq * k2[None, :, :], axis=2)  # [BM, BN]
            e = tl.where((head_axis == g)[:, None, None], e + e_g[None, :, :], e)
    return e


@triton.jit
def _probs_and_grad(
    qt, kt, vt, do, e, bias, m_i, l_i, delta_i, row_ok, scale, PREC: tl.constexpr, UPCAST: tl.constexpr
):
    """Recomputed P [G, BM, BN] and dS = P (dP - delta) * scale, the gradient of q.k and of E."""
    qk = _mm(qt, kt, PREC, UPCAST)
    s = (qk + e) * scale + bias[None, None, :]
    p = tl.exp(s - m_i[:, :, None]) / l_i[:, :, None]
    p = tl.where(row_ok[None, :, None], p, 0.0)
    dp = _mm(do, vt, PREC, UPCAST)  # [G, BM, BN]
    ds = p * (dp - delta_i[:, :, None]) * scale
    return p, ds


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
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online-softmax forward over key tiles; saves O and the row statistics (max m, sum l)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    groups = HQ // G
    b = (pid_bh // groups).to(tl.int64)
    head0 = (pid_bh % groups) * G
    heads = head0 + tl.arange(0, G)  # [G] query heads
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
            head0,
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
            REP,
            G,
            BM,
            BN,
            HP,
            MC,
            NC,
            PREC,
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
def mdlmpe_bwd_dkdv_kernel(
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
    dk,
    dv,
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
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Per key tile: dK, dV (per query head, fp32) and this program's partial phase-MLP grads.

    dK's correction part is added into dk1, dk2 [B, Hq, L, NM] (zero-initialised; this program
    owns its key rows, the atomics only order its own chunk updates) and joined to the pair dims
    by the wrapper. MLP grads go to per-program slots (deterministic sum in the wrapper).
    """
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    groups = HQ // G
    b = (pid_bh // groups).to(tl.int64)
    head0 = (pid_bh % groups) * G
    heads = head0 + tl.arange(0, G)
    kv_heads = heads // REP
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < L
    d = tl.arange(0, DP)
    d_ok = d < DH
    f = tl.arange(0, FP)
    f_ok = f < F
    hh = tl.arange(0, HP)
    slot = (pid_bh * tl.num_programs(0) + pid_n).to(tl.int64)

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
            head0,
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
            REP,
            G,
            BM,
            BN,
            HP,
            MC,
            NC,
            PREC,
        )
        p, ds = _probs_and_grad(qt, kt, vt, do, e, bias, m_i, l_i, delta_i, row_ok, scale, PREC, UPCAST)
        # 1. Plain attention part.                                                 [G, BN, DP]
        dv_acc += _mm(tl.trans(p, 0, 2, 1).to(do.dtype), do, PREC, UPCAST)
        dk_acc += _mm(tl.trans(ds, 0, 2, 1).to(qt.dtype), qt, PREC, UPCAST)
        # 2. Correction, per pair chunk and head: dE/dk1 = alpha q1 + beta q2, dE/dk2 = alpha q2
        #    - beta q1; dE/dalpha = q1 k1 + q2 k2 and dE/dbeta = q2 k1 - q1 k2 summed over heads;
        #    then back through alpha(delta), beta(delta), tanh * tau and the MLP output layer.
        d_hid = tl.zeros((BM * BN, HP), tl.float32)
        for c in tl.static_range(NC):
            pm, pair1, p_ok = _pairs(c, NM, MC)
            t, alpha, beta, w2c = _phase_chunk(hid, w2, b2, c, HID, NM, tau_max, BM, BN, HP, MC, PREC)
            d_alpha = tl.zeros((BM, BN, MC), tl.float32)
            d_beta = tl.zeros((BM, BN, MC), tl.float32)
            for g in tl.static_range(G):
                q1, q2 = _pair_rows(q, b, head0 + g, rows, pair1, F, HQ, L, DH, row_ok, p_ok)  # [BM, MC]
                k1, k2 = _pair_rows(k, b, (head0 + g) // REP, cols, pair1, F, HKV, L, DH, col_ok, p_ok)
                ds_g = _head_slice(ds, g, G)[:, :, None]  # [BM, BN, 1]
                uq, wq = _head_factors(q1, q2, alpha, beta)
                p_offs = ((b * HQ + head0 + g) * L + cols[:, None]) * NM + pm[None, :]
                p_mask = col_ok[:, None] & p_ok[None, :]
                tl.atomic_add(dk1_ptr + p_offs, tl.sum(ds_g * uq, axis=0), mask=p_mask)
                tl.atomic_add(dk2_ptr + p_offs, tl.sum(ds_g * wq, axis=0), mask=p_mask)
                q1b = q1[:, None, :]
                q2b = q2[:, None, :]
                k1b = k1[None, :, :]
                k2b = k2[None, :, :]
                d_alpha += ds_g * (q1b * k1b + q2b * k2b)
                d_beta += ds_g * (q2b * k1b - q1b * k2b)
            # d alpha / d delta = -sin(delta) = -beta; d beta / d delta = cos(delta) = 1 + alpha.
            d_delta = -beta * d_alpha + (1.0 + alpha) * d_beta
            d_out = tl.reshape(d_delta, (BM * BN, MC)) * tau_max * (1.0 - t * t)  # [BM*BN, MC]
            w_mask = p_ok[:, None] & (hh[None, :] < HID)
            dw2_c = tl.dot(tl.trans(d_out), hid, input_precision=PREC)  # [MC, HP]
            tl.atomic_add(dw2 + slot * NM * HID + pm[:, None] * HID + hh[None, :], dw2_c, mask=w_mask)
            tl.atomic_add(db2 + slot * NM + pm, tl.sum(d_out, axis=0), mask=p_ok)
            d_hid += tl.dot(d_out, w2c, input_precision=PREC)  # [BM*BN, HP]
        # 3. Back through SiLU and the hidden layer; s2, pre, sig recomputed rather than held.
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


@triton.jit
def mdlmpe_bwd_dq_kernel(
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
    dq1_ptr,
    dq2_ptr,
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
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Per row tile: dQ (fp32); its correction part is added into dq1, dq2 [B, Hq, L, NM]
    (zero-initialised, rows owned by this program) and joined to the pair dims by the wrapper."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    groups = HQ // G
    b = (pid_bh // groups).to(tl.int64)
    head0 = (pid_bh % groups) * G
    heads = head0 + tl.arange(0, G)
    kv_heads = heads // REP
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < L
    d = tl.arange(0, DP)
    d_ok = d < DH
    f = tl.arange(0, FP)
    f_ok = f < F

    qt = _load_heads(q, b, heads, rows, d, HQ, L, DH, row_ok, d_ok)
    do = _load_heads(do_ptr, b, heads, rows, d, HQ, L, DH, row_ok, d_ok)
    stat = (b * HQ + heads[:, None]) * L + rows[None, :]
    m_i = tl.load(m_ptr + stat, mask=row_ok[None, :], other=0.0)
    l_i = tl.load(l_ptr + stat, mask=row_ok[None, :], other=1.0)
    delta_i = tl.load(dlt_ptr + stat, mask=row_ok[None, :], other=0.0)
    a_i = _load_rows(a_ptr, b, rows, f, L, F, row_ok, f_ok, 0.0)
    d_i = _load_rows(d_ptr, b, rows, f, L, F, row_ok, f_ok, 1.0)
    w1t, b1v = _load_w1(w1, b1, F, HID, FP, HP)

    dq_acc = tl.zeros((G, BM, DP), tl.float32)
    for start in range(0, L, BN):
        cols = start + tl.arange(0, BN)
        col_ok = cols < L
        kt = _load_heads_t(k, b, kv_heads, cols, d, HKV, L, DH, col_ok, d_ok)  # [G, DP, BN]
        k_rows = _load_heads(k, b, kv_heads, cols, d, HKV, L, DH, col_ok, d_ok)  # [G, BN, DP]
        vt = _load_heads_t(v, b, kv_heads, cols, d, HKV, L, DH, col_ok, d_ok)
        a_j = _load_rows(a_ptr, b, cols, f, L, F, col_ok, f_ok, 0.0)
        d_j = _load_rows(d_ptr, b, cols, f, L, F, col_ok, f_ok, 1.0)
        bias = tl.load(kbias + b * L + cols, mask=col_ok, other=float("-inf"))
        _, _, _, hid = _phase_hidden(a_i, d_i, a_j, d_j, f_ok, w1t, b1v, clip_kappa, BM, BN, FP, PREC)
        e = _correction(
            q,
            k,
            hid,
            w2,
            b2,
            b,
            head0,
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
            REP,
            G,
            BM,
            BN,
            HP,
            MC,
            NC,
            PREC,
        )
        _, ds = _probs_and_grad(qt, kt, vt, do, e, bias, m_i, l_i, delta_i, row_ok, scale, PREC, UPCAST)
        dq_acc += _mm(ds.to(k_rows.dtype), k_rows, PREC, UPCAST)
        # Correction, per pair chunk and head: dE/dq1 = alpha k1 - beta k2, dE/dq2 = alpha k2 + beta k1.
        for c in tl.static_range(NC):
            pm, pair1, p_ok = _pairs(c, NM, MC)
            _, alpha, beta, _ = _phase_chunk(hid, w2, b2, c, HID, NM, tau_max, BM, BN, HP, MC, PREC)
            for g in tl.static_range(G):
                k1, k2 = _pair_rows(k, b, (head0 + g) // REP, cols, pair1, F, HKV, L, DH, col_ok, p_ok)
                ds_g = _head_slice(ds, g, G)[:, :, None]  # [BM, BN, 1]
                k1b = k1[None, :, :]
                k2b = k2[None, :, :]
                p_offs = ((b * HQ + head0 + g) * L + rows[:, None]) * NM + pm[None, :]
                p_mask = row_ok[:, None] & p_ok[None, :]
                tl.atomic_add(
                    dq1_ptr + p_offs, tl.sum(ds_g * (alpha * k1b - beta * k2b), axis=1), mask=p_mask
                )
                tl.atomic_add(
                    dq2_ptr + p_offs, tl.sum(ds_g * (alpha * k2b + beta * k1b), axis=1), mask=p_mask
                )

    out_mask = row_ok[None, :, None] & d_ok[None, None, :]
    offs = ((b * HQ + heads[:, None, None]) * L + rows[None, :, None]) * DH + d[None, None, :]
    tl.store(dq + offs, dq_acc, mask=out_mask)
