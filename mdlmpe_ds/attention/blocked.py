"""Blocked MDLMPE attention: the PyTorch training path (paper Appendix D).

Same signature and numbers as :func:`mdlmpe_ds.attention.reference.reference_attention`, but the
L x L x F pair tensor is never formed. The logit is written as RoPE plus a correction (Eq. (7) expanded):

    S_ij = (q_i . k_j + E_ij) / sqrt(d_h),
    E_ij = sum_{f in M} alpha_ijf (q1 k1 + q2 k2)_f + beta_ijf (q2 k1 - q1 k2)_f,
    alpha = cos(delta) - 1 = -2 sin^2(delta / 2),  beta = sin(delta),

which is q^T R(delta) k with R(delta) = [[cos, -sin], [sin, cos]] on the pair (dim f, dim f + F).
The plain term stays one matmul over all of d_h; only E needs the pair phases delta_ij (Eq. (26)). Queries run
in blocks of C rows, each one :class:`~mdlmpe_ds.attention.blocked_math. BlockAttention` (its maths and
backward live in :mod:`mdlmpe_ds.attention.blocked_math`): a block keeps only its output and log-sum-exp for
backward and recomputes the rest, so the extra live memory is O(C L F) instead of O(L^2 F). Inactive heads
never enter the pair path; they are plain RoPE SDPA over the whole sequence.

``compile=True`` runs the same pieces through torch.compile. Graphs are specialised on shapes
(``dynamic=False``): each distinct (B, active heads, L) compiles once per piece (every block of a
sequence has one shape, see :func:`_block_starts`), up to ``blocked_math.GRAPH_BUDGET`` shapes,
so keep sequence widths to a few buckets (SFT: ``data.pad_to_multiple_of``). Eager blocks on the
CPU are capped at the rows whose [rows, width, L] fp32 tensors fit the per-core L2 cache
(:func:`eager_block_rows`; C is then an upper bound): there every elementwise pass runs from L2.

The pair path and the scores run in fp32 whatever the dtype of q, k, v (an all-bf16 pair path
loses about a tenth of the correction); the output is cast back to q's dtype.
"""

from __future__ import annotations

import math

import torch

from mdlmpe_ds.attention.blocked_math import EAGER, block_attention, compiled_pieces
from mdlmpe_ds.attention.common import check_inputs, key_padding_bias, rope_attention
from mdlmpe_ds.pe.phase import PhaseParams, mdlmpe_pairs

#: Bytes of the widest fp32 tensor of one eager block ([B, rows, width, L], see _cache_rows): its
#: elementwise passes then run from the per-core L2 cache instead of L3 / memory (2 MiB of L2 on
#: the CPUs this was tuned on).
EAGER_SLICE_BYTES = 2 << 20


