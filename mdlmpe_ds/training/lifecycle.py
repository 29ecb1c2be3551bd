"""How a training process stops when it is told to, or when its launcher is gone.

- **SIGTERM / SIGINT** (a cluster preemption, Ctrl-C, the `deepspeed` launcher terminating its
  children): a signal only sets a stop request. The trainer reads it at the end of the current
  update, inside the all-reduce it already does, so every rank agrees on the same last update; it
  saves there what train.save_on_signal asks for and the process exits with 128 + the signal
  number (143, 130), which `--resume auto` continues from. Before the first update (data setup)
  the request is polled while tokenising and the process stops at once: nothing to save.
  Repeated SIGTERMs are expected (the deepspeed launcher, torchrun and a scheduler each pass one
  on) and change nothing; the launchers escalate to SIGKILL after their own grace period (30 s
  for both, docs/resume.md). A second SIGINT (Ctrl-C twice) stops at once.
- **The launcher died** (`kill -9` of the launcher's process group: torchrun starts its workers in
  sessions of their own, so they survive it and would train on as orphans): a watchdog thread
  notices that one of the Python processes above this one has exited, requests the same stop, and
  ends the process after ``grace_s`` seconds whatever happens (a peer may be gone and the
  checkpoint's collectives never finish).

The state is per process (signal handlers are); it lives in ``stop_request`` (a bottom utility
that the data modules can poll): `install` once in a worker, `stop_reason` from the loop.
``stop_setup_if_asked`` is the setup's last look before it changes anything on disk (the
deletion of --overwrite_output_dir, setting newer checkpoints aside): agreed over the ranks, so
every rank stops there or none does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mdlmpe_ds.distributed import collectives
from mdlmpe_ds.stop_request import StoppedDuringSetup, exit_code, request_stop, reset, stop_reason
from mdlmpe_ds.stop_request import phase as _phase


def _on_signal(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    first = stop_reason() is None
    request_stop(f"received {name}", 128 + signum)
    if signum == signal.SIGINT:
        signal.signal(signum, signal.default_int_handler)  # Ctrl-C again: KeyboardInterrupt now
    if first:
        doing = (
            "stopping the setup (no update trained yet: nothing to save)"
            if _phase() == "setup"
            else "finishing the current update, then saving (train.save_on_signal)"
        )
        print(f"[pid {os.getpid()}] {name}: {doing}", file=sys.stderr, flush=True)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, or None. A zombie (state Z: exited,
    not yet reaped by its parent) or a dead one (X) is not live: a SIGKILLed launcher stays a zombie
    until its own parent reaps it, and the ranks must see it gone at once."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def launcher_processes(pid: int | None = None) -> list[tuple[int, int, str]]:
    """(pid, start time, command) of the launcher chain above ``pid``: the consecutive Python
    ancestors (torchrun, `deepspeed` and its per-node `launcher.launch`, our CPU re-launcher, a test
    runner). The walk stops at the first non-Python ancestor: a shell, sshd, srun or init, which are
    not ours to watch. Empty where /proc does not exist."""
    out = []
    stat = _stat(os.getpid() if pid is None else pid)
    while stat is not None and stat[0] > 1:
        parent = stat[0]
        stat = _stat(parent)
        argv = _cmdline(parent)
        if stat is None or not argv or not Path(argv[0]).name.startswith("python"):
            break
        out.append((parent, stat[1], " ".join(argv)[:200]))
    return out


def _watch(chain: list[tuple[int, int, str]], grace_s: float, interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        for pid, started, command in chain:
            stat = _stat(pid)
            if stat is None or stat[1] != started:
                request_stop(f"launcher process {pid} ({command}) exited", 128 + signal.SIGTERM)
                print(
                    f"[pid {os.getpid()}] launcher process {pid} exited: saving a checkpoint and stopping "
                    f"(at most {grace_s:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(grace_s)
                print(f"[pid {os.getpid()}] still running {grace_s:.0f} s after the launcher exited: "
                      "exiting now", file=sys.stderr, flush=True)  # fmt: skip
                os._exit(128 + signal.SIGTERM)


def install(grace_s: float, interval_s: float = 0.5) -> list[tuple[int, int, str]]:
    """SIGTERM/SIGINT handlers and the launcher watchdog for this process (main thread only).
    Returns the watched launcher chain."""
    reset()
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    chain = launcher_processes()
    if chain:
        threading.Thread(
            target=_watch, args=(chain, grace_s, interval_s), name="launcher-watchdog", daemon=True
        ).start()
    return chain


def stop_agreed() -> bool:
    """Whether any rank was asked to stop. Collective (one host all-reduce): every rank gets the
    same answer, so where a signal reached only some ranks, or reached them a moment apart, no rank
    goes on alone into a collective the others have left."""
    mine = 1.0 if stop_reason() is not None else 0.0
    return collectives.all_reduce_max([mine])[0] > 0


def stop_setup_if_asked(what: str, advice: Callable[[], str]) -> None:
    """Raise ``StoppedDuringSetup`` on every rank when any rank was asked to stop (``stop_agreed``).
    Called where setup ends: before it changes what an earlier run left (so a job cancelled while
    its model loads leaves the output_dir as it found it) and before the first update. ``what``
    names the work stopped; ``advice()`` (called only when stopping) says, truthfully for the disk
    as it is then, what the user can run next."""
    if not stop_agreed():
        return
    reason = stop_reason() or "another rank was asked to stop"
    raise StoppedDuringSetup(
        f"stopped while {what} ({reason}): no update was trained, nothing to save; {advice()}",
        exit_code() or 128 + signal.SIGTERM,
    )
