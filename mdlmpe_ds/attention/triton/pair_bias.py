"""The @triton.jit kernels of the ``triton-pair`` backend: the MDLMPE correction as an additive
attention bias, computed once per (i, j) tile for every head of a layer.

Import this module only after deciding the execution mode (``TRITON_INTERPRET``), like
``triton.kernels``, whose maths helpers it reuses (the pair ratio and angle, the phase MLP, the
polynomial sin / cos, the row loads): the numbers of alpha, beta are those of the fused kernels.

Why this design (docs/method.md "The correction form"). alpha = cos(delta) - 1 and beta = sin(delta)
depend on (i, j, m) only. The fused kernels write them to fp32 [B, |M|, L, L] buffers and stream
them through L2 once per head group. Here a program computes them for its (i, j) tile in
registers and loops over the heads itself, so nothing of size |M| L^2 is ever written:
- ``pair_bias_fwd_kernel`` (grid: row tiles, key tiles, sequences): r, s, the MLP, delta, alpha,
  beta of the tile, then per query head E = sum_m alpha C + beta S (fp32) and the bias
  E * scale + key bias, stored in the attention's dtype into bias [B, Hq, L, L]. A flash-class
  attention with that additive bias gives the MDLMPE output and returns its gradient dBias.
- ``pair_bias_bwd_q_kernel`` (grid: row tiles, key splits, sequences; loop over the key tiles of
  its split): per tile alpha, beta again, per head dE = dBias * scale folded into the query pair
  gradient (this program's rows of its split's partial dqpair only: atomics from one program, a
  fixed order) and into dE/d delta summed over the heads in registers; then, still in registers,
  back through tau * tanh and the MLP (its hidden layer recomputed after the head loop, so that
  it is not live through it); the MLP gradients go to this program's own slot.
- ``pair_bias_bwd_k_kernel`` (grid: key tiles, row splits, sequences; loop over the row tiles of
  its split): the key pair gradient, summed over the query heads of each KV head in registers,
  into this program's keys of its split's partial dkpair.
No program adds to memory another program writes, and the wrapper sums the partials and slots in
torch in a fixed order: the backward is deterministic on a GPU.

Why split loops: without them a backward program loops over all L / tile positions of the other
side, and the key side has only L / 16 programs per sequence (128 at L = 2048: about one per SM of
an H100). Cutting each loop into S splits (``launch.pair_backward_splits``: >= 4 waves of
programs where the memory bound allows; SPLIT_TILES tiles per split, the last split shorter when S
does not divide the tiles) multiplies the programs by S and divides each one's loop by S. The
cost: S fp32 partials of the pair gradients, S x |qpair| and S x |kpair| elements (bounded there
to 1/8 of the bias and its gradient each; at L = 4096, batch 1, LLaDA-8B: 3 x 32 MiB and
2 x 32 MiB, against 2 GiB of bias and gradient), and S x the MLP slots (S x L / tile_m x B of
them, 12.5 KB each at d_h 128 and the default hidden width 32).

Why the head loops look as they do (the sm_90 machine code; tests/unit/test_triton_resources.py
holds it). Every kernel loops over the heads with all pair chunks inside (alpha, beta of every
chunk live through the loop), so each head's dBias tile and pair-component planes are read once.
Inside the loop every thread works on its own (i, j, pair) elements of [tile_m, tile_n, 16]
tiles, in the layout alpha, beta were given once per tile. Each thread loads
the pair components of those elements itself, already broadcast over the other tile axis
(``_pairs_across``: 16-byte fp32 loads; threads sharing a row or key read the same L1 line), and
alpha, beta meet the loaded components before the head's dE does, so the compiler converts
alpha, beta's layout once per tile, not each head's products once per head. Before, the
components came in as [rows, pairs] tiles in bf16 and were redistributed through shared memory
with block-wide barriers for every head (10 barriers per head in the forward, 10 and 28 in the
backward kernels; now 2, 4 and 22: the key side still sums its tiles over rows held by different
warps). The backward kernels request the next head's dBias tile (streamed from
HBM) before the current head's arithmetic, so that its latency overlaps it.

PAIR_DT (a constexpr of all three kernels): the dtype of the per-head pair arithmetic. fp32 by
default; every conversion it adds is then a no-op and the machine code is the recorded one. fp16
(``PairLaunchConfig.half_pairs``, opt-in: pair components, alpha, beta, dE and their products packed
two to a register; every sum over heads, keys, rows and pair chunks in fp32, the cross-lane ones
included; the backward's dE scaled by a power of two by the wrapper): its precision and sm_90
machine code are in benchmarks/gpu_cost/half_pairs.py and docs/gpu.md; its speed is unmeasured.

Layouts (contiguous, made by the wrapper): qpair [B, Hq, LP, 2 NMP], kpair [B, Hkv, LP, 2 NMP]
fp32, component-major (``pair_backend.pair_components``: component 0 of pair m, dim 2m + 1, at m;
component 1, dim F + 2m + 1, at NMP + m; zeros past L and NM: LP = ``launch.pair_padded_length``,
NMP = NC x MC, so their loads need no mask); bias, dbias [B, Hq, L, L] in the model dtype; kbias
[B, L] fp32 (0 or the dtype's ``common.masked_key_bias``); the partials dqpair [key splits, B, Hq,
LP, 2 NMP] and dkpair [row splits, B, Hkv, LP, 2 NMP] fp32 in the same layout (zeroed); A, D
[B, L, F] fp32; W1 [H, F], b1 [H], W2 [NM, H], b2 [NM] fp32; MLP-gradient slots (one per
query-side program: P = row tiles x key splits x B) dw1 [P, H, F], db1 [P, H] (written), dw2
[P, NM, H], db2 [P, NM] (zeroed). Query head h reads KV head h // REP.
Rows and keys past L read A = 0, D = 1 (a finite ratio) and zero pair components; their dBias is
read as 0, so they add nothing to the gradients, and their bias is never stored.

Gradients of E for pair m (C = q1 k1 + q2 k2, S = q2 k1 - q1 k2; kernels.py): dE/dq1 = alpha k1 -
beta k2, dE/dq2 = alpha k2 + beta k1, dE/dk1 = alpha q1 + beta q2, dE/dk2 = alpha q2 - beta q1,
dE/d delta = -beta C + (1 + alpha) S.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mdlmpe_ds.attention.triton.kernels import _load_rows, _load_w1, _phase_chunk, _phase_hidden, _w2_rows


@triton.jit
def _pairs_across(head_ptr, pos, m, other, NMP: tl.constexpr, POS_FIRST: tl.constexpr):
    """Pair components (x1, x2) of pairs ``m`` [MC] at positions ``pos`` [R] of one head's
    [LP, 2 NMP] plane (``head_ptr``), loaded already broadcast over the other tile axis
    (``other`` [O]): [R, O, MC] if POS_FIRST, else [O, R, MC]; fp32.

    Why broadcast at the load: every thread loads the components its own (i, j, m) elements need,
    in the layout the pair arithmetic uses (contiguous pairs: 16-byte loads; threads that share a
    position read the same L1 line). A [R, MC] load broadcast afterwards would be converted
    through shared memory, with block-wide barriers, once per head. No mask: the plane is padded
    to LP rows and NMP pairs with zeros."""
    off = pos * (2 * NMP)  # [R]
    zero = tl.zeros_like(other)  # [O] (the other axis: a stride-0 broadcast)
    if POS_FIRST:
        offs = off[:, None, None] + zero[None, :, None] + m[None, None, :]
    else:
        offs = zero[:, None, None] + off[None, :, None] + m[None, None, :]
    return tl.load(head_ptr + offs), tl.load(head_ptr + offs + NMP)


@triton.jit
def _ds_tile(dbias, b, head, rows, cols, num_heads, L, scale):
    """dE = dBias[b, head, i, j] * scale (fp32) [BM, BN]; 0 outside L x L (64-bit row offsets).
    Loaded 2-D and broadcast over the pairs by the caller: a load already broadcast would be
    converted to the pair arithmetic's layout with every pair's copy (it is contiguous along the
    keys, the pair components along the pairs)."""
    ptrs, mask = _plane(dbias, b, head, rows, cols, num_heads, L, rows < L, cols < L)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * scale


@triton.jit
def _add_pairs(row_ptr, x1, x2, NMP: tl.constexpr):
    """Add (x1, x2) [R, MC] to the pair components at ``row_ptr`` [R, MC] (component 0; component
    1 at + NMP): one atomic of both components (relaxed: only the calling program touches these
    positions of its part, from the same threads each time, a fixed order; no fence)."""
    both = tl.permute(tl.join(x1, x2), (0, 2, 1))  # [R, 2, MC]
    offs = row_ptr[:, None, :] + (tl.arange(0, 2) * NMP)[None, :, None]
    tl.atomic_add(offs, both, sem="relaxed")


@triton.jit
def _plane_ptr(ptr, b, head, num_heads, LP, NMP: tl.constexpr):
    """Pointer to one head's [LP, 2 NMP] plane of a [B, H, LP, 2 NMP] pair array."""
    return ptr + ((b * num_heads + head) * LP).to(tl.int64) * (2 * NMP)


