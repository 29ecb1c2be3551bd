"""The process's stop request: set by a signal handler or the launcher watchdog (lifecycle.py), read
by the training loop and polled by long setup work (tokenising a dataset, building a token store).

A bottom utility (no imports of the package), so the data modules can poll it. During setup
nothing has been trained since the last checkpoint, so a stop there ends the process at once
(``StoppedDuringSetup``, exit 128 + the signal number) instead of tokenising on until the
launcher's SIGKILL; once the loop runs (``set_phase("training")``) a stop finishes the current
update and saves.
"""

from __future__ import annotations

import threading

_reason: str | None = None
_exit_code = 0
_phase = "setup"
_lock = threading.Lock()


class StoppedDuringSetup(RuntimeError):
    """A stop request reached a poll point before training started; ``exit_code`` is 128 + the
    signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def request_stop(reason: str, exit_code: int) -> None:
    """Ask the process to stop (first request wins)."""
    global _reason, _exit_code
    with _lock:
        if _reason is None:
            _reason, _exit_code = reason, exit_code


def stop_reason() -> str | None:
    return _reason


def exit_code() -> int:
    return _exit_code


def phase() -> str:
    return _phase


def set_phase(name: str) -> None:
    """ "setup" until the training loop starts, then "training"."""
    global _phase
    _phase = name


def reset() -> None:
    global _reason, _exit_code, _phase
    with _lock:
        _reason, _exit_code, _phase = None, 0, "setup"


def poll(what: str) -> None:
    """Raise StoppedDuringSetup when a stop was requested during setup; ``what`` names the work."""
    if _reason is not None and _phase == "setup":
        raise StoppedDuringSetup(
            f"stopped while {what} ({_reason}): no update was trained, nothing to save, and nothing in "
            f"output_dir was changed (checkpoints, logs, an --overwrite_output_dir deletion); run the "
            f"same command again",
            _exit_code,
        )
