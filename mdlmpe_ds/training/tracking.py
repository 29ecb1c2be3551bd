"""Rank-0 side effects through one object: TensorBoard scalars, a progress bar and
console lines. Other ranks get `NullTracker`, which has the same methods and does nothing, so the
trainer never branches on the rank to log.

One event stream per run directory: the writer appends to `output_dir/tensorboard/`, and a resumed
run continues the same directory (points are keyed by the optimizer update, so the curves join).
History holds each update once: a run starting at update k (0 for a fresh run) first drops what an
earlier attempt logged after k, from `metrics.jsonl` (rewritten atomically) and from TensorBoard
(`purge_step`), so a run killed after logging update 25 and resumed from update 20 shows 21-25 once.

A full disk or an exceeded quota while the metrics are written is one error (``disk_full_named``)
naming the file, the free space and the checkpoint `--resume auto` continues from: a save commits
by an atomic rename, so the newest complete checkpoint is intact, and the resume drops whatever was
logged after it. ``close()`` then adds nothing over that error: it is the one the run ends with.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mdlmpe_ds.training import checkpoint as ckpt


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

        self.output_dir = Path(output_dir)
        self.log_dir = self.output_dir / "tensorboard"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.log_dir), purge_step=start_update + 1)
        self.metrics_file = self.output_dir / "metrics.jsonl"
        truncate_history(self.metrics_file, start_update)
        self.metrics = open(self.metrics_file, "a")  # noqa: SIM115 (closed in close())
        self.failed = False  # a write failed: close() must not raise again over that error
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
        what = f"the metrics of update {step}"
        with self._writing(what, self.log_dir):
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
        with self._writing(what, self.metrics_file):
            self.metrics.write(json.dumps({"step": step, **values}) + "\n")
            self.metrics.flush()

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(step - self.bar.n)

    def print(self, message: str) -> None:
        self.bar.write(message, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        """Flush and close. The trainer calls this in a ``finally``: after a failed write, or while
        another error is on its way out, a failure here must not raise a second traceback over the
        error to read (``_closing``)."""
        with self._closing(self.log_dir):
            self.writer.flush()
            self.writer.close()
        with self._closing(self.metrics_file):
            self.metrics.close()
        self.bar.close()

    @contextlib.contextmanager
    def _writing(self, what: str, target: Path) -> Iterator[None]:
        """A full disk or an exceeded quota while writing ``target`` becomes one error naming it
        (``disk_full_named``); any other OSError passes unchanged. Either marks the tracker failed."""
        try:
            yield
        except OSError as err:
            self.failed = True
            if err.errno not in ckpt.NO_SPACE_ERRNOS:
                raise
            named = Path(err.filename) if isinstance(err.filename, str) else target
            raise disk_full_named(err, named, what, self.output_dir) from err

    @contextlib.contextmanager
    def _closing(self, target: Path) -> Iterator[None]:
        """``_writing`` the last metrics, unless a write failed already (its error is on its way out:
        a failure here is dropped) or another error is on its way out (a failure here is a note on
        it)."""
        pending = sys.exc_info()[1]
        if not self.failed and pending is None:
            with self._writing("the last metrics", target):
                yield
            return
        try:
            yield
        except OSError as err:
            if pending is not None and not self.failed:
                pending.add_note(f"closing {target} failed as well: {err}")


def disk_full_named(err: OSError, target: Path, what: str, output_dir: Path) -> OSError:
    """The error of a full disk (or quota) while ``what`` was written to ``target``: which file, the
    free space, and the checkpoint `--resume auto` continues from once there is space (the newest
    complete one: a save commits by an atomic rename, so it is intact, and the resume drops the
    metrics logged after it)."""
    last = ckpt.newest_complete(output_dir)
    where, fix = ckpt.no_space_words(err.errno)
    resume = (
        f"the last complete checkpoint {last} is intact, and --resume auto continues from it (the "
        "metrics logged after it are dropped and logged again)"
        if last is not None
        else "no checkpoint was completed yet, so nothing can be resumed: start the run again "
        "(--overwrite_output_dir true replaces what this attempt logged)"
    )
    return OSError(
        err.errno,
        f"{where} while writing {what} to {target} ({ckpt.free_mib(target)} MiB free on its filesystem); "
        f"{fix} under {output_dir} or move --output_dir, then: {resume}",
    )


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