@triton.jit
def _plane(ptr, b, head, rows, cols, num_heads, L, row_ok, col_ok):
    """Offsets and mask [BM, BN] of a (row tile, key tile) in one head's L x L plane of a
    [B, H, L, L] array."""
    base = ((b * num_heads + head) * L + rows).to(tl.int64) * L
    return ptr + base[:, None] + cols[None, :], row_ok[:, None] & col_ok[None, :]


@triton.jit
def _tile_phases(
    a_i, d_i, a_j, d_j, f_ok, w1t, b1v, w2, b2, clip_kappa, tau_max, HID, NM,
    BM: tl.constexpr, BN: tl.constexpr, FP: tl.constexpr, HP: tl.constexpr, MC: tl.constexpr,
    NC: tl.constexpr, PREC: tl.constexpr, POLY: tl.constexpr,
):  # fmt: skip
    """The phase MLP once for a (row tile, key tile) and all heads: per chunk of MC pairs, t =
    tanh(W2 hid + b2) [BM*BN, MC] and alpha, beta [BM, BN, MC] (tuples of NC). The hidden layer
    is not returned: a caller that needs it again recomputes it rather than keep it live."""
    _, _, _, hid = _phase_hidden(a_i, d_i, a_j, d_j, f_ok, w1t, b1v, clip_kappa, BM, BN, FP, PREC)
    ts = ()
    alphas = ()
    betas = ()
    for c in tl.static_range(NC):
        t, al, be, _ = _phase_chunk(hid, w2, b2, c, HID, NM, tau_max, BM, BN, HP, MC, PREC, POLY)
        ts = ts + (t,)  # noqa: RUF005
        alphas = alphas + (al,)  # noqa: RUF005
        betas = betas + (be,)  # noqa: RUF005
    return ts, alphas, betas


