"""Atomic, resumable checkpoints: DeepSpeed's sharded state plus our per-rank trainer state.

Layout (SPEC §4, STYLE habit 6)::

    output_dir/checkpoints/
        step_000020/
            ds/                       DeepSpeed's ZeRO-3 shards (model, optimizer, lr scheduler)
            trainer_state_rank{r}.pt  sampler position, RNG states, counters (one per rank)
            config.json               the training config + model config + world size
            COMPLETE                  written last, by rank 0, after a barrier, fsync'd
        latest                        holds the tag of the newest COMPLETE checkpoint (atomic rename)

A directory without COMPLETE is never resumed from (a run killed mid-save leaves one); keep-last-k
deletes older complete checkpoints only after the new one is complete.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mdlmpe_ds.pe.config import IMPLEMENTATION_KEYS

COMPLETE = "COMPLETE"
LATEST = "latest"
DS_TAG = "ds"
DS_UNIVERSAL_TAG = "ds_universal"  # DeepSpeed's universal copy (python -m mdlmpe_ds.engine to-universal)
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoints_root(output_dir) / f"step_{step:06d}"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories, oldest first (by step number)."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def newest_complete(output_dir: str | Path) -> Path | None:
    """The newest checkpoint with COMPLETE; `latest` is only a hint and is ignored when it names an
    incomplete or missing directory."""
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory, a `latest` file, a checkpoints/ root or an output_dir -> a COMPLETE step dir."""
    path = Path(path)
    if path.is_file() and path.name == LATEST:
        path = path.parent / path.read_text().strip()
    elif path.is_dir() and not _STEP_DIR.match(path.name):
        newest = newest_complete(path.parent if path.name == "checkpoints" else path)
        if newest is None:
            raise FileNotFoundError(f"{path}: no complete checkpoint found")
        path = newest
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if not is_complete(path):
        raise ValueError(f"{path}: checkpoint has no {COMPLETE} marker (interrupted save)")
    return path


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """`--resume auto` -> newest complete checkpoint (or None: start fresh); a path must be complete."""
    if resume is None:
        return None
    if resume == "auto":
        return newest_complete(output_dir)
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint directory")
    if not is_complete(path):
        raise ValueError(
            f"--resume {resume}: checkpoint has no {COMPLETE} marker (interrupted save); not resuming"
        )
    return path


def _fsync_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def numerics_state() -> dict[str, Any]:
    """What, besides the saved state, decides the floating-point results of the next updates.

    On the CPU the intra-op thread count does: a reduction (matmul, sum, norm) split over n threads
    adds its partial sums in an n-dependent order. With OMP_NUM_THREADS=2 instead of 1 the fp32 losses
    of the test run moved by ~1e-8 relative from update 4 on (deterministic for a fixed n), while two
    runs with the same count agree bit for bit, straight or resumed. The torch build changes kernels.
    """
    return {"intra_op_threads": torch.get_num_threads(), "torch": torch.__version__}


def numerics_differences(saved: dict[str, Any] | None) -> list[str]:
    """Why a resumed run may not repeat the straight run bit for bit (empty: it should)."""
    if not saved:
        return []
    now = numerics_state()
    return [
        f"{key} {saved.get(key)!r} at save, {value!r} now"
        for key, value in now.items()
        if saved.get(key) != value
    ]


@dataclass
class SavedRun:
    """What a checkpoint's config.json holds about the run that wrote it."""

    path: Path
    step: int
    world_size: int
    run_config: dict[str, Any]
    model_config: dict[str, Any]
    tokenizer: str | None = None


def read_saved_run(path: Path) -> SavedRun:
    meta_file = path / "config.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint of this trainer (no config.json)")
    meta = json.loads(meta_file.read_text())
    return SavedRun(
        path,
        meta["step"],
        meta["world_size"],
        meta["run_config"],
        meta["model_config"],
        meta.get("tokenizer"),
    )


#: Model config keys that change how a step is computed, not the model: a run may resume with others.
RUNTIME_MODEL_KEYS = ("gradient_checkpointing", "recompute_mdlmpe_attention")


def _model_identity(model_config: dict[str, Any]) -> dict[str, Any]:
    """The model config without runtime choices: checkpointing switches and MDLMPE's attention
    implementation (backend, block size, compile, ...), which a resumed run may change."""
    identity = {k: v for k, v in model_config.items() if k not in RUNTIME_MODEL_KEYS}
    if isinstance(identity.get("mdlmpe"), dict):
        identity["mdlmpe"] = {k: v for k, v in identity["mdlmpe"].items() if k not in IMPLEMENTATION_KEYS}
    return identity


def check_same_model(saved: SavedRun, model_config: dict[str, Any]) -> None:
    """Fail fast (before DeepSpeed reads any shard) when the checkpoint is from another model."""
    before, now = _model_identity(saved.model_config), _model_identity(model_config)
    diffs = [
        f"{key}: checkpoint {before.get(key)!r} vs run {now.get(key)!r}"
        for key in sorted(set(before) | set(now))
        if before.get(key) != now.get(key)
    ]
    if diffs:
        raise ValueError(
            f"checkpoint {saved.path} is from another model; differences:\n  " + "\n  ".join(diffs)
        )


def write_trainer_state(path: Path, rank: int, state: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f"trainer_state_rank{rank}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path / f"trainer_state_rank{rank}.pt")


def read_trainer_state(path: Path, rank: int) -> dict[str, Any]:
    file = path / f"trainer_state_rank{rank}.pt"
    if not file.is_file():
        raise FileNotFoundError(f"{file} missing: checkpoint written by fewer ranks than this run has")
    return torch.load(file, weights_only=False)


def write_meta(
    path: Path, step: int, world: int, run_config: dict, model_config: dict, tokenizer: str
) -> None:
    meta = {
        "step": step,
        "world_size": world,
        "run_config": run_config,
        "model_config": model_config,
        "tokenizer": tokenizer,
    }
    _fsync_write(path / "config.json", json.dumps(meta, indent=2, default=str))


def mark_complete(path: Path) -> None:
    """Rank 0, after every rank's files are written (barrier): COMPLETE, then `latest`."""
    _fsync_write(path / COMPLETE, f"{path.name}\n")
    _fsync_write(path.parent / LATEST, f"{path.name}\n")


def prune(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last`; incomplete directories older than
    the newest complete one are debris of interrupted saves and go too. Returns what was deleted."""
    complete = complete_checkpoints(output_dir)
    doomed = complete[:-keep_last] if keep_last > 0 else []
    root = checkpoints_root(output_dir)
    if complete:
        newest_step = int(_STEP_DIR.match(complete[-1].name).group(1))
        for child in root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and not is_complete(child) and int(match.group(1)) < newest_step:
                doomed.append(child)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=False)
    return doomed
