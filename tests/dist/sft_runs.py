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
CPU_CONFIG = REPO / "ds_configs" / "zero3_cpu_test.json"

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


def command(args: list[str], nproc: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        str(SFT),
        "--deepspeed",
        str(CPU_CONFIG),
        *args,
    ]


def launch(
    args: list[str], extra_env: dict[str, str] | None = None, nproc: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(args, nproc), env=env(extra_env), capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def launch_and_kill_when(args: list[str], ready, timeout: float = 240) -> str:
    """Start a run in its own process group; SIGKILL the whole group once `ready()` is true."""
    log = Path(args[args.index("--output_dir") + 1]).with_suffix(".killed.log")
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            command(args), env=env(), stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
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


def metrics(output_dir: Path) -> dict[int, dict]:
    """step -> the last metrics line logged for it (a resumed run re-logs steps after its checkpoint)."""
    out: dict[int, dict] = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out[row["step"]] = row
    return out


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
