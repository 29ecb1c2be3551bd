"""Collectives on host (CPU) tensors and the data-setup barrier, on any training backend.

Why this module exists: a GPU run's default process group is NCCL, which carries CUDA tensors only;
an ``all_reduce`` of a CPU tensor on it raises "No backend type associated with device type cpu".
Our own collectives are on small host tensors (the per-update loss/token sums, the data
fingerprints), so every one of them goes through here instead of ``torch.distributed`` directly.

Choice: two dedicated **gloo groups** over all ranks, rather than copying the tensor to the GPU and
back:

- ``host``: this module's collectives during training, with the run's collective timeout
  (``train.dist_timeout_min``);
- ``setup``: the barrier that waits while each node's first rank builds the data (tokenising a
  large corpus can take far longer than a training collective should be allowed to hang) and the
  data fingerprint check, with its own timeout (``train.setup_timeout_min``). A process group's
  timeout is fixed when it is created, so a separate group is how a wait gets another one.

gloo needs no device, no ``torch.cuda.set_device`` and no host/device synchronisation, carries
float64 (as NCCL would), and the CPU test runs (whose default group is gloo too) exercise exactly
the code path of a GPU run. Multi-node: gloo connects through the interface the host name resolves
to; set ``GLOO_SOCKET_IFNAME`` if that is not the one the nodes reach each other on.

``engine.distributed_session`` creates both groups right after the default one (``init``); code
that joins a process group another way gets them created on first use (every rank reaches a
collective, so every rank creates them in the same order) with torch's default timeout.
DeepSpeed's own collectives are on device tensors and keep using the default group.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

_groups: dict[str, dist.ProcessGroup] = {}
_timeouts: dict[str, timedelta] = {}


def init(timeout_min: float, setup_timeout_min: float) -> None:
    """Create the gloo ``host`` and ``setup`` groups (collective: every rank calls it, right after
    the default process group is initialised)."""
    reset()
    _timeouts["host"] = timedelta(minutes=timeout_min)
    _timeouts["setup"] = timedelta(minutes=setup_timeout_min)
    for kind in ("host", "setup"):
        _group(kind)


def reset() -> None:
    """Forget the groups (the default process group was or is about to be destroyed)."""
    _groups.clear()
    _timeouts.clear()


def _group(kind: str) -> dist.ProcessGroup:
    if kind not in _groups:
        timeout = _timeouts.get(kind, dist.default_pg_timeout)
        _groups[kind] = dist.new_group(backend="gloo", timeout=timeout)
    return _groups[kind]


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def local_rank() -> int:
    """This process's rank on its node (the launcher's LOCAL_RANK; the global rank without one)."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum ``values`` over the ranks in float64 (the loss, token and bucket sums of one update)."""
    tensor = torch.tensor(values, dtype=torch.float64)  # [n], host
    if _active():
        dist.all_reduce(tensor, group=_group("host"))
    return tensor.tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    """Elementwise maximum of ``values`` over the ranks (float64, host)."""
    tensor = torch.tensor(values, dtype=torch.float64)  # [n], host
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_group("host"))
    return tensor.tolist()


def all_gather(tensor: torch.Tensor, *, setup: bool = False) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape and dtype on all ranks), in rank order.

    A host tensor goes over gloo (the ``setup`` group's timeout when ``setup``); a device tensor
    over the default group (NCCL on a GPU run), so callers need not know which they hold.
    """
    if not _active():
        return [tensor]
    parts = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    group = _group("setup" if setup else "host") if tensor.device.type == "cpu" else None
    dist.all_gather(parts, tensor, group=group)
    return parts


def all_gather_object(obj, *, setup: bool = False) -> list:
    """Every rank's picklable ``obj``, in rank order, over gloo (``setup``: the setup group's
    timeout, for waits on downloads and data preparation)."""
    if not _active():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_group("setup" if setup else "host"))
    return out


def setup_barrier(what: str) -> None:
    """Wait for every rank on the ``setup`` group (timeout ``train.setup_timeout_min``).

    ``what`` names the step waited for, in the error raised when a rank does not arrive in time.
    """
    if not _active():
        return
    group = _group("setup")
    start = time.monotonic()
    try:
        dist.barrier(group=group)
    except RuntimeError as err:
        limit = _timeouts.get("setup", dist.default_pg_timeout).total_seconds()
        waited = time.monotonic() - start
        if waited < 0.9 * limit:  # not a timeout: another rank's process ended (its error is above)
            raise RuntimeError(
                f"rank {dist.get_rank()}: another rank stopped during {what} after {waited:.0f} s "
                f"(its own error, printed above or in its log, says why): {err}"
            ) from err
        raise RuntimeError(
            f"rank {dist.get_rank()}: not every rank finished {what} within {limit / 60:g} min "
            f"(train.setup_timeout_min); raise it for a large dataset, or look for a rank that "
            f"failed above: {err}"
        ) from err
