"""The LM head and cross-entropy on the scored positions only, a chunk of rows at a time.

Why: the training losses only read the logits of the masked (loss) positions, yet a full forward
materialises [B, L, V] logits (V = 126k for LLaDA, 152k for Dream): ~0.25 MB per token in bf16,
plus the fp32 copy and its gradient for the cross-entropy, ~1 MB per token at peak -- more than a
whole 8B layer's activations. Here the final hidden states of the M scored positions are gathered
([M, d]), and the head + fp32 cross-entropy run on ``chunk`` rows at a time, each chunk under
activation checkpointing, so the largest vocabulary-wide tensor alive in forward or backward is
[chunk, V] (bf16 logits, their fp32 copy and gradient) and nothing of size [B, L, V] or [M, V]
exists in training.

ZeRO-3: the head runs as ``lm_head(...)`` (its module forward) for every chunk and again in that
chunk's backward recompute, so DeepSpeed's module hooks gather the partitioned weight each time, as
they do for any module called several times in one forward. Each gather is a collective, so every
rank must call the head the same number of times although its own scored count M differs: the
trainers pass ``num_chunks`` (ceil(max over ranks of M / chunk), one small all-reduce per
micro-batch, computed above the model: ``head_chunks.group_chunk_count``) and a rank with fewer
rows runs its last chunks empty. The model knows no process group and reads no environment: the
chunk and the count are arguments. (Without
it the ranks' all-gathers mismatch: gloo aborts with "Received data size doesn't match".) The head
is called on at least one (possibly empty) chunk, so every parameter gets a gradient even when a
micro-batch has no scored position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mdlmpe_ds.diffusion.losses import ScoredCE  # the losses' input type, produced here

# Rows of the [rows, V] logits block alive at once: 1024 x 126k x (2 B bf16 logits + 3 x 4 B fp32
# copy, log-softmax, gradient) ~ 1.7 GiB at the peak of one chunk's backward on LLaDA-8B (memory_plan).
DEFAULT_CHUNK = 1024


def _head_ce(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 CE of one chunk: hidden [n, d], targets [n] -> [n]."""
    logits = head(hidden)  # [n, V] in the parameter dtype
    return F.cross_entropy(logits.float(), targets, reduction="none")  # [n] fp32


def chunk_count(scored: int, chunk: int) -> int:
    """Chunks of ``chunk`` rows that cover ``scored`` rows; at least 1."""
    return max(1, -(-scored // chunk))


def scored_cross_entropy(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = DEFAULT_CHUNK,
    recompute: bool = True,
    num_chunks: int | None = None,
) -> torch.Tensor:
    """CE of ``head(hidden)`` against ``targets`` in chunks of ``chunk`` rows: hidden [M, d],
    targets [M] -> ce [M] fp32. With ``recompute`` (training) each chunk's logits are recomputed in
    backward instead of being kept, so at most one [chunk, V] block is alive. ``num_chunks`` (at
    least ``chunk_count(M, chunk)``) calls the head that many times, the extra ones on empty chunks,
    so that all ranks of a ZeRO-3 group gather the head weight alike (module docstring)."""
    if chunk < 1:
        raise ValueError(f"scored head chunk must be >= 1 row, got {chunk}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [M, d] and targets [M], got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    needed = chunk_count(hidden.shape[0], chunk)
    if num_chunks is None:
        num_chunks = needed
    elif num_chunks < needed:
        raise ValueError(
            f"{num_chunks} head chunks of {chunk} rows cannot hold {hidden.shape[0]} scored rows"
        )
    pieces = []
    for index in range(num_chunks):  # one (empty) chunk when M = 0
        start = index * chunk
        h, y = hidden[start : start + chunk], targets[start : start + chunk]
        if recompute:
            pieces.append(checkpoint(_head_ce, head, h, y, use_reentrant=False))
        else:
            pieces.append(_head_ce(head, h, y))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def scored_source_columns(cols: torch.Tensor, shift_logits: bool) -> torch.Tensor:
    """Column of the final hidden state whose logit is the ALIGNED logit at ``cols``: Dream's
    aligned logit i is the raw logit max(i - 1, 0) (``cat(l[:, :1], l[:, :-1])``); LLaDA's is i."""
    return (cols - 1).clamp_min(0) if shift_logits else cols


__all__ = [
    "DEFAULT_CHUNK",
    "ScoredCE",
    "chunk_count",
    "scored_cross_entropy",
    "scored_source_columns",
]
