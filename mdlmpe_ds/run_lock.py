"""One run per output_dir: a lock file held by rank 0 for the run's life.

Two runs writing into one output_dir overwrite each other's checkpoints and history, and the start
of one (``checkpoint.recover_interrupted``) deletes the other's ``step_N.saving`` directory. Rank 0
creates ``output_dir/RUN_LOCK`` with O_EXCL before it touches anything there, holding the host,
pid, process start time and start date, and refreshes its mtime every ``HEARTBEAT_S`` seconds
from a thread. A second run refuses, naming the holder. A lock is stale, and is taken over with a
warning, when its process is gone from this host (pid dead, or reused by another process: its
start time differs) or, from another host, when its heartbeat is older than ``STALE_AFTER_S``
(a run killed with SIGKILL on another node), or when an earlier attempt of this same scheduler
job wrote it (``job_attempt``: a requeued job). The lock is removed when the run ends. Every rank
reads it back at start (``runs.common.check_output_dir_shared``): a multi-node output_dir must be
one directory for all nodes.
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


#: (job id, restart count) variables of the schedulers whose restarts keep the job's identity:
#: Slurm's requeue keeps SLURM_JOB_ID and counts SLURM_RESTART_COUNT; torchrun's elastic restarts
#: keep TORCHELASTIC_RUN_ID (an explicit --rdzv-id; "none" is the static default, not an identity).
_JOB_ENV = (("SLURM_JOB_ID", "SLURM_RESTART_COUNT"), ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"))


def job_attempt() -> dict:
    """{"job": "NAME=ID", "attempt": restart count} of the scheduler job this process belongs to,
    or {} outside one. Recorded in the lock: a restarted job recognises its own earlier attempt."""
    for job_env, count_env in _JOB_ENV:
        job = os.environ.get(job_env, "")
        if job and job != "none":
            count = os.environ.get(count_env, "0")
            return {"job": f"{job_env}={job}", "attempt": int(count) if count.isdigit() else 0}
    return {}


def stale_reason(lock: Path, info: dict) -> str | None:
    """Why the lock described by ``info`` is stale, or None while its run may be alive.

    Besides a dead pid on this host or a heartbeat older than STALE_AFTER_S elsewhere: a lock held
    by an earlier attempt of this same scheduler job (``job_attempt``). A scheduler starts a job
    again only after it has ended the earlier attempt, possibly on another node, and possibly
    SIGKILLed (the lock left with a fresh heartbeat): without this rule the requeued job would be
    refused for up to STALE_AFTER_S, and a requeue chain would stop there."""
    mine = job_attempt()
    if mine and info.get("job") == mine["job"] and int(info.get("attempt", 0)) < mine["attempt"]:
        return (
            f"{_holder(info)} was attempt {info.get('attempt', 0)} of this job ({mine['job']}), which "
            f"ended before this attempt {mine['attempt']} started"
        )
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
        **job_attempt(),
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
