"""The launch plan of one fused Triton MDLMPE attention call: the kernels' static parameters, how the
transient pair buffers (alpha, beta, dE/d delta; the only O(L^2) memory) are split into launches
under a byte budget, and the phase-kernel launch that fills them.

Apart from the autograd Function (backend.py) because the plan is arithmetic over shapes and
launch settings that the memory plan (training/activation_bytes.py: ``pair_buffer_bytes``) and the
shape tests read without running a kernel; the kernels module is imported only when a launch
happens (triton picks interpreter or compiler when it decorates, so ``TRITON_INTERPRET`` must be
settled first).
"""

from __future__ import annotations

import math
import os

import torch

from mdlmpe_ds.attention.triton.launch import (
    LaunchConfig,
    kernel_constexprs,
    kernel_options,
    padded_length,
    pair_padding,
    phase_key_span,
)
from mdlmpe_ds.pe.phase import mdlmpe_pairs

# Launch settings (tile, heads per program, pair chunk, warps, stages, registers) come from
# triton.launch.launch_config(d_h, dtype, GPU capability) unless given explicitly.
# Largest tile edge accepted on a GPU: the [G, BM, BN] score tiles and [G, tile, d_h] accumulators
# live in registers (64 fits sm_90's with G <= 2, see triton.launch).
MAX_GPU_TILE = 64
#: Default bound on the per-launch pair buffers (alpha, beta, ddelta: [chunk, |M|, L, L] fp32 each;
#: ``AttentionImpl.pair_buffer_gib``): whole sequences while they fit, else row blocks of one.
PAIR_BUFFER_BYTES = 6 * 2**30


