"""collectives.py without a process group (one process, dry runs, tools): the helpers are the
identity and never touch torch.distributed. The 2-process behaviour, under NCCL's device rule, is
tests/dist/test_host_collectives.py."""

from __future__ import annotations

import torch

from mdlmpe_ds.distributed import collectives


def test_identity_without_a_process_group():
    assert collectives.all_reduce_sum([1.5, 2.0, 0.1]) == [1.5, 2.0, 0.1]  # float64: 0.1 exact
    mine = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert [t.tolist() for t in collectives.all_gather(mine, setup=True)] == [[3.0, 4.0]]
    collectives.setup_barrier("nothing")  # no group, no wait


def test_local_rank_is_the_launchers(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert collectives.local_rank() == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert collectives.local_rank() == 0  # no launcher, no process group: the only rank
