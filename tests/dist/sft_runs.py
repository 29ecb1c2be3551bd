"""Launch `launch/sft.py` under torchrun (2 CPU ranks, gloo) for the SFT dist tests, and read back
what a run leaves behind (metrics.jsonl, TensorBoard events, checkpoints)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SFT = REPO / "launch" / "sft.py"
FAULTS_WORKER = Path(__file__).with_name("sft_with_faults.py")
# The config users run: the tests pass only what the CPU needs on the command line.
DS_CONFIG = REPO / "ds_configs" / "zero3.json"
DEEPSPEED = Path(sys.executable).with_name("deepspeed")  # the launcher in this interpreter's bin/

# A small, fast run: tiny LLaDA-family model + MDLMPE (reference-free blocked backend, per-block
# checkpointing on), the word-level fixture tokenizer, fp32, 2 micro-batches accumulated per update.
BASE_ARGS = [
    "--max_len",
    "48",
    "--micro_batch_size",
    "2",
    "--grad_accum",
    "2",
    "--max_steps",
    "8",
    "--save_every",
    "4",
    "--keep_last",
    "3",
    "--lr",
    "3e-3",
    "--warmup_steps",
    "2",
    "--log_every",
    "1",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    out = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    out.update(
        {
            # Speed (2 ranks on 2 cores) and bitwise comparisons: the CPU kernels' summation order
            # depends on the intra-op thread count, so runs compared bit for bit must share it.
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "MDLMPE_DS_CPU_RANKS": "1",
        }
    )
    out.update(extra or {})
    return out


def command(
    args: list[str], nproc: int = 2, faults: dict | None = None, ds_config: Path = DS_CONFIG
) -> list[str]:
    """torchrun on launch/sft.py, or with ``faults`` (mdlmpe_ds.training.faults.Faults fields) on the worker
    that injects them (sft_with_faults.py); ``ds_config``: the DeepSpeed config (default: the shipped
    zero3.json)."""
    script = [str(SFT)] if faults is None else [str(FAULTS_WORKER), json.dumps(faults)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        *script,
        "--deepspeed",
        str(ds_config),
        *args,
    ]


def launch(
    args: list[str],
    extra_env: dict[str, str] | None = None,
    nproc: int = 2,
    timeout: float = 240,
    faults: dict | None = None,
    ds_config: Path = DS_CONFIG,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(args, nproc, faults, ds_config),
        env=env(extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def launch_as_two_nodes(
    args: list[str], extra_env: dict[str, str] | None = None, folders: tuple[Path, Path] = (REPO, REPO)
) -> list[subprocess.CompletedProcess]:
    """launch/sft.py as two nodes of one rank each: two torchrun agents (static rendezvous on this
    host), node ``n`` started in ``folders[n]``, so every rank is its node's first (LOCAL_RANK 0).
    One folder for both: nodes sharing a filesystem; two: each node's own disk at the same relative
    path. Returns each node's process (stdout and stderr together)."""
    port, procs = free_port(), []
    for node, folder in enumerate(folders):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
            "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
            str(SFT), "--deepspeed", str(DS_CONFIG), *args,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=folder,
                env=env(extra_env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [proc.communicate(timeout=240)[0] for proc in procs]
    return [
        subprocess.CompletedProcess(proc.args, proc.returncode, out, "") for proc, out in zip(procs, outs)
    ]


def launch_and_kill_when(
    args: list[str],
    ready,
    timeout: float = 240,
    extra_env: dict[str, str] | None = None,
    faults: dict | None = None,
) -> str:
    """Start a run in its own process group; SIGKILL the whole group once `ready()` is true."""
    log = Path(args[args.index("--output_dir") + 1]).with_suffix(".killed.log")
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            command(args, faults=faults),
            env=env(extra_env),
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        try:
            while not ready():
                if proc.poll() is not None:
                    raise AssertionError(
                        f"run ended (rc {proc.returncode}) before the kill point:\n{log.read_text()[-3000:]}"
                    )
                if time.monotonic() > deadline:
                    raise AssertionError("kill point not reached in time")
                time.sleep(0.05)
            kill_tree(proc.pid)
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait()
    return log.read_text()


def deepspeed_command(args: list[str]) -> list[str]:
    """The README's command: the `deepspeed` launcher on launch/sft.py with the shipped config (on a
    CPU-only machine it starts one rank, which re-launches itself on 2 under torchrun)."""
    return [str(DEEPSPEED), "--master_port", str(free_port()), str(SFT), "--deepspeed", str(DS_CONFIG), *args]


def start_as_user(args: list[str], log: Path) -> subprocess.Popen:
    """Start the README's command in a session of its own (its process group is the job's launcher
    group), with 2 CPU ranks as on a user's machine; output to ``log``."""
    with open(log, "w") as fh:
        return subprocess.Popen(
            deepspeed_command(args),
            env=env({"MDLMPE_DS_CPU_RANKS": "2"}),
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )


def wait_until(ready, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc {proc.returncode}) too early:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in time:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def alive(pids: list[int]) -> list[int]:
    """The pids of ``pids`` that still run (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (torchrun starts its workers in sessions of their own, so a
    process-group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and all its descendants at once (a hard crash of the whole job)."""
    for victim in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def metrics(output_dir: Path, first: int = 1) -> dict[int, dict]:
    """step -> its metrics line. The history must hold each update once, in order, from ``first``
    (a run resumed in a fresh output_dir logs from its checkpoint on), also after any number of
    kills and resumes (tracking.py): a repeated or out-of-order step fails here."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps = [row["step"] for row in rows]
    assert steps == list(range(first, first + len(steps))), f"{output_dir}/metrics.jsonl steps: {steps}"
    return {row["step"]: row for row in rows}


def tensorboard_steps(output_dir: Path, tag: str = "train/loss") -> list[int]:
    """The steps TensorBoard shows for ``tag`` (after purge_step handling of resumed runs)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(output_dir / "tensorboard"))
    acc.Reload()
    return [event.step for event in acc.Scalars(tag)]


def check(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, (
        f"{what} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


def launch_module(name: str):
    """Import launch/NAME.py (a script folder, not a package) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"launch_{name}", REPO / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