def interpreting() -> bool:
    """Whether triton runs in its CPU interpreter (``TRITON_INTERPRET=1``, tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pair_launches(
    batch: int, padded: int, num_mdlmpe: int, step: int, budget: int = PAIR_BUFFER_BYTES
) -> tuple[int, int]:
    """(sequences, rows) per launch of the pair buffers: alpha, beta and dE/d delta, three
    [sequences, |M|, rows, LP] fp32 tensors, kept under ``budget`` bytes. Whole sequences while
    one fits; else one sequence in blocks of rows, a multiple of ``step`` (at least one step)."""
    row_bytes = 3 * 4 * num_mdlmpe * padded
    if row_bytes * padded <= budget:
        return max(1, min(batch, budget // (row_bytes * padded))), padded
    return 1, max(step, budget // row_bytes // step * step)


def pair_buffer_bytes(
    batch: int, length: int, num_mdlmpe: int, budget: int = PAIR_BUFFER_BYTES, step: int = MAX_GPU_TILE
) -> int:
    """Peak bytes of the pair buffers during one call's backward (``pair_launches``), with L padded
    to a multiple of ``step`` (the largest tile by default: an upper bound for any launch setting)."""
    padded = padded_length(length, step)
    sequences, rows = pair_launches(batch, padded, num_mdlmpe, step, budget)
    return 3 * 4 * num_mdlmpe * sequences * rows * padded


class Plan:
    """Static launch parameters shared by the four kernels of one call."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        w1: torch.Tensor,
        config: LaunchConfig,
        tau_max: float,
        budget: int = PAIR_BUFFER_BYTES,
    ) -> None:
        batch, self.num_heads, self.length, self.head_dim = q.shape
        self.num_kv = k.shape[1]
        self.num_pairs = self.head_dim // 2
        self.hidden = w1.shape[0]
        self.pairs = mdlmpe_pairs(self.num_pairs).to(q.device)
        self.num_mdlmpe = len(self.pairs)
        metas = kernel_constexprs(
            num_heads=self.num_heads,
            num_kv=self.num_kv,
            head_dim=self.head_dim,
            hidden=self.hidden,
            num_mdlmpe=self.num_mdlmpe,
            dtype=q.dtype,
            config=config,
            interpreting=interpreting(),
            tau_max=tau_max,
        )
        self.meta = {name: {**meta, **kernel_options(name, config)} for name, meta in metas.items()}
        self.group = metas["forward"]["G"]
        self.head_tiles = math.ceil(self.length / config.tile)
        step = pair_padding(config)
        self.padded = padded_length(self.length, step)
        self.phase_tile = config.phase_tile
        self.head_tile = config.tile
        self.key_span = phase_key_span(self.padded, config)
        # Key spans per row tile: ceil, so the last span (shorter when LP is not a multiple of the
        # span; the kernels clamp it to LP) is launched too.
        self.key_spans = math.ceil(self.padded / self.key_span)
        # The pair buffers (alpha, beta; in backward also ddelta) are [chunk, NM, RB, LP] fp32 for
        # a chunk of sequences and a block of RB rows; both are chosen to keep the three under
        # ``budget`` bytes: whole sequences while one fits, else one sequence in row blocks.
        self.batch_chunk, self.row_block = pair_launches(batch, self.padded, self.num_mdlmpe, step, budget)

    def blocks(self, batch: int):
        """(first sequence, end sequence, first row, rows in the buffer) of every launch group."""
        for s in range(0, batch, self.batch_chunk):
            e = min(s + self.batch_chunk, batch)
            for r0 in range(0, self.length, self.row_block):
                yield s, e, r0, min(self.row_block, self.padded - r0)

    def pair_buffer(self, batch: int, rows: int, device: torch.device, zero: bool = False) -> torch.Tensor:
        shape = (batch, self.num_mdlmpe, rows, self.padded)
        make = torch.zeros if zero else torch.empty
        return make(shape, dtype=torch.float32, device=device)

    def pair_components(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, L, d_h] -> the MDLMPE pairs' components [B, H, NM, LP, 2] fp32 (dims 2m+1 and
        F+2m+1 side by side), zero past L."""
        both = torch.stack((x[..., self.pairs], x[..., self.pairs + self.num_pairs]), dim=-1)
        both = both.transpose(2, 3).float()  # [B, H, NM, L, 2]
        return torch.nn.functional.pad(both, (0, 0, 0, self.padded - self.length)).contiguous()

    def phase_grid(self, rows: int, batch: int) -> tuple[int, int, int]:
        """(row tiles, key spans, sequences) of a phase-kernel launch over ``rows`` rows."""
        return (rows // self.phase_tile, self.key_spans, batch)

    def phase_dims(self, r0: int, rows: int) -> tuple[int, ...]:
        symmetric = int(rows == self.padded)  # the whole plane in one launch (r0 = 0)
        dims = (self.length, self.padded, r0, rows, self.key_span, symmetric)
        return (*dims, self.num_pairs, self.hidden, self.num_mdlmpe)

    def alpha_beta(self, A, D, w1, b1, w2, b2, tau_max, clip_kappa, r0: int, rows: int):
        """alpha, beta [B, NM, rows, LP] of rows r0 .. r0 + rows - 1 (``phase_fwd_kernel``)."""
        from mdlmpe_ds.attention.triton import kernels as kern

        batch = A.shape[0]
        alpha = self.pair_buffer(batch, rows, A.device)
        beta = self.pair_buffer(batch, rows, A.device)
        kern.phase_fwd_kernel[self.phase_grid(rows, batch)](
            A,
            D,
            w1,
            b1,
            w2,
            b2,
            alpha,
            beta,
            *self.phase_dims(r0, rows),
            tau_max,
            clip_kappa,
            **self.meta["phase_forward"],
        )
        return alpha, beta

    def head_dims(self, r0: int, rows: int) -> tuple[int, ...]:
        return (self.length, self.padded, r0, rows, self.num_heads, self.num_kv, self.num_mdlmpe)


__all__ = ["MAX_GPU_TILE", "PAIR_BUFFER_BYTES", "Plan", "interpreting", "pair_buffer_bytes", "pair_launches"]
