"""One run per output_dir: a lock file held by rank 0 for the run's life.

Two runs writing into one output_dir overwrite each other's checkpoints and history, and the start
of one (``checkpoint.recover_interrupted``) deletes the other's ``step_N.saving`` directory. Rank 0
creates ``output_dir/RUN_LOCK`` with O_EXCL before it touches anything there, holding the host,
pid, process start time and start date, and refreshes its mtime every ``HEARTBEAT_S`` seconds
from a thread. A second run refuses, naming the holder. A lock is stale, and is taken over with a
warning, when its process is gone from this host (pid dead, or reused by another process: its
start time differs) or, from another host, when its heartbeat is older than ``STALE_AFTER_S``
(a run killed with SIGKILL on another node). The lock is removed when the run ends.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

LOCK = "RUN_LOCK"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0

_held: tuple[Path, threading.Event] | None = None


class RunDirectoryInUse(RuntimeError):
    """Another live run holds the output_dir's lock."""


def _start_ticks(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0; a process of another user counts).
    Shared by every owner file that names a pid: this lock, export staging, token-store builds."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _alive(pid: int, ticks: int | None) -> bool:
    if not pid_alive(pid):
        return False
    now = _start_ticks(pid)
    return ticks is None or now is None or now == ticks


def _holder(info: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info.get('pid')} on host {info.get('host')} (started {started})"


def stale_reason(lock: Path, info: dict) -> str | None:
    """Why the lock described by ``info`` is stale, or None while its run may be alive."""
    if info.get("host") == socket.gethostname():
        if not _alive(int(info.get("pid", -1)), info.get("ticks")):
            return f"{_holder(info)} is no longer running"
        return None
    age = time.time() - lock.stat().st_mtime
    if age > STALE_AFTER_S:
        return f"{_holder(info)} has not refreshed it for {age:.0f} s"
    return None


def acquire(output_dir: str | Path, log=print) -> Path:
    """Take ``output_dir``'s lock for this process (rank 0), or raise RunDirectoryInUse naming the
    holder. A stale lock is taken over (reported through ``log``)."""
    global _held
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock = out / LOCK
    info = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "ticks": _start_ticks(os.getpid()),
        "started": time.time(),
    }
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                theirs = json.loads(lock.read_text())
            except (OSError, ValueError):
                theirs = {}
            if theirs.get("pid") == os.getpid() and theirs.get("host") == info["host"]:
                return lock  # this process holds it already
            reason = stale_reason(lock, theirs) if theirs else "it is unreadable"
            if reason is None:
                raise RunDirectoryInUse(
                    f"{out} is in use by another run: {_holder(theirs)} holds {lock}. Wait for it to "
                    f"finish, pick another --output_dir, or, if that run is gone, delete {lock}"
                ) from None
            log(f"warning: taking over the stale lock {lock}: {reason}")
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as fh:
            json.dump(info, fh)
        stop = threading.Event()
        threading.Thread(target=_heartbeat, args=(lock, stop), name="run-lock", daemon=True).start()
        _held = (lock, stop)
        return lock
    raise RunDirectoryInUse(f"{lock}: could not take the lock (another run keeps creating it)")


def _heartbeat(lock: Path, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            os.utime(lock)
        except OSError:
            return


def read(output_dir: str | Path) -> str | None:
    """The lock's text as this process sees it in ``output_dir`` (None: no lock there). The
    directory is listed first: on NFS a listing refreshes the client's cached view of it, so a file
    another node has just created is found."""
    out = Path(output_dir)
    try:
        os.listdir(out)
        return (out / LOCK).read_text()
    except OSError:
        return None


def release() -> None:
    """Remove the lock this process holds (no-op when it holds none)."""
    global _held
    if _held is None:
        return
    lock, stop = _held
    _held = None
    stop.set()
    try:
        if json.loads(lock.read_text()).get("pid") == os.getpid():
            lock.unlink()
    except (OSError, ValueError):
        pass
