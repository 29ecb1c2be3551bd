"""The hook points of the training loop (trainer.py) and the two ways a run ends early.

Why callbacks: what a run does besides training -- the MDLMPE head schedule and statistics, LoRA's
checkpoint policy, what a non-finite update means, how a stop signal is answered, the test faults
-- varies by run, and the loop should not know any of it (it imports neither ``lora`` nor ``pe``).
The run hands the loop a list of ``Callback`` objects (callbacks.py ``callbacks_for``); the loop
calls each hook on every callback in list order, on every rank. A hook that runs a collective must
therefore do the same on every rank.

Each hook has a default that does nothing (or lets everything through), so a callback overrides
only the hooks it needs. The checkpoint hooks are called by the checkpointer (checkpointer.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# The loop (trainer.py's Trainer) is above this module, so hooks see it as ``Any``: its ``engine``,
# ``task``, ``state``, ``tracker``, ``checkpointer``, ``total_updates``, ``save()`` are what they use.
Trainer = Any


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite updates, or a run whose last update was non-finite."""


class Stopped(RuntimeError):
    """The run stopped on a signal or a lost launcher after saving a checkpoint; ``exit_code`` is
    128 + the signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Callback:
    """One concern of a run, attached to the loop's hook points (all optional)."""

    # ------------------------------------------------------------ the loop
    def on_start(self, trainer: Trainer) -> None:
        """Before the first update this process runs (a fresh or a resumed run)."""

    def before_update(self, trainer: Trainer, update: int) -> dict[str, float]:
        """Before update ``update`` (0-based) runs; returns scalars of that update known now."""
        return {}

    def micro_loss(self, trainer: Trainer, update: int, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss before its backward (test faults replace it)."""
        return loss

    def after_steps(self, trainer: Trainer, update: int) -> None:
        """After the update's last DeepSpeed step, before the all-reduce that ends the update."""

    def wants_stop(self, trainer: Trainer) -> bool:
        """This rank's vote to stop after this update; the votes ride on the update's all-reduce,
        so every rank sees the same outcome."""
        return False

    def on_metrics(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Extra scalars logged after update ``step`` (1-based count of updates run)."""
        return {}

    def after_update(self, trainer: Trainer, step: int, final: bool) -> None:
        """After update ``step`` is logged; ``final``: the run ends or stops after it. May raise to
        end the run."""

    def can_save(self, trainer: Trainer, step: int) -> bool:
        """Whether a checkpoint may be written after update ``step``; False defers a due save to
        the next update that every callback allows."""
        return True

    def on_stop(self, trainer: Trainer, step: int) -> None:
        """Every rank agreed to stop after update ``step``: save what the run asks for and raise
        ``Stopped``."""

    def on_end(self, trainer: Trainer) -> None:
        """After the last update of a run that ended normally (total updates or train.stop_at)."""

    # ------------------------------------------------------------ the checkpointer
    def save_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments of DeepSpeed's ``save_checkpoint``."""
        return {}

    def load_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments of DeepSpeed's ``load_checkpoint``."""
        return {}

    def on_save_meta(self, staging: Path, module: torch.nn.Module) -> None:
        """Rank 0, while a checkpoint is staged: write this callback's own files into ``staging``."""

    def before_commit(self, step: int) -> None:
        """Rank 0, after every rank's files of checkpoint ``step`` are written and flushed, before it
        is marked complete."""

    def before_resume(self, path: Path, module: torch.nn.Module) -> None:
        """Before DeepSpeed reads checkpoint ``path``: refuse a checkpoint this run cannot continue."""
