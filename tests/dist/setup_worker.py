"""torchrun worker of test_host_collectives.py: ``rank_zero_first`` with a 3 s collective timeout
and a 2 min setup timeout (3 s in mode ``late``, where rank 0 builds for 8 s and the others must
fail with a message naming the setting; in mode ``fails``, rank 0's build raises after 1 s and the
others must say that a rank stopped, not that the setup timed out). Usage: setup_worker.py
node|two_nodes|late|fails DIR."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mdlmpe_ds.distributed import collectives
from mdlmpe_ds.distributed import engine as eng
from mdlmpe_ds.distributed import process_group
from mdlmpe_ds.runs.common import rank_zero_first


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "two_nodes":
        os.environ["LOCAL_RANK"] = "0"  # each rank the first (only) rank of its own node
    with eng.distributed_session(timeout_min=0.05, setup_timeout_min=0.05 if mode == "late" else 2.0):
        rank = process_group.rank()

        def build() -> int:
            (root / f"start-{rank}").touch()
            if mode == "fails" and rank == 0:
                time.sleep(1.0)
                raise ValueError("SFT token cache x.npz is unreadable (rank 0's own error)")
            if mode in ("node", "late"):
                if rank == 0:
                    time.sleep(8.0)  # longer than the 3 s collective timeout
                else:
                    assert (root / "done-0").exists(), "rank 1 built before its node's rank 0 finished"
            else:
                deadline = time.monotonic() + 60
                while not (root / f"start-{1 - rank}").exists():
                    if time.monotonic() > deadline:
                        raise AssertionError(f"rank {rank}: the other node's first rank never started")
                    time.sleep(0.1)
            (root / f"done-{rank}").touch()
            return rank

        assert rank_zero_first(build) == rank
        # Training collectives still work (and on the short timeout) after the long setup wait.
        assert collectives.all_reduce_sum([1.0, float(rank)]) == [2.0, 1.0]
    process_group.exit_after_teardown(0)


if __name__ == "__main__":
    main()
