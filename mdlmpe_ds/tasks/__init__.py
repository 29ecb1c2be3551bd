"""Training tasks: what one kind of run feeds the loop (``mdlmpe_ds/training/trainer.py``).

A task owns its data order (a sampler whose state a checkpoint stores), its corruption draw and its
loss; the trainer owns everything else (head schedule, accumulation, DeepSpeed steps, metrics,
checkpoints, resume). ``sft.SFTTask``: chat examples, response-token corruption keyed by (seed,
rank, micro-step). ``pretrain.PretrainTask``: packed windows, corruption keyed by (seed, window,
epoch), and a validation perplexity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import torch

from mdlmpe_ds.diffusion.losses import LossStats


class Micro(NamedTuple):
    """One micro-batch's result: ``loss`` (scalar, differentiable), its detached ``stats``, and the
    non-padding ``tokens`` and ``samples`` it held (this rank)."""

    loss: torch.Tensor
    stats: LossStats
    tokens: int
    samples: int


class Task(Protocol):
    """What the trainer calls. ``sampler`` has ``state_dict`` / ``load_state_dict`` (the data
    position a checkpoint stores)."""

    sampler: Any
    # True after periodic_metrics abandoned an evaluation because a stop was requested (every rank
    # agrees): the trainer then saves at once instead of training one more update.
    evaluation_stopped: bool

    def batches(self) -> Iterator[dict]:
        """This rank's micro-batches forever (the sampler moves to the next epoch by itself)."""
        ...

    def micro(self, engine, batch: dict, micro_step: int, rank: int) -> Micro:
        """Corrupt ``batch``, run the engine's forward on it and return the loss (no backward)."""
        ...

    def periodic_metrics(
        self, engine, step: int, total_updates: int, say: Callable[[str], None]
    ) -> dict[str, float]:
        """Extra scalars after update ``step`` (validation); called on every rank (collective-safe)."""
        ...


def engine_device(engine) -> torch.device:
    """The device a batch goes to: the DeepSpeed engine's, or a bare module's parameters' (tests)."""
    device = getattr(engine, "device", None)
    if device is not None:
        return torch.device(device)
    return next(engine.parameters()).device
