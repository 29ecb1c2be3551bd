"""The process group as plain torch sees it: rank, world size, barrier, a clean exit.

Why a module of its own: the trainer, the checkpointer and the callbacks need to know who they are
and to wait for each other, which is torch.distributed alone; DeepSpeed (``distributed/engine.py``) is needed
only to build and step the engine. Host-tensor collectives on their own gloo groups stay in
``collectives.py`` (a bottom utility the data and config modules already share); the session that
creates the default group stays in ``engine.distributed_session``, because it is DeepSpeed's
``init_distributed`` that must create it (DeepSpeed's communication layer wraps that group).

Everything here also works without a process group (one process): rank 0 of a world of
``$WORLD_SIZE`` (default 1), and barriers that return at once.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist


def on_cpu() -> bool:
    """No CUDA device: the gloo backend and CPU numerics."""
    return not torch.cuda.is_available()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def exit_after_teardown(code: int) -> NoReturn:
    """End a distributed worker process with ``code`` once its process group is torn down.

    gloo can still abort the interpreter's final C++ teardown ("terminate called without an active
    exception", SIGABRT) after a run that succeeded and destroyed its process group; torchrun then
    reports the whole job as failed. Flushing and leaving through ``os._exit`` skips those static
    destructors, so the exit code is the run's own. Call it only after every checkpoint, event file
    and log has been written and closed.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
