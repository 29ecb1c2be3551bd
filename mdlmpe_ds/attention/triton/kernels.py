"""The @triton.jit kernels of the fused MDLMPE attention: four launches per forward + backward.

Import this module only after deciding the execution mode: triton 3.9 picks interpreter vs
compiler when ``triton.jit`` decorates, so ``TRITON_INTERPRET=1`` must already be set by then.
``mdlmpe_ds.attention.triton.backend`` imports it lazily, after ``check_triton_available()``.

Why four kernels. alpha = cos(delta) - 1 and beta = sin(delta) depend on (i, j, m) only, never on
the head (Eq. (26); docs/method.md "The correction form"), and are symmetric in (i, j) (Eq. (23)).
So the pair ratio, the angle, the phase MLP and the sin / cos run once per layer for all heads and
for half the (i, j) plane, in their own kernels, and the per-head kernels read alpha, beta tiles:
- ``phase_fwd_kernel`` (per row tile and key span; the last span may be shorter, clamped to LP):
  r, s, the MLP, delta, alpha, beta of the
  tiles at or right of the diagonal, stored at (i, j) and (j, i) in alpha, beta [B, NM, RB, LP].
- ``mdlmpe_fwd_kernel`` (per G query heads and row tile): online softmax over key tiles with
  S = (q.k + E) * scale + key bias. E is accumulated pair by pair, head by head on [BM, BN]
  tiles: alpha_m, beta_m are loaded once for the G heads, then 6 FMAs per (head, i, j, m).
  Saves O and the row max m and sum l.
- ``mdlmpe_bwd_kernel`` (per G query heads and key tile, over row tiles): recomputes E and P,
  dS = P (dP - delta) * scale; dK, dV held for the key tile; dQ's plain part and the pair parts
  of dQ added with relaxed fp32 atomics (rows are shared between key-tile programs); the pair parts of dK
  added with relaxed atomics in a fixed order (only this program touches its key positions); and
  dE/d delta, summed over the G heads in registers, atomically added to ddelta [B, NM, RB, LP]
  (the head groups of a key tile share it).
- ``phase_bwd_kernel`` (as ``phase_fwd_kernel``): back through tau * tanh and the MLP's output
  and hidden layers, once per pair for all heads (an off-diagonal tile's gradient is the sum of
  its (i, j) and (j, i) entries); MLP gradients to per-program slots, summed in torch.
Every atomic is relaxed (``sem="relaxed"``): nothing reads what they add before the kernel ends,
and the default (acq_rel) would put a GPU-wide fence around each add. The atomics make dQ's and
the MLP gradients' order of summation unfixed on a GPU (run-to-run
differences at fp32 rounding). alpha, beta and ddelta are transient HBM buffers: the wrapper
recomputes alpha, beta for backward and bounds the buffers by launching sequences, or row blocks
of one sequence (rows R0 .. R0 + RB - 1), that fit its budget; symmetry needs the whole plane in
one launch and is skipped in row blocks. The head kernels put head groups on the fastest grid
axis, so programs that run together read the same tiles of these buffers (from L2).

Layouts (made contiguous by the wrapper): q, o, dO [B, Hq, L, DH]; k, v [B, Hkv, L, DH]; the
MDLMPE pair components qp [B, Hq, NM, LP, 2], kp [B, Hkv, NM, LP, 2] fp32 (component 0: dim
2m+1, component 1: dim F+2m+1, side by side: one paired load; zero past L); their gradients dqp,
dkp [B, Hq, NM, LP, 2]; A, D [B, L, F] fp32; key bias [B, L] fp32 (0 or finfo(float32).min); row
statistics m, l, delta [B, Hq, L] fp32; W1 [H, F], b1 [H], W2 [NM, H], b2 [NM] fp32. Query head h
reads KV head h // REP. LP is L padded to a multiple of every tile, so the pair loops need no
masks. Offsets within one pair plane are 32-bit; a sequence's and a pair's planes are reached by
64-bit pointer arithmetic.

The correction for MDLMPE pair m (dims 2m+1 and F+2m+1), with C = q1 k1 + q2 k2 and
S = q2 k1 - q1 k2: E_ij = sum_m alpha C + beta S. Its gradients: dE/dq1 = alpha k1 - beta k2,
dE/dq2 = alpha k2 + beta k1, dE/dk1 = alpha q1 + beta q2, dE/dk2 = alpha q2 - beta q1,
dE/dalpha = C, dE/dbeta = S, and d alpha / d delta = -beta, d beta / d delta = 1 + alpha.

Every power-of-two padding of the phase kernels (FP, HP, chunk tails) is masked on load; padded
pairs get zero weights, hence delta = 0 and alpha = beta = 0 there.
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
def _plane_tile(rows, cols, LP):
    """Offsets [BM, BN] of a (row tile, key tile) inside one LP x LP pair plane."""
    return rows[:, None] * LP + cols[None, :]


@triton.jit
def _unstack_heads(x, G: tl.constexpr):
    """[G, R, C] -> a tuple of G [R, C] tiles in head order (G = 1, 2, 4 or 8)."""
    R: tl.constexpr = x.shape[1]
    C: tl.constexpr = x.shape[2]
    if G == 1:
        return (tl.reshape(x, (R, C)),)
    elif G == 2:
        return tl.split(tl.permute(x, (1, 2, 0)))
    elif G == 4:
        lo, hi = tl.split(tl.reshape(tl.permute(x, (1, 2, 0)), (R, C, 2, 2)))  # h % 2 == 0 / 1
        h0, h2 = tl.split(lo)
        h1, h3 = tl.split(hi)
        return (h0, h1, h2, h3)
    else:
        tl.static_assert(G == 8, "heads per program must be 1, 2, 4 or 8")
        y = tl.reshape(tl.permute(x, (1, 2, 0)), (R, C, 2, 2, 2))  # h = 4a + 2b + c
        c0, c1 = tl.split(y)
        b00, b01 = tl.split(c0)  # (b, c) = (0, 0), (1, 0)
        b10, b11 = tl.split(c1)  # (0, 1), (1, 1)
        h0, h4 = tl.split(b00)
        h2, h6 = tl.split(b01)
        h1, h5 = tl.split(b10)
        h3, h7 = tl.split(b11)
        return (h0, h1, h2, h3, h4, h5, h6, h7)


@triton.jit
def _head_pairs(b, head, pos, num_heads, NM, LP):
    """Offsets [R, 2] of pair 0's two components at positions ``pos`` [R] for one head in a
    [B, H, NM, LP, 2] array; pair m is 2 * m * LP further."""
    return (((b * num_heads + head) * NM * LP + pos) * 2)[:, None] + tl.arange(0, 2)[None, :]


@triton.jit
def _correction_grads(
    qp,
    kp,
    dqp,
    dkp,
    alpha,
    beta,
    ddelta,
    dsh,
    b,
    h0,
    REP,
    rows,
    cols,
    R0,
    RB,
    HQ,
    HKV,
    LP,
    NM,
    G: tl.constexpr,
):
    """The correction's gradients for one (row tile, key tile) and the program's G heads, given
    dS per head (``dsh``, a tuple of G [BM, BN] tiles): per pair m, alpha_m, beta_m are loaded once;
    per head, with P = dS (alpha + i beta), z_q = q1 + i q2, z_k = k1 + i k2:
    dz_q = sum_j P z_k (atomically added to dqp), dz_k = sum_i conj(P) z_q (atomically added to
    dkp), and dE/d delta dS = -Im(conj(z_q) (dS z_k + P z_k)), summed over the heads in registers
    and atomically added to ddelta (alpha, beta, ddelta point at the sequence's pair 0; their planes
    hold rows R0 .. R0 + RB - 1)."""
    tile = _plane_tile(rows - R0, cols, LP)
    plane = RB * LP
    pa = alpha + tile
    pb = beta + tile
    pd = ddelta + tile
    for m in range(NM):
        al = tl.load(pa)
        be = tl.load(pb)
        dd = tl.zeros(al.shape, tl.float32)
        for g in tl.static_range(G):
            q_off = _head_pairs(b, h0 + g, rows, HQ, NM, LP) + 2 * m * LP  # [BM, 2]
            k_off = _head_pairs(b, (h0 + g) // REP, cols, HKV, NM, LP) + 2 * m * LP  # [BN, 2]
            dk_off = _head_pairs(b, h0 + g, cols, HQ, NM, LP) + 2 * m * LP
            q1, q2 = tl.split(tl.load(qp + q_off))
            k1, k2 = tl.split(tl.load(kp + k_off))
            q1 = q1[:, None]
            q2 = q2[:, None]
            k1 = k1[None, :]
            k2 = k2[None, :]
            ds = dsh[g]
            ga = ds * al
            gb = ds * be
            v1 = ga * k1 - gb * k2  # P z_k
            v2 = ga * k2 + gb * k1
            tl.atomic_add(dqp + q_off, tl.join(tl.sum(v1, axis=1), tl.sum(v2, axis=1)), sem="relaxed")
            dk = tl.join(tl.sum(ga * q1 + gb * q2, axis=0), tl.sum(ga * q2 - gb * q1, axis=0))
            # An atomic, not a load-add-store: the layout may hold an element in several threads,
            # and a plain store by one need not be visible to the others' next load. Only this
            # program adds to these key positions, always from the same thread: a fixed order.
            tl.atomic_add(dkp + dk_off, dk, sem="relaxed")
            dd += q2 * (ds * k1 + v1) - q1 * (ds * k2 + v2)
        tl.atomic_add(pd, dd, sem="relaxed")
        pa += plane
        pb += plane
        pd += plane


@triton.jit
def _stack_heads(t, G: tl.constexpr):
    """The inverse of ``_unstack_heads``: a tuple of G [R, C] tiles in head order -> [G, R, C]."""
    if G == 1:
        x = t[0][None, :, :]
    elif G == 2:
        x = tl.permute(tl.join(t[0], t[1]), (2, 0, 1))
    elif G == 4:
        lo = tl.join(t[0], t[2])
        hi = tl.join(t[1], t[3])
        y = tl.join(lo, hi)  # [R, C, 2 (h // 2), 2 (h % 2)]
        x = tl.permute(tl.reshape(y, (y.shape[0], y.shape[1], 4)), (2, 0, 1))
    else:
        tl.static_assert(G == 8, "heads per program must be 1, 2, 4 or 8")
        b00 = tl.join(t[0], t[4])
        b01 = tl.join(t[2], t[6])
        b10 = tl.join(t[1], t[5])
        b11 = tl.join(t[3], t[7])
        y = tl.join(tl.join(b00, b01), tl.join(b10, b11))  # [R, C, 2 (a), 2 (b), 2 (c)]
        x = tl.permute(tl.reshape(y, (y.shape[0], y.shape[1], 8)), (2, 0, 1))
    return x


@triton.jit
def _correction(qp, kp, alpha, beta, b, h0, REP, rows, cols, R0, RB, HQ, HKV, LP, NM, G: tl.constexpr):
    """E [G, BM, BN] = sum_m alpha_m C + beta_m S of the program's heads h0 .. h0 + G - 1 (6 FMAs
    per head, pair and (i, j)), head by head on [BM, BN] tiles: alpha_m, beta_m [BM, BN] are loaded
    once for the G heads (alpha, beta point at the sequence's pair 0; their planes hold rows
    R0 .. R0 + RB - 1). Every buffer is padded to LP: the loop has no masks."""
    tile = _plane_tile(rows - R0, cols, LP)
    plane = RB * LP
    pa = alpha + tile
    pb = beta + tile
    # One [BM, BN] accumulator per head, a tuple (Triton's JIT builds tuples by concatenation).
    e = ()
    for _ in tl.static_range(G):
        e = e + (tl.zeros(tile.shape, tl.float32),)  # noqa: RUF005
    for m in range(NM):
        al = tl.load(pa)
        be = tl.load(pb)
        out = ()
        for g in tl.static_range(G):
            q_off = _head_pairs(b, h0 + g, rows, HQ, NM, LP) + 2 * m * LP  # [BM, 2]
            k_off = _head_pairs(b, (h0 + g) // REP, cols, HKV, NM, LP) + 2 * m * LP  # [BN, 2]
            q1, q2 = tl.split(tl.load(qp + q_off))
            k1, k2 = tl.split(tl.load(kp + k_off))
            q1 = q1[:, None]
            q2 = q2[:, None]
            k1 = k1[None, :]
            k2 = k2[None, :]
            eg = tl.fma(al, q1 * k1 + q2 * k2, e[g])
            out = out + (tl.fma(be, q2 * k1 - q1 * k2, eg),)  # noqa: RUF005
        e = out
        pa += plane
        pb += plane
    return _stack_heads(e, G)


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
def _w2_rows(w2, m, h, HID, NM):
    """Rows ``m`` [MC] of W2 [NM, HID] over hidden units ``h`` [HP], fp32 [MC, HP]; 0 past NM, HID."""
    return tl.load(w2 + m[:, None] * HID + h[None, :], mask=(m[:, None] < NM) & (h[None, :] < HID), other=0.0)


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
    w2c = _w2_rows(w2, m, tl.arange(0, HP), HID, NM)
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
def _phase_program(
    a_ptr, d_ptr, w1, b1, L, LP, R0, KSPAN, SYM, F, HID, FP: tl.constexpr, HP: tl.constexpr, BM: tl.constexpr
):
    """What a phase-kernel program (grid: row tiles, key spans, sequences) works on: its sequence b,
    rows [BM], the feature index f [FP] and its mask, the rows' A, D [BM, FP], W1 transposed and b1,
    the first row (the diagonal) and its key range [lo, hi): the span, from the diagonal on if SYM."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    b = tl.program_id(2)
    diagonal = R0 + pid_m * BM
    rows = diagonal + tl.arange(0, BM)
    row_ok = rows < L
    f = tl.arange(0, FP)
    f_ok = f < F
    a_i = _load_rows(a_ptr, b, rows, f, L, F, row_ok, f_ok, 0.0)  # [BM, FP]
    d_i = _load_rows(d_ptr, b, rows, f, L, F, row_ok, f_ok, 1.0)
    w1t, b1v = _load_w1(w1, b1, F, HID, FP, HP)
    lo = pid_k * KSPAN
    if SYM:
        lo = tl.maximum(lo, diagonal)
    return b, rows, f, f_ok, a_i, d_i, w1t, b1v, diagonal, lo, tl.minimum(pid_k * KSPAN + KSPAN, LP)


