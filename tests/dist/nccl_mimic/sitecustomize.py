"""Test-only: the default process group follows NCCL's device rule on a CPU machine.

Put this folder on PYTHONPATH and set ``MDLMPE_DS_TEST_NCCL_MIMIC=1`` (tests/dist/
test_host_collectives.py does, for the torchrun workers); without the variable nothing happens.

NCCL carries CUDA tensors only: a collective on a NCCL group with a CPU tensor raises "No backend
type associated with device type cpu". On a CPU machine every tensor is a CPU tensor, so the mimic
decides by group and caller instead of by device:

- a group is NCCL-like unless it was created with ``new_group(backend="gloo")`` (the default group
  and DeepSpeed's groups are NCCL on a GPU run);
- a tensor collective called from ``mdlmpe_ds`` (our code holds host tensors) on a NCCL-like group
  raises as NCCL would; DeepSpeed's and torch's own calls pass (on a GPU their tensors are on the
  device). ``monitored_barrier`` is gloo-only and raises on a NCCL-like group from any caller.

Every collective of ours that passes is appended to ``$MDLMPE_DS_TEST_NCCL_MIMIC_LOG`` (when set)
as "rank op caller", so a test can see the mimic was active and which calls it checked.
"""

from __future__ import annotations

import os

if os.environ.get("MDLMPE_DS_TEST_NCCL_MIMIC") == "1":
    import functools
    import inspect
    import sys

    import torch
    import torch.distributed as dist

    _GLOO_GROUPS: list = []
    _OURS = ("mdlmpe_ds", "__main__")
    _TENSOR_OPS = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
    )

    def _tensors(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from _tensors(item)

    def _nccl_like(group) -> bool:
        return not any(group is g for g in _GLOO_GROUPS)

    def _log(op: str, caller: str) -> None:
        path = os.environ.get("MDLMPE_DS_TEST_NCCL_MIMIC_LOG")
        if path:
            with open(path, "a") as fh:
                fh.write(f"{os.environ.get('RANK', '?')} {op} {caller}\n")

    def _wrap_collective(name: str, fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def mimic(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            bound = signature.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            ours = caller.startswith(_OURS)
            if _nccl_like(group):
                if name == "monitored_barrier":
                    raise RuntimeError("monitored_barrier is only implemented for GLOO backend (mimic)")
                host = [t for v in bound.arguments.values() for t in _tensors(v) if t.device.type == "cpu"]
                if ours and host:
                    raise RuntimeError(f"No backend type associated with device type cpu ({name}, mimic)")
            if ours:
                _log(name, caller)
            return fn(*args, **kwargs)

        return mimic

    def _wrap_new_group(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def mimic(*args, **kwargs):
            group = fn(*args, **kwargs)
            backend = signature.bind(*args, **kwargs).arguments.get("backend")
            if backend is not None and str(backend).lower() == "gloo":
                _GLOO_GROUPS.append(group)
            return group

        return mimic

    for _name in (*_TENSOR_OPS, "monitored_barrier"):
        setattr(dist, _name, _wrap_collective(_name, getattr(dist, _name)))
    dist.new_group = _wrap_new_group(dist.new_group)
