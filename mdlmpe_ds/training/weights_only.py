"""A fast model-only save for a run that is being stopped (``train.save_on_signal model``).

A full ZeRO-3 checkpoint holds, per parameter, the fp32 master copy and Adam's two fp32 moments:
12 bytes, about 96 GB for an 8B model (docs/resume.md). Preemption leaves 30 s before the
launcher's SIGKILL. This save writes only each rank's own partition of every parameter in the
parameter dtype (2 bytes per parameter in bf16, a sixth of the full checkpoint; 4 in fp32, a
third), every rank in parallel, with no gather:

    output_dir/weights/step_000123/
        weights_rank{r}.pt    {name: this rank's flat partition}
        config.json           as in a checkpoint (run + model config, tokenizer, world size)
        WEIGHTS.json          {name: shape}, written last by rank 0: the completion marker

What it gives: the trained weights at the stop (in the parameter dtype, not the fp32 master
weights), which ``launch/export.py`` turns into a Hugging Face directory like a checkpoint. What it
does not give: optimizer, lr scheduler, sampler position, RNG -- it cannot be resumed exactly, and
``--resume auto`` continues from the last full checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

MARKER = "WEIGHTS.json"


WEIGHTS = "weights"  # the folder of a run's output_dir that holds its weights-only saves


def weights_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / WEIGHTS / f"step_{step:06d}"


def weights_saves(output_dir: str | Path) -> list[Path]:
    """The complete weights-only saves of a run, oldest first."""
    return sorted(p for p in (Path(output_dir) / WEIGHTS).glob("step_*") if is_weights_dir(p))


def is_weights_dir(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save_partitions(module: torch.nn.Module, directory: Path, rank: int) -> None:
    """This rank's partition of every parameter (ZeRO-3's ``ds_tensor``; a parameter that is not
    partitioned is written whole by rank 0). Every rank writes its own file, fsync'd."""
    parts = {}
    for name, param in module.named_parameters():
        local = getattr(param, "ds_tensor", None)
        if local is not None:
            parts[name] = local.detach().cpu().clone()  # [ceil(numel / world)] flat, padded
        elif rank == 0:
            parts[name] = param.detach().cpu().clone()
    file = directory / f"weights_rank{rank}.pt"
    torch.save(parts, file)
    with open(file, "rb") as fh:
        os.fsync(fh.fileno())


def write_marker(module: torch.nn.Module, directory: Path, world: int) -> None:
    """Rank 0, after every rank's file is written: the shapes, which make the directory complete."""
    shapes = {name: list(getattr(p, "ds_shape", None) or p.shape) for name, p in module.named_parameters()}
    tmp = directory / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"world_size": world, "shapes": shapes}))
    os.replace(tmp, directory / MARKER)


def load(directory: str | Path) -> dict[str, torch.Tensor]:
    """The full state dict of a model-only save: each parameter's partitions in rank order, cut to
    its size and shaped (one process, no process group)."""
    directory = Path(directory)
    meta = json.loads((directory / MARKER).read_text())
    ranks = [
        torch.load(directory / f"weights_rank{r}.pt", weights_only=True) for r in range(meta["world_size"])
    ]
    out = {}
    for name, shape in meta["shapes"].items():
        numel = int(torch.Size(shape).numel())
        pieces = [r[name].reshape(-1) for r in ranks if name in r]
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if flat.numel() < numel:
            raise ValueError(f"{directory}: {name} has {flat.numel()} of its {numel} values")
        out[name] = flat[:numel].reshape(shape)
    return out
