"""What the training launchers (launch/sft.py, launch/pretrain.py, launch/compare_pe.py) share
besides parsing (mdlmpe_ds/config/cli.py): their run flags as a value, the CPU re-launch under torchrun,
the resume command, and the worker's exit.

On a CPU-only machine the `deepspeed` launcher starts one rank (one "device"); the scripts then
re-launch themselves with 2 ranks under torchrun (``MDLMPE_DS_CPU_RANKS`` sets how many; 1 keeps
one), so the embedded defaults exercise real data parallelism. On GPU nodes nothing is re-launched.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CPU_RANKS_ENV = "MDLMPE_DS_CPU_RANKS"
_LAUNCHER_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "CUDA_VISIBLE_DEVICES",
)


@dataclass(frozen=True)
class RunFlags:
    """A launcher's flags that are not config keys (mdlmpe_ds/config/cli.py parses them): the DeepSpeed
    config, the launcher's --local_rank (ignored: the environment's LOCAL_RANK is the source of
    truth), the config file, --dry-run, --resume, --allow_config_change, --recipe."""

    deepspeed: str
    local_rank: int | None = None
    config: str | None = None
    dry_run: bool = False
    resume: str | None = None
    allow_config_change: list[str] = field(default_factory=list)
    recipe: str | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ranks_to_relaunch(dry_run: bool) -> int:
    """Ranks to re-launch with (0 = run here): CPU-only, a single rank, not a dry run."""
    import torch

    if dry_run or torch.cuda.is_available():
        return 0
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        return 0
    ranks = int(os.environ.get(CPU_RANKS_ENV, "2"))
    return ranks if ranks > 1 else 0


def relaunch(script: str | Path, ranks: int, argv: list[str], module: bool = False) -> int:
    """Run ``script`` again under torchrun with ``ranks`` CPU processes; returns their exit code.
    ``module``: ``script`` is a module name, run with ``-m``."""
    forwarded = [a for a in argv if not a.startswith("--local_rank") and not a.startswith("--local-rank")]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env.setdefault("OMP_NUM_THREADS", "1")
    env[CPU_RANKS_ENV] = "1"  # the children must not relaunch again
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={free_port()}",
        *(["-m", str(script)] if module else [str(Path(script).resolve())]),
        *forwarded,
    ]
    name = str(script) if module else Path(script).name
    print(
        f"[{name}] CPU-only machine and 1 rank: re-launching with {ranks} ranks:\n  {shlex.join(cmd)}",
        flush=True,
    )
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, frame):
        # torchrun passes it on to the ranks, which save a checkpoint and stop (lifecycle.py).
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def prepare_process() -> None:
    """Environment defaults and warning filters every launcher sets before importing the engine."""
    import warnings

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # DeepSpeed 0.19 calls torch.distributed APIs that torch 2.13 marks deprecated, once per step.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


def resume_command(script: str, deepspeed_config: str, rest: list[str], config: str | None = None) -> str:
    """The command that continues this run to its end: its ``--config FILE`` and its own flags with
    ``--resume auto``, minus the ones a resume must not repeat (``--resume``,
    ``--overwrite_output_dir``) and ``--stop_at`` (repeated, it would stop again at once)."""
    drop = ("--resume", "--overwrite_output_dir", "--train.overwrite_output_dir")
    drop += ("--stop_at", "--train.stop_at", "--deepspeed", "--config", "--local_rank", "--local-rank")
    switches = ("--dry-run", "--dry_run")  # flags without a value
    kept, skip = [], False
    for arg in rest:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = "=" not in arg
            continue
        if name not in switches:
            kept.append(arg)
    head = ["deepspeed", script, "--deepspeed", deepspeed_config, *(["--config", config] if config else [])]
    return shlex.join([*head, *kept, "--resume", "auto"])


def outcome(summary: dict, stop_at: int | None) -> str:
    """The first line of a finished job's report: how far the run got, against its total."""
    step, total = summary["step"], summary["total_updates"]
    loss = f", final loss {summary['history'][-1]['loss']:.4f}" if summary["history"] else ""
    if step >= total:
        if not summary["history"]:
            return f"done: nothing left to train ({total} updates)"
        return f"done: {total} updates{loss}"
    if summary["history"]:
        return f"stopped at update {step} of {total} (--stop_at {stop_at}){loss}"
    return (
        f"nothing trained: the run is at update {step} of {total} and --stop_at is {stop_at}; "
        "resume without --stop_at (or with a larger one) to continue"
    )


