"""Rank-0 side effects through one object: TensorBoard scalars, a progress bar and
console lines. Other ranks get `NullTracker`, which has the same methods and does nothing, so the
trainer never branches on the rank to log.

One event stream per run directory: the writer appends to `output_dir/tensorboard/`, and a resumed
run continues the same directory (points are keyed by the optimizer update, so the curves join).
History holds each update once: a run starting at update k (0 for a fresh run) first drops what an
earlier attempt logged after k, from `metrics.jsonl` (rewritten atomically) and from TensorBoard
(`purge_step`), so a run killed after logging update 25 and resumed from update 20 shows 21-25 once.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


class NullTracker:
    """The no-op tracker of ranks != 0."""

    log_dir: Path | None = None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        pass

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        pass

    def print(self, message: str) -> None:
        pass

    def close(self) -> None:
        pass


class Tracker(NullTracker):
    """Rank 0: a SummaryWriter under `output_dir/tensorboard`, the same scalars at full precision in
    `output_dir/metrics.jsonl` (one line per update, appended; after a resume the last line of a
    step wins), and a tqdm bar over the updates."""

    def __init__(self, output_dir: str | Path, total_updates: int, start_update: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.log_dir = Path(output_dir) / "tensorboard"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.log_dir), purge_step=start_update + 1)
        metrics_file = Path(output_dir) / "metrics.jsonl"
        truncate_history(metrics_file, start_update)
        self.metrics = open(metrics_file, "a")  # noqa: SIM115 (closed in close())
        self.bar = tqdm(
            total=total_updates,
            initial=start_update,
            desc="train",
            unit="upd",
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=0.5,
        )

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.metrics.write(json.dumps({"step": step, **values}) + "\n")
        self.metrics.flush()

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(step - self.bar.n)

    def print(self, message: str) -> None:
        self.bar.write(message, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
        self.metrics.close()
        self.bar.close()


def truncate_history(metrics_file: Path, last_step: int) -> None:
    """Keep the lines of ``metrics_file`` with step <= ``last_step`` (atomic rewrite). A line cut by a
    kill mid-write is dropped too."""
    if not metrics_file.is_file():
        return
    kept = []
    for line in metrics_file.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step:
            kept.append(line + "\n")
    tmp = metrics_file.with_name(metrics_file.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, metrics_file)


def make_tracker(rank: int, output_dir: str | Path, total_updates: int, start_update: int = 0) -> NullTracker:
    return Tracker(output_dir, total_updates, start_update) if rank == 0 else NullTracker()