@triton.jit
def _in_pair_dtype(xs, PAIR_DT: tl.constexpr):
    """A tuple of tiles in the pair arithmetic's dtype PAIR_DT: fp32 by default (no instruction),
    fp16 under ``PairLaunchConfig.half_pairs`` (packed two to a register)."""
    out = ()
    for c in tl.static_range(len(xs)):
        out = out + (xs[c].to(PAIR_DT),)  # noqa: RUF005
    return out


@triton.jit
def _chunk_zeros(BM: tl.constexpr, BN: tl.constexpr, MC: tl.constexpr, NC: tl.constexpr):
    """NC fp32 zero tiles [BM, BN, MC]: one accumulator per pair chunk, a tuple."""
    zeros = ()
    for _chunk in tl.static_range(NC):
        zeros = zeros + (tl.zeros((BM, BN, MC), tl.float32),)  # noqa: RUF005
    return zeros


@triton.jit
def _tile_features(a_ptr, d_ptr, b, pos, f, L, F, f_ok):
    """A, D rows [R, FP] of positions ``pos`` (A = 0, D = 1 past L: a finite ratio)."""
    ok = pos < L
    a = _load_rows(a_ptr, b, pos, f, L, F, ok, f_ok, 0.0)
    return a, _load_rows(d_ptr, b, pos, f, L, F, ok, f_ok, 1.0)


