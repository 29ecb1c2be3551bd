"""Logging for one process, set once by the entry points (launch/*.py, the run modules' CLIs).

Rank 0 shows INFO and up, the other ranks WARNING and up, so a 2-rank run prints each note once
but every rank's warnings; each line names its rank. Training runs log to stdout beside the
trainer's progress lines (the progress bar is on stderr); tools whose stdout is their result
(generation, evaluation, export) log to stderr. Only the ``mdlmpe_ds`` loggers are configured:
DeepSpeed, transformers and the rest keep their own settings.
"""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


class _StreamHandler(logging.Handler):
    """Writes to whatever ``sys.stdout`` / ``sys.stderr`` is at emit time (a test's capture, a
    redirected stream), not the object that was there when logging was configured."""

    def __init__(self, stream: str) -> None:
        super().__init__()
        self.stream_name = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = getattr(sys, self.stream_name)
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def process_rank() -> int:
    """This process's global rank as the launchers set it (``RANK``; 0 without a launcher)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def configure(rank: int | None = None, stream: str = "stdout", force: bool = False) -> logging.Logger:
    """Configure the ``mdlmpe_ds`` logger once per process (later calls change nothing unless
    ``force``: tests that run several entry points in one process); returns it.
    ``stream``: "stdout" or "stderr"."""
    global _CONFIGURED
    logger = logging.getLogger("mdlmpe_ds")
    if _CONFIGURED and not force:
        return logger
    if stream not in ("stdout", "stderr"):
        raise ValueError(f"stream must be 'stdout' or 'stderr', got {stream!r}")
    rank = process_rank() if rank is None else rank
    handler = _StreamHandler(stream)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    logger.handlers = [handler]
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False  # one line per record, whatever the root logger holds
    _CONFIGURED = True
    return logger
