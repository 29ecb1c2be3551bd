"""Test hooks of the training loop, passed in by the caller: production runs pass nothing.

The fault tests (tests/dist) start their runs through a worker that builds a ``Faults`` and hands it
to the launcher's ``main``; nothing here is read from the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Faults:
    """``nan_updates``: update indices (0-based) whose loss is made NaN on every rank.
    ``kill_in_save``: the update at whose save rank 0 SIGKILLs itself after every rank's files are
    written and flushed, before the checkpoint is marked complete.
    ``pause_in_save``: the update at whose save rank 0 waits ``pause_s`` at that same point, so a
    test can kill the whole job from outside while the save is under way.
    ``probe_logits``: after training, rank 0 saves the engine's logits on the first examples there
    (export parity).
    ``stop_in_update``: the update (0-based) during which every rank requests a stop, as a SIGTERM
    would (exit 143)."""

    nan_updates: frozenset[int] = field(default_factory=frozenset)
    kill_in_save: int | None = None
    pause_in_save: int | None = None
    pause_s: float = 60.0
    probe_logits: Path | None = None
    stop_in_update: int | None = None


NO_FAULTS = Faults()