@triton.jit
def _chunk_planes(c: tl.constexpr, MC: tl.constexpr, NM, RB, LP, cols, diagonal, BM: tl.constexpr):
    """Pairs m [MC] of chunk c, their planes' offsets [1, 1, MC] in a [NM, RB, LP] buffer, the
    mask of real pairs, and that mask off the diagonal tile (cols past the row tile: the tile
    also stands for its mirror (j, i))."""
    m = c * MC + tl.arange(0, MC)
    plane = m[None, None, :].to(tl.int64) * RB * LP
    mask = (m < NM)[None, None, :]
    return m, plane, mask, mask & (cols[None, :, None] >= diagonal + BM)


@triton.jit
def phase_fwd_kernel(
    a_ptr,
    d_ptr,
    w1,
    b1,
    w2,
    b2,
    alpha,
    beta,
    L,
    LP,
    R0,
    RB,
    KSPAN,
    SYM,
    F,
    HID,
    NM,
    tau_max,
    clip_kappa,
    FP: tl.constexpr,
    HP: tl.constexpr,
    MC: tl.constexpr,
    NC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    POLY: tl.constexpr,
):
    """alpha, beta [B, NM, RB, LP] (rows R0 .. R0 + RB - 1) of one row tile against KSPAN key
    positions (Eqs. (23)-(26)), the padding included (A = 0, D = 1 there: finite values that meet
    zero pair components). SYM (the whole plane in one launch, R0 = 0, RB = LP): r, hence delta,
    alpha and beta, are symmetric in (i, j) (Eq. (23) adds A_i + A_j and D_i + D_j, the same fp32
    sums either way), so only key tiles at or right of the diagonal are computed and each one is
    also stored transposed."""
    b, rows, f, f_ok, a_i, d_i, w1t, b1v, diagonal, lo, hi = _phase_program(
        a_ptr, d_ptr, w1, b1, L, LP, R0, KSPAN, SYM, F, HID, FP, HP, BM
    )
    seq = b.to(tl.int64) * NM * RB * LP
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        a_j = _load_rows(a_ptr, b, cols, f, L, F, cols < L, f_ok, 0.0)
        d_j = _load_rows(d_ptr, b, cols, f, L, F, cols < L, f_ok, 1.0)
        _, _, _, hid = _phase_hidden(a_i, d_i, a_j, d_j, f_ok, w1t, b1v, clip_kappa, BM, BN, FP, PREC)
        tile = _plane_tile(rows - R0, cols, LP)[:, :, None]
        mirror = cols[None, :, None] * LP + rows[:, None, None]  # (j, i) in a whole-sequence plane
        for c in tl.static_range(NC):
            _, al, be, _ = _phase_chunk(hid, w2, b2, c, HID, NM, tau_max, BM, BN, HP, MC, PREC, POLY)
            _, plane, mask, off_diagonal = _chunk_planes(c, MC, NM, RB, LP, cols, diagonal, BM)
            tl.store(alpha + seq + plane + tile, al, mask=mask)
            tl.store(beta + seq + plane + tile, be, mask=mask)
            if SYM:
                tl.store(alpha + seq + plane + mirror, al, mask=off_diagonal)
                tl.store(beta + seq + plane + mirror, be, mask=off_diagonal)


