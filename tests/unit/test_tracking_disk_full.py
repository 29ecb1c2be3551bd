"""A full disk while the metrics are written (not during a save) ends the run with one error that
names the file, says the disk is full and names the checkpoint --resume auto continues from; the
tracker's close() in the trainer's ``finally`` raises no second traceback over it."""

from __future__ import annotations

import errno

import pytest

from mdlmpe_ds.training import checkpoint as ckpt
from mdlmpe_ds.training.tracking import Tracker


class _FullDisk:
    """metrics.jsonl on a full disk: the buffered write succeeds, the flush (and the close, which
    flushes) fails, as on a filled tmpfs."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        self.flush()


def _complete_checkpoint(output_dir, step: int):
    path = ckpt.step_dir(output_dir, step)
    path.mkdir(parents=True)
    (path / ckpt.COMPLETE).write_text("")
    return path


def _tracker(output_dir) -> Tracker:
    tracker = Tracker(output_dir, total_updates=8, start_update=4)
    tracker.metrics.close()
    tracker.metrics = _FullDisk()
    return tracker


def test_a_full_disk_while_logging_is_one_error_naming_file_and_checkpoint(tmp_path):
    """Was a bare "OSError: [Errno 28] No space left on device" from metrics.flush(), raised a
    second time by close() in the trainer's finally."""
    step4 = _complete_checkpoint(tmp_path, 4)
    tracker = _tracker(tmp_path)
    with pytest.raises(OSError) as err:
        try:  # as Trainer.train does
            tracker.scalars(5, {"train/loss": 1.0})
        finally:
            tracker.close()
    text = str(err.value)
    assert err.value.errno == errno.ENOSPC  # and not close()'s second error about "the last metrics"
    assert (
        f"No space left on device while writing the metrics of update 5 to {tmp_path / 'metrics.jsonl'}"
        in text
    )
    assert f"the last complete checkpoint {step4} is intact, and --resume auto continues from it" in text
    assert "MiB free" in text and not getattr(err.value, "__notes__", None)


def test_close_reports_a_full_disk_itself_and_never_over_another_error(tmp_path):
    tracker = _tracker(tmp_path)  # no checkpoint yet
    with pytest.raises(
        OSError, match=r"while writing the last metrics to .*metrics\.jsonl.*nothing can be resumed"
    ):
        tracker.close()
    other = _tracker(tmp_path / "b")
    with pytest.raises(RuntimeError, match="the save failed") as err:
        try:
            raise RuntimeError("the save failed")
        finally:
            other.close()
    assert "closing" in err.value.__notes__[0] and "metrics.jsonl failed as well" in err.value.__notes__[0]