def _cache_rows(batch: int, width: int, length: int) -> int:
    """Query rows per eager block, so a [batch, rows, width, L] fp32 tensor is about
    EAGER_SLICE_BYTES; ``width`` is the widest per-pair feature axis (F, the phase MLP's hidden
    size, 2|M| or the heads). At least 8 rows, so per-op overhead stays small next to the work."""
    return max(8, EAGER_SLICE_BYTES // (4 * batch * max(width, 1) * length))


def caps_block_rows(device: torch.device | str) -> bool:
    """Whether eager blocks are capped at a cache-sized slice on ``device``: on the CPU only (on a
    GPU every op is a kernel launch, so more blocks cost launches, not cache misses)."""
    return torch.device(device).type == "cpu"


def eager_block_rows(
    block_size: int,
    batch: int,
    length: int,
    num_pairs: int,
    hidden_width: int,
    num_heads: int,
    device: torch.device | str = "cpu",
) -> int:
    """Query rows per eager block on ``device``: on the CPU, ``block_size`` capped at the
    cache-sized slice of :func:`_cache_rows`, whose width is the widest per-pair axis of the block
    (F, the phase MLP's hidden size, 2|M|, or the ``num_heads`` query heads on the pair path);
    elsewhere ``block_size``."""
    if not caps_block_rows(device):
        return block_size
    width = max(num_pairs, hidden_width, 2 * len(mdlmpe_pairs(num_pairs)), num_heads)
    return min(block_size, _cache_rows(batch, width, length))


def _block_starts(length: int, block_size: int, aligned: bool) -> list[tuple[int, int]]:
    """(start, first_new_row) of every query block. ``aligned`` shifts the ragged last block back
    so it ends at L with a full C rows (its overlap with the previous block is dropped): every
    block then has one shape and a compiled piece is traced once per (B, H, L), not twice.
    """
    starts = [(i, i) for i in range(0, length, block_size)]
    if aligned and length > block_size and length % block_size:
        last = starts[-1][1]
        starts[-1] = (length - block_size, last)
    return starts


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    phase: PhaseParams,
    *,
    tau_max: float,
    clip_kappa: float,
    active_kv: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    scale: float | None = None,
    block_size: int = 128,
    compile: bool = False,
) -> torch.Tensor:
    """MDLMPE attention over query blocks of ``block_size`` rows; drop-in for ``reference_attention``.

    q [B, Hq, L, d_h], k/v [B, Hkv, L, d_h] (already RoPE-rotated); A, D [B, L, F] fp32;
    ``active_kv`` [Hkv] bool (None: all heads); ``key_valid`` [B, L] bool. Returns [B, Hq, L, d_h]
    in q's dtype. ``compile`` runs the block pieces through torch.compile (same numbers).
    """
    check_inputs("blocked attention", q, k, v, A, D, phase, active_kv, key_valid, block_size)
    num_heads, head_dim = q.shape[1], q.shape[3]
    num_kv = k.shape[1]
    group = num_heads // num_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if active_kv is None:
        active_kv = torch.ones(num_kv, dtype=torch.bool)
    active_kv = active_kv.detach().to(device="cpu", dtype=torch.bool)
    if not bool(active_kv.any()):
        return rope_attention(q, k, v, key_valid, scale)

    # 1. Split heads: active KV heads (and their query groups) take the pair path.
    kv_on = active_kv.nonzero().flatten().to(q.device)
    q_on = (kv_on.unsqueeze(1) * group + torch.arange(group, device=q.device)).flatten()
    out_on = _pair_path(
        q.index_select(1, q_on),
        k.index_select(1, kv_on),
        v.index_select(1, kv_on),
        A,
        D,
        phase,
        key_valid,
        scale,
        tau_max,
        clip_kappa,
        block_size,
        compile,
    )
    if bool(active_kv.all()):
        return out_on
    # 2. Inactive heads: plain RoPE SDPA over the whole sequence, no pair work at all.
    kv_off = (~active_kv).nonzero().flatten().to(q.device)
    q_off = (kv_off.unsqueeze(1) * group + torch.arange(group, device=q.device)).flatten()
    out_off = rope_attention(
        q.index_select(1, q_off), k.index_select(1, kv_off), v.index_select(1, kv_off), key_valid, scale
    )
    # 3. Put every head back at its own index (out-of-place, so autograd sees it).
    out = torch.cat((out_on, out_off), dim=1)
    inverse = torch.argsort(torch.cat((q_on, q_off)))
    return out.index_select(1, inverse)


def _pair_path(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    phase: PhaseParams,
    key_valid: torch.Tensor | None,
    scale: float,
    tau_max: float,
    clip_kappa: float,
    block_size: int,
    compile: bool,
) -> torch.Tensor:
    """MDLMPE attention for heads that are all active. q [B, Ha*G, L, d_h], k/v [B, Ha, L, d_h]."""
    batch, num_heads, length, head_dim = q.shape
    num_kv = k.shape[1]
    num_pairs = head_dim // 2
    pairs = mdlmpe_pairs(num_pairs).to(q.device)
    # fp32 copies, O(L d_h): the pair path and scores run in fp32 whatever the input dtype.
    qf = q.float().view(batch, num_kv, num_heads // num_kv, length, head_dim)  # [B, Ha, G, L, d_h]
    kf, vf = k.float(), v.float()  # [B, Ha, L, d_h]
    k1t = kf[..., pairs].transpose(-1, -2).contiguous()  # [B, Ha, |M|, L]
    k2t = kf[..., num_pairs + pairs].transpose(-1, -2).contiguous()
    a_cols = A.float().transpose(1, 2).contiguous()  # [B, F, L]
    d_cols = D.float().transpose(1, 2).contiguous()
    weights = tuple(t.float() for t in phase)
    bias = key_padding_bias(key_valid)
    bias = None if bias is None else bias.unsqueeze(1)  # [B, 1, 1, 1, L]
    if compile:
        pieces = compiled_pieces()
    else:
        pieces = EAGER
        hidden_width = phase.w1.shape[0]
        block_size = eager_block_rows(block_size, batch, length, num_pairs, hidden_width, num_heads, q.device)
    outputs = []
    for start, first_new in _block_starts(length, block_size, aligned=compile):
        rows = slice(start, min(start + block_size, length))
        block = block_attention(
            pieces,
            qf[:, :, :, rows],
            kf,
            vf,
            k1t,
            k2t,
            A[:, rows].float(),
            D[:, rows].float(),
            a_cols,
            d_cols,
            *weights,
            bias,
            scale,
            tau_max,
            clip_kappa,
        )
        outputs.append(block[:, :, :, first_new - start :])
    out = torch.cat(outputs, dim=3)  # [B, Ha, G, L, d_h]
    return out.reshape(batch, num_heads, length, head_dim).to(q.dtype)