@triton.jit
def phase_bwd_kernel(
    a_ptr,
    d_ptr,
    w1,
    b1,
    w2,
    b2,
    ddelta,
    dw1,
    db1,
    dw2,
    db2,
    L,
    LP,
    R0,
    RB,
    KSPAN,
    SYM,
    F,
    HID,
    NM,
    tau_max,
    clip_kappa,
    FP: tl.constexpr,
    HP: tl.constexpr,
    MC: tl.constexpr,
    NC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    POLY: tl.constexpr,
):
    """From dE/d delta [B, NM, RB, LP] (rows R0 .. R0 + RB - 1, summed over all heads) back through
    tau * tanh and the phase MLP's output and hidden layers, for one row tile against KSPAN key
    positions. The hidden layer is recomputed (SWAP) after the chunk loop rather than held through
    it. SYM as in ``phase_fwd_kernel``: an off-diagonal tile's MLP input serves (i, j) and (j, i),
    so its output gradient is the sum of both entries. Gradients go to this program's slot of
    dw1 [S, H, F], db1 [S, H], dw2 [S, NM, H], db2 [S, NM] (dw2, db2 zeroed)."""
    b, rows, f, f_ok, a_i, d_i, w1t, b1v, diagonal, lo, hi = _phase_program(
        a_ptr, d_ptr, w1, b1, L, LP, R0, KSPAN, SYM, F, HID, FP, HP, BM
    )
    # One slot per (sequence, row tile of the whole sequence, key span).
    slot = (b * (LP // BM) + diagonal // BM) * tl.num_programs(1) + tl.program_id(1)
    hh = tl.arange(0, HP)
    seq = b.to(tl.int64) * NM * RB * LP
    dw1_acc = tl.zeros((HP, FP), tl.float32)
    db1_acc = tl.zeros((HP,), tl.float32)
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        a_j = _load_rows(a_ptr, b, cols, f, L, F, cols < L, f_ok, 0.0)
        d_j = _load_rows(d_ptr, b, cols, f, L, F, cols < L, f_ok, 1.0)
        _, _, _, hid = _phase_hidden(a_i, d_i, a_j, d_j, f_ok, w1t, b1v, clip_kappa, BM, BN, FP, PREC)
        tile = _plane_tile(rows - R0, cols, LP)[:, :, None]
        mirror = cols[None, :, None] * LP + rows[:, None, None]
        d_hid = tl.zeros((BM * BN, HP), tl.float32)
        for c in tl.static_range(NC):
            t, _, _, w2c = _phase_chunk(hid, w2, b2, c, HID, NM, tau_max, BM, BN, HP, MC, PREC, POLY)
            m, plane, mask, off_diagonal = _chunk_planes(c, MC, NM, RB, LP, cols, diagonal, BM)
            d_delta = tl.load(ddelta + seq + plane + tile, mask=mask, other=0.0)  # [BM, BN, MC]
            if SYM:
                d_delta += tl.load(ddelta + seq + plane + mirror, mask=off_diagonal, other=0.0)
            d_out = tl.reshape(d_delta, (BM * BN, MC)) * tau_max * (1.0 - t * t)  # [BM*BN, MC]
            p_ok = m < NM
            w_mask = p_ok[:, None] & (hh[None, :] < HID)
            dw2_c = tl.dot(tl.trans(d_out), hid, input_precision=PREC)  # [MC, HP]
            w2_slot = dw2 + slot * NM * HID + m[:, None] * HID + hh[None, :]
            tl.atomic_add(w2_slot, dw2_c, mask=w_mask, sem="relaxed")  # only this program's slot
            tl.atomic_add(db2 + slot * NM + m, tl.sum(d_out, axis=0), mask=p_ok, sem="relaxed")
            d_hid += tl.dot(d_out, w2c, input_precision=PREC)  # [BM*BN, HP]
        s2, pre, sig, _ = _phase_hidden(
            a_i, d_i, a_j, d_j, f_ok, w1t, b1v, clip_kappa, BM, BN, FP, PREC, True
        )
        d_pre = d_hid * sig * (1.0 + pre * (1.0 - sig))
        dw1_acc += tl.dot(tl.trans(d_pre), s2, input_precision=PREC)
        db1_acc += tl.sum(d_pre, axis=0)
    w1_mask = (hh[:, None] < HID) & f_ok[None, :]
    tl.store(dw1 + slot * HID * F + hh[:, None] * F + f[None, :], dw1_acc, mask=w1_mask)
    tl.store(db1 + slot * HID + hh, db1_acc, mask=hh < HID)


@triton.jit
def mdlmpe_fwd_kernel(
    q,
    k,
    v,
    qp,
    kp,
    alpha,
    beta,
    kbias,
    o,
    m_out,
    l_out,
    L,
    LP,
    R0,
    RB,
    HQ,
    HKV,
    NM,
    scale,
    REP: tl.constexpr,
    G: tl.constexpr,
    DH: tl.constexpr,
    DP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online-softmax forward over key tiles; saves O and the row statistics (max m, sum l)."""
    # Head groups on the fastest grid axis: the programs running together share a row tile, so
    # its alpha, beta planes are read from HBM once and from L2 by the other groups.
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    groups = HQ // G
    b = pid_bh // groups
    heads0 = (pid_bh % groups) * G
    heads = heads0 + tl.arange(0, G)  # [G] query heads
    kv_heads = heads // REP
    rows = R0 + pid_m * BM + tl.arange(0, BM)
    row_ok = rows < L
    d = tl.arange(0, DP)
    d_ok = d < DH
    seq = b.to(tl.int64) * NM * RB * LP
    qt = _load_heads(q, b, heads, rows, d, HQ, L, DH, row_ok, d_ok)  # [G, BM, DP]

    m_i = tl.full((G, BM), float("-inf"), tl.float32)
    l_i = tl.zeros((G, BM), tl.float32)
    acc = tl.zeros((G, BM, DP), tl.float32)
    for start in range(0, L, BN):
        cols = start + tl.arange(0, BN)
        col_ok = cols < L
        kt = _load_heads_t(k, b, kv_heads, cols, d, HKV, L, DH, col_ok, d_ok)  # [G, DP, BN]
        vt = _load_heads(v, b, kv_heads, cols, d, HKV, L, DH, col_ok, d_ok)  # [G, BN, DP]
        bias = tl.load(kbias + b * L + cols, mask=col_ok, other=float("-inf"))  # [BN]
        e = _correction(
            qp, kp, alpha + seq, beta + seq, b, heads0, REP, rows, cols, R0, RB, HQ, HKV, LP, NM, G
        )
        s = (_mm(qt, kt, PREC, UPCAST) + e) * scale + bias[None, None, :]  # [G, BM, BN]
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
    qp,
    kp,
    alpha,
    beta,
    kbias,
    do_ptr,
    m_ptr,
    l_ptr,
    dlt_ptr,
    dq,
    dk,
    dv,
    dqp,
    dkp,
    ddelta,
    L,
    LP,
    R0,
    RB,
    HQ,
    HKV,
    NM,
    scale,
    REP: tl.constexpr,
    G: tl.constexpr,
    DH: tl.constexpr,
    DP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Per G query heads and key tile, over rows R0 .. R0 + RB - 1: dK, dV (per query head, fp32,
    added to what earlier row blocks left), dQ's plain part and the pair parts dqp (atomic adds),
    the pair parts of dK in dkp (atomic adds from this program only: a fixed order), and
    dE/d delta summed over the G heads, atomically added to ddelta [B, NM, RB, LP]. Every output
    buffer is zeroed by the wrapper. Rows past L have P = 0, hence dS = 0: they add zeros."""
    pid_bh = tl.program_id(0)  # head groups fastest: they share the key tile's pair planes in L2
    pid_n = tl.program_id(1)
    groups = HQ // G
    b = pid_bh // groups
    heads0 = (pid_bh % groups) * G
    heads = heads0 + tl.arange(0, G)
    kv_heads = heads // REP
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < L
    d = tl.arange(0, DP)
    d_ok = d < DH
    seq = b.to(tl.int64) * NM * RB * LP

    kt = _load_heads_t(k, b, kv_heads, cols, d, HKV, L, DH, col_ok, d_ok)  # [G, DP, BN]
    vt = _load_heads_t(v, b, kv_heads, cols, d, HKV, L, DH, col_ok, d_ok)  # [G, DP, BN]
    bias = tl.load(kbias + b * L + cols, mask=col_ok, other=float("-inf"))
    dk_acc = tl.zeros((G, BN, DP), tl.float32)
    dv_acc = tl.zeros((G, BN, DP), tl.float32)
    for start in range(R0, tl.minimum(R0 + RB, L), BM):
        rows = start + tl.arange(0, BM)
        row_ok = rows < L
        qt = _load_heads(q, b, heads, rows, d, HQ, L, DH, row_ok, d_ok)  # [G, BM, DP]
        do = _load_heads(do_ptr, b, heads, rows, d, HQ, L, DH, row_ok, d_ok)
        stat = (b * HQ + heads[:, None]) * L + rows[None, :]
        m_i = tl.load(m_ptr + stat, mask=row_ok[None, :], other=0.0)
        l_i = tl.load(l_ptr + stat, mask=row_ok[None, :], other=1.0)
        delta_i = tl.load(dlt_ptr + stat, mask=row_ok[None, :], other=0.0)
        e = _correction(
            qp, kp, alpha + seq, beta + seq, b, heads0, REP, rows, cols, R0, RB, HQ, HKV, LP, NM, G
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
        # Relaxed, like every other atomic here: the default (acq_rel) puts a GPU-wide fence
        # around each add, and nothing reads dQ before the kernel ends.
        tl.atomic_add(dq + dq_offs, dq_part, mask=row_ok[None, :, None] & d_ok[None, None, :], sem="relaxed")
        # 3. Correction, pair by pair, head by head on [BM, BN] tiles: alpha_m, beta_m loaded once
        #    for the G heads, dE/d delta summed over them in registers.
        dsh = _unstack_heads(ds, G)
        _correction_grads(
            qp,
            kp,
            dqp,
            dkp,
            alpha + seq,
            beta + seq,
            ddelta + seq,
            dsh,
            b,
            heads0,
            REP,
            rows,
            cols,
            R0,
            RB,
            HQ,
            HKV,
            LP,
            NM,
            G,
        )

    out_mask = col_ok[None, :, None] & d_ok[None, None, :]
    offs = ((b * HQ + heads[:, None, None]) * L + cols[None, :, None]) * DH + d[None, None, :]
    # Row blocks are separate launches: add to what the earlier ones left (zeroed first).
    tl.store(dk + offs, tl.load(dk + offs, mask=out_mask, other=0.0) + dk_acc, mask=out_mask)
    tl.store(dv + offs, tl.load(dv + offs, mask=out_mask, other=0.0) + dv_acc, mask=out_mask)