@triton.jit
def pair_bias_fwd_kernel(
    a_ptr,
    d_ptr,
    w1,
    b1,
    w2,
    b2,
    qpair,
    kpair,
    kbias,
    bias,
    L,
    LP,
    HQ,
    HKV,
    F,
    HID,
    NM,
    scale,
    tau_max,
    clip_kappa,
    REP: tl.constexpr,
    FP: tl.constexpr,
    HP: tl.constexpr,
    MC: tl.constexpr,
    NC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    POLY: tl.constexpr,
    PAIR_DT: tl.constexpr = tl.float32,
):
    """bias[b, h, i, j] = E_h[i, j] * scale + kbias[b, j] for every query head h of the (row tile,
    key tile) of this program (Eqs. (23)-(26) once, then 6 FMAs per head, pair and (i, j))."""
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
    # 1. The phase MLP once for all heads: alpha, beta [BM, BN, MC] per chunk of pairs, kept.
    _, alphas, betas = _tile_phases(
        a_i, d_i, a_j, d_j, f_ok, w1t, b1v, w2, b2, clip_kappa, tau_max, HID, NM,
        BM, BN, FP, HP, MC, NC, PREC, POLY,
    )  # fmt: skip
    key_bias = tl.load(kbias + b * L + cols, mask=col_ok, other=0.0)  # [BN]
    alphas = _in_pair_dtype(alphas, PAIR_DT)
    betas = _in_pair_dtype(betas, PAIR_DT)
    # 2. Per head: E = sum_m alpha C + beta S on the tile, in fp32 (summed over the pairs once per
    #    head); the bias in the model dtype. PAIR_DT fp16 (half_pairs): the per-pair products and the
    #    sum over the chunks in fp16, as q1 u1 + q2 u2 with u = (alpha k1 - beta k2, alpha k2 +
    #    beta k1) (|u| <= 0.28 |k|: far from fp16's overflow, where C, S need not be), then fp32.
    for h in range(HQ):
        q_plane = _plane_ptr(qpair, b, h, HQ, LP, NMP)
        k_plane = _plane_ptr(kpair, b, h // REP, HKV, LP, NMP)
        e3 = tl.zeros((BM, BN, MC), PAIR_DT)
        for c in tl.static_range(NC):
            q1, q2 = _pairs_across(q_plane, rows, c * MC + mm, cols, NMP, True)  # [BM, BN, MC]
            k1, k2 = _pairs_across(k_plane, cols, c * MC + mm, rows, NMP, False)
            if PAIR_DT.is_fp16():
                q1, q2, k1, k2 = _in_pair_dtype((q1, q2, k1, k2), PAIR_DT)
                u1 = alphas[c] * k1 - betas[c] * k2
                u2 = alphas[c] * k2 + betas[c] * k1
                e3 += q1 * u1 + q2 * u2
            else:
                e3 += alphas[c] * (q1 * k1 + q2 * k2) + betas[c] * (q2 * k1 - q1 * k2)
        ptrs, mask = _plane(bias, b, h, rows, cols, HQ, L, row_ok, col_ok)
        e = tl.sum(e3.to(tl.float32), axis=2)
        tl.store(ptrs, (e * scale + key_bias[None, :]).to(bias.dtype.element_ty), mask=mask)


@triton.jit
def pair_bias_bwd_q_kernel(
    a_ptr,
    d_ptr,
    w1,
    b1,
    w2,
    b2,
    qpair,
    kpair,
    dbias,
    dqpair,
    dw1,
    db1,
    dw2,
    db2,
    L,
    LP,
    HQ,
    HKV,
    F,
    HID,
    NM,
    scale,
    tau_max,
    clip_kappa,
    SPLIT_TILES,
    REP: tl.constexpr,
    FP: tl.constexpr,
    HP: tl.constexpr,
    MC: tl.constexpr,
    NC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    POLY: tl.constexpr,
    PAIR_DT: tl.constexpr = tl.float32,
):
    """For one row tile, over the SPLIT_TILES key tiles of its split (the last split's may be
    fewer): the query pair gradients of every head into the split's partial dqpair, dE/d delta
    summed over the heads, and the phase MLP's backward into this program's MLP slot
    ((split * B + b) * row tiles + row tile)."""
    NMP: tl.constexpr = NC * MC
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    part = split * tl.num_programs(2) + b  # [S, B] -> S * B: this split's part of dqpair
    slot = part * tl.num_programs(0) + pid
    dq_part = dqpair + part.to(tl.int64) * HQ * LP * (2 * NMP)  # [Hq, LP, 2 NMP]
    key_start = split * SPLIT_TILES * BN
    key_end = tl.minimum(key_start + SPLIT_TILES * BN, L)
    rows = pid * BM + tl.arange(0, BM)
    f = tl.arange(0, FP)
    f_ok = f < F
    hh = tl.arange(0, HP)
    mm = tl.arange(0, MC)
    a_i, d_i = _tile_features(a_ptr, d_ptr, b, rows, f, L, F, f_ok)
    w1t, b1v = _load_w1(w1, b1, F, HID, FP, HP)
    dw1_acc = tl.zeros((HP, FP), tl.float32)
    db1_acc = tl.zeros((HP,), tl.float32)
    for start in range(key_start, key_end, BN):
        cols = start + tl.arange(0, BN)
        a_j, d_j = _tile_features(a_ptr, d_ptr, b, cols, f, L, F, f_ok)
        # 1. alpha, beta and t = tanh(.) of every pair chunk, kept through the head loop; the
        #    hidden layer is not (it is recomputed for the MLP's backward below).
        ts, alphas, betas = _tile_phases(
            a_i, d_i, a_j, d_j, f_ok, w1t, b1v, w2, b2, clip_kappa, tau_max, HID, NM,
            BM, BN, FP, HP, MC, NC, PREC, POLY,
        )  # fmt: skip
        dds = _chunk_zeros(BM, BN, MC, NC)
        al_h = _in_pair_dtype(alphas, PAIR_DT)  # fp16 (half_pairs): the per-head products in fp16,
        be_h = _in_pair_dtype(betas, PAIR_DT)  # every sum (keys, heads, key tiles) in fp32
        # 2. Per head (its dE tile loaded once for all chunks): the query pair gradient (P = dE
        #    (alpha + i beta) times z_k, summed over the keys) and dE/d delta = -beta C +
        #    (1 + alpha) S, summed over the heads, per chunk.
        ds_next = _ds_tile(dbias, b, 0, rows, cols, HQ, L, scale)
        for h in range(HQ):
            # dBias streams from HBM: the next head's tile is requested before this head's
            # arithmetic, so its latency overlaps it (the last head reloads itself).
            ds = ds_next[:, :, None]  # [BM, BN, 1]
            ds_next = _ds_tile(dbias, b, tl.minimum(h + 1, HQ - 1), rows, cols, HQ, L, scale)
            (ds,) = _in_pair_dtype((ds,), PAIR_DT)
            q_plane = _plane_ptr(qpair, b, h, HQ, LP, NMP)
            k_plane = _plane_ptr(kpair, b, h // REP, HKV, LP, NMP)
            dq_rows = dq_part + (h * LP + rows).to(tl.int64)[:, None] * (2 * NMP)  # this program's rows
            summed = ()
            for c in tl.static_range(NC):
                m = c * MC + mm
                q1, q2 = _pairs_across(q_plane, rows, m, cols, NMP, True)  # [BM, BN, MC]
                k1, k2 = _pairs_across(k_plane, cols, m, rows, NMP, False)
                q1, q2, k1, k2 = _in_pair_dtype((q1, q2, k1, k2), PAIR_DT)
                # dE/dq = dE (alpha k1 - beta k2, alpha k2 + beta k1): alpha, beta meet the loaded
                # components before the per-head dE (their layout is converted once per key
                # tile, not each head's products once per head).
                u1 = al_h[c] * k1 - be_h[c] * k2
                u2 = al_h[c] * k2 + be_h[c] * k1
                # The sums over the keys cross lanes: in fp32 (fp16 values are shuffled one at a
                # time, unpacked and repacked around each shuffle: more instructions, not fewer).
                dq1 = tl.sum((ds * u1).to(tl.float32), axis=1)
                _add_pairs(dq_rows + m[None, :], dq1, tl.sum((ds * u2).to(tl.float32), axis=1), NMP)
                # dE/d delta = dE ((1 + alpha) S - beta C) = dE (q2 (k1 + u1) - q1 (k2 + u2)).
                term = (ds * (q2 * (k1 + u1) - q1 * (k2 + u2))).to(tl.float32)
                summed = summed + (dds[c] + term,)  # noqa: RUF005
            dds = summed
        # 3. Back through delta = tau tanh(W2 hid + b2) and the hidden layer, recomputed (SWAP:
        #    not CSE'd with the first evaluation, which would keep it live through the head loop).
        s2, pre, sig, hid = _phase_hidden(
            a_i, d_i, a_j, d_j, f_ok, w1t, b1v, clip_kappa, BM, BN, FP, PREC, True
        )
        d_hid = tl.zeros((BM * BN, HP), tl.float32)
        for c in tl.static_range(NC):
            m = c * MC + mm
            m_ok = m < NM
            w_mask = m_ok[:, None] & (hh[None, :] < HID)
            w2c = _w2_rows(w2, m, hh, HID, NM)  # [MC, HP]
            d_out = tl.reshape(dds[c], (BM * BN, MC)) * tau_max * (1.0 - ts[c] * ts[c])  # [BM*BN, MC]
            dw2_c = tl.dot(tl.trans(d_out), hid, input_precision=PREC)  # [MC, HP]
            w2_slot = dw2 + slot * NM * HID + m[:, None] * HID + hh[None, :]
            tl.atomic_add(w2_slot, dw2_c, mask=w_mask, sem="relaxed")  # only this program's slot
            tl.atomic_add(db2 + slot * NM + m, tl.sum(d_out, axis=0), mask=m_ok, sem="relaxed")
            d_hid += tl.dot(d_out, w2c, input_precision=PREC)  # [BM*BN, HP]
        d_pre = d_hid * sig * (1.0 + pre * (1.0 - sig))
        dw1_acc += tl.dot(tl.trans(d_pre), s2, input_precision=PREC)  # [HP, FP]
        db1_acc += tl.sum(d_pre, axis=0)
    w1_mask = (hh[:, None] < HID) & f_ok[None, :]
    tl.store(dw1 + slot * HID * F + hh[:, None] * F + f[None, :], dw1_acc, mask=w1_mask)
    tl.store(db1 + slot * HID + hh, db1_acc, mask=hh < HID)


@triton.jit
def pair_bias_bwd_k_kernel(
    a_ptr,
    d_ptr,
    w1,
    b1,
    w2,
    b2,
    qpair,
    dbias,
    dkpair,
    L,
    LP,
    HQ,
    HKV,
    F,
    HID,
    NM,
    scale,
    tau_max,
    clip_kappa,
    SPLIT_TILES,
    REP: tl.constexpr,
    FP: tl.constexpr,
    HP: tl.constexpr,
    MC: tl.constexpr,
    NC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    POLY: tl.constexpr,
    PAIR_DT: tl.constexpr = tl.float32,
):
    """For one key tile, over the SPLIT_TILES row tiles of its split (the last split's may be
    fewer): the key pair gradient of every KV head, P^T z_q summed over those rows and the REP
    query heads that read it, added to this program's keys in the split's partial dkpair.

    alpha, beta come from the MLP with the forward's operand order (rows first): the forward's
    bit-identical values. The tiles are rows first too, and their rows lie across the warps, so
    each KV head's sum over the rows goes through shared memory (keys first was tried: Triton
    then split the warps over both axes, with more barriers)."""
    NMP: tl.constexpr = NC * MC
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    split = tl.program_id(1)
    b = tl.program_id(2)
    part = split * tl.num_programs(2) + b  # [S, B] -> S * B: this split's part of dkpair
    dk_part = dkpair + part.to(tl.int64) * HKV * LP * (2 * NMP)  # [Hkv, LP, 2 NMP]
    row_start = split * SPLIT_TILES * BM
    row_end = tl.minimum(row_start + SPLIT_TILES * BM, L)
    f = tl.arange(0, FP)
    f_ok = f < F
    mm = tl.arange(0, MC)
    a_j, d_j = _tile_features(a_ptr, d_ptr, b, cols, f, L, F, f_ok)
    w1t, b1v = _load_w1(w1, b1, F, HID, FP, HP)
    for start in range(row_start, row_end, BM):
        rows = start + tl.arange(0, BM)
        a_i, d_i = _tile_features(a_ptr, d_ptr, b, rows, f, L, F, f_ok)
        _, alphas, betas = _tile_phases(
            a_i, d_i, a_j, d_j, f_ok, w1t, b1v, w2, b2, clip_kappa, tau_max, HID, NM,
            BM, BN, FP, HP, MC, NC, PREC, POLY,
        )  # fmt: skip
        ds_next = _ds_tile(dbias, b, 0, rows, cols, HQ, L, scale)
        al_h = _in_pair_dtype(alphas, PAIR_DT)  # fp16 (half_pairs): the per-head products in fp16,
        be_h = _in_pair_dtype(betas, PAIR_DT)  # the sums over query heads and rows in fp32
        for kv in range(HKV):
            dk_rows = dk_part + (kv * LP + cols).to(tl.int64)[:, None] * (2 * NMP)  # this program's keys
            acc1 = _chunk_zeros(BM, BN, MC, NC)
            acc2 = _chunk_zeros(BM, BN, MC, NC)
            for r in range(REP):
                h = kv * REP + r
                # The next query head's dBias tile requested first (prefetch, as the query side);
                # each head's tile is loaded once for all pair chunks.
                ds = ds_next[:, :, None]  # [BM, BN, 1]
                ds_next = _ds_tile(dbias, b, tl.minimum(h + 1, HQ - 1), rows, cols, HQ, L, scale)
                (ds,) = _in_pair_dtype((ds,), PAIR_DT)
                q_plane = _plane_ptr(qpair, b, h, HQ, LP, NMP)
                new1 = ()
                new2 = ()
                for c in tl.static_range(NC):
                    q1, q2 = _pairs_across(q_plane, rows, c * MC + mm, cols, NMP, True)  # [BM, BN, MC]
                    q1, q2 = _in_pair_dtype((q1, q2), PAIR_DT)
                    # (alpha q1 + beta q2, alpha q2 - beta q1) first, then dE: alpha, beta meet the
                    # loaded components before the per-head dE (their layout is converted once
                    # per row tile, not each head's products once per head).
                    new1 = new1 + (acc1[c] + (ds * (al_h[c] * q1 + be_h[c] * q2)).to(tl.float32),)  # noqa: RUF005
                    new2 = new2 + (acc2[c] + (ds * (al_h[c] * q2 - be_h[c] * q1)).to(tl.float32),)  # noqa: RUF005
                acc1 = new1
                acc2 = new2
            for c in tl.static_range(NC):
                dk_row = dk_rows + (c * MC + mm)[None, :]
                dk1 = tl.sum(acc1[c], axis=0).to(tl.float32)  # [BN, MC]
                _add_pairs(dk_row, dk1, tl.sum(acc2[c], axis=0).to(tl.float32), NMP)