def dry_run_world_size() -> int:
    """The world size a real run started the same way would have: the launcher's WORLD_SIZE, or on a
    CPU-only machine the ranks it would re-launch with (ranks_to_relaunch)."""
    return ranks_to_relaunch(dry_run=False) or int(os.environ.get("WORLD_SIZE", "1"))


#: Environment variables by which a launcher or scheduler says that it started this job again
#: after a failure or a preemption: torchrun's elastic restarts (``--max-restarts``) and Slurm's
#: requeue (``--requeue``, ``scontrol requeue``). Both re-run the command as first written.
RESTART_ENV = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def restarted_by() -> str | None:
    """``NAME=N`` of the first of ``RESTART_ENV`` set above 0 in this process, else None."""
    for name in RESTART_ENV:
        value = os.environ.get(name, "0")
        if value.isdigit() and int(value) > 0:
            return f"{name}={value}"
    return None


def resume_on_restart(resume: str | None) -> tuple[str | None, str | None]:
    """(the --resume a run uses, the line that says why, or None). A job its launcher or scheduler
    started again (``restarted_by``) without --resume continues as ``--resume auto``: the newest
    complete checkpoint, or a new run where none was saved yet.

    Why: a requeued or restarted job re-runs the command as first written. Without --resume that
    command refuses an output_dir holding checkpoints, so the restart fails; with
    --overwrite_output_dir true (as ``make demo`` passes) it deletes the checkpoints and the
    history the preempted run saved and trains from the start. --overwrite_output_dir is for a
    first start only; an explicit --resume is kept."""
    restart = restarted_by()
    if resume is not None or restart is None:
        return resume, None
    return "auto", (
        f"{restart}: the job was started again, so it continues as --resume auto (the newest complete "
        "checkpoint in output_dir, or a new run if none was saved); --overwrite_output_dir applies to "
        "a first start only"
    )


def run_job(job, run, args, report) -> int:
    """The launchers' shared body: a dry run (meta device, no process group), or ``job`` inside a
    distributed session with ``report(summary)`` on rank 0. Exit code 3 when the run stopped on
    too many non-finite updates (the message names the last good checkpoint); 128 + the signal
    number when a SIGTERM/SIGINT or a lost launcher stopped it after a checkpoint (lifecycle.py).
    A job its launcher or scheduler started again resumes by itself (``resume_on_restart``)."""
    from mdlmpe_ds import run_lock
    from mdlmpe_ds.distributed import engine, process_group
    from mdlmpe_ds.stop_request import StoppedDuringSetup
    from mdlmpe_ds.training import lifecycle
    from mdlmpe_ds.training.trainer import NonFiniteError, Stopped

    if args.dry_run:
        # No process group in a dry run: the world size the real run will have, for this call only.
        saved = os.environ.get("WORLD_SIZE")
        os.environ["WORLD_SIZE"] = str(dry_run_world_size())
        try:
            job(run, args.deepspeed, resume=args.resume, dry_run=True, allow_changes=args.allow_config_change)
        finally:
            if saved is None:
                del os.environ["WORLD_SIZE"]
            else:
                os.environ["WORLD_SIZE"] = saved
        return 0
    resume, why = resume_on_restart(args.resume)
    if why and os.environ.get("RANK", "0") == "0":
        print(f"[rank 0] {why}", file=sys.stderr, flush=True)
    lifecycle.install(run.train.orphan_grace_s)
    with engine.distributed_session(run.train.dist_timeout_min, run.train.setup_timeout_min):
        try:
            summary = job(run, args.deepspeed, resume=resume, allow_changes=args.allow_config_change)
        except NonFiniteError as err:
            print(f"[rank {process_group.rank()}] stopping: {err}", file=sys.stderr, flush=True)
            return 3
        except (Stopped, StoppedDuringSetup) as err:
            if process_group.rank() == 0:
                print(f"[rank 0] {err}", file=sys.stderr, flush=True)
            return err.exit_code
        finally:
            run_lock.release()
        if process_group.rank() == 0:
            report(summary)
    return 0


def exit_process(exit_code: int) -> None:
    """Leave: a worker under torchrun / the deepspeed launcher through the process group's teardown exit
    (everything is written; gloo's C++ teardown is racy), anything else normally."""
    if "LOCAL_RANK" in os.environ:
        from mdlmpe_ds.distributed.process_group import exit_after_teardown

        exit_after_teardown(exit_code)
    sys.exit(exit_code)
