"""The LM head's chunking of a training run: rows per chunk (a run-level setting) and the chunk
count every rank runs alike (a collective).

Why here and not in ``models/scored_head.py``: the model runs on one device and knows no process
group and no environment; it receives ``head_chunk`` and ``head_chunks`` from the task that calls
it. The rows per chunk come from ``$MDLMPE_DS_HEAD_CHUNK`` (smaller trades speed for memory;
tests/dist set it small to run several chunks through ZeRO-3's hooks), else the model's
``DEFAULT_CHUNK``; the count is one host all-reduce of a scalar per micro-batch (collectives.py:
not on the NCCL default group).
"""

from __future__ import annotations

import os

import torch

from mdlmpe_ds.distributed import collectives
from mdlmpe_ds.models.scored_head import DEFAULT_CHUNK, chunk_count

CHUNK_ENV = "MDLMPE_DS_HEAD_CHUNK"


def configured_chunk() -> int:
    """``$MDLMPE_DS_HEAD_CHUNK`` rows when set, else ``DEFAULT_CHUNK``."""
    raw = os.environ.get(CHUNK_ENV, "").strip()
    if not raw:
        return DEFAULT_CHUNK
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{CHUNK_ENV}={raw!r}: expected a positive number of rows")
    return int(raw)


def group_chunk_count(scored: torch.Tensor, chunk: int | None = None) -> int:
    """The head's chunk count for this micro-batch on every rank: ``chunk_count`` of the largest
    scored count over the process group (``scored`` [B, L] bool, this rank's loss positions)."""
    (largest,) = collectives.all_reduce_max([float(scored.sum())])
    return chunk_count(int(largest), chunk or configured_chunk())
