"""The frozen base of a LoRA run: where it is found again, and whether it is the one its adapters
were trained on.

Adapters are meaningless on another base, and the base is found again by a path that may since hold
another one: a from-scratch (preset) run keeps its initial base once in ``lora_base.safetensors``
of its output_dir (looked for next to the checkpoint's ``checkpoints/``, then in the recorded
output_dir, which another run may have reused), a pretrained base is ``model_name_or_path`` (which
may have been replaced by another model or revision). So each LoRA checkpoint records the identity
of its base in ``lora.json`` and every place that reads the base again (resume, export, evaluation)
checks it, refusing another base by name.

Which identity: a preset's base file (written by us, at most a few hundred MB) by the SHA-256 of all
its bytes, i.e. its header (names, dtypes, shapes) and every tensor. A pretrained directory (16 GB
for an 8B model: about a minute to hash in full at the 0.2-0.5 GB/s one core gives, on every resume
and export) by the size, a sampled CRC-32 (head, middle, tail; ``checkpoint.sampled_crc32``) and a
spread digest (SHA-256 of ``SPREAD_CHUNKS`` chunks of ``SPREAD_BYTES`` at even steps: 4 MiB per
file, ``store_integrity.sampled_content_hash``) of its config.json and every weight file. Another
model, another revision or a re-converted copy changes every tensor; an edit of part of a shard is
caught when it spans one step (a 5 GB shard: 5 MB; a probe's edit of 0.5 MB in a 39 MB shard
passed the head/middle/tail samples alone). Checkpoints recorded before the spread digest existed
are compared by what they recorded.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mdlmpe_ds.data.fingerprint import file_sha256
from mdlmpe_ds.data.store_integrity import sampled_content_hash
from mdlmpe_ds.hub.resolve import HubResolveError, resolve_model
from mdlmpe_ds.lora.spec import BASE_FILE, CHECKPOINT_FILE
from mdlmpe_ds.training import checkpoint as ckpt


def base_file(output_dir: str | Path) -> Path:
    return Path(output_dir) / BASE_FILE


def find_base_file(step_dir: Path, run_config: Mapping[str, Any]) -> Path:
    """The initial base of a preset LoRA run: next to ``checkpoints/`` of ``step_dir`` (the run may
    have been moved), else in the recorded output_dir; a clear error when neither holds it."""
    candidates = list(
        dict.fromkeys([step_dir.parent.parent / BASE_FILE, base_file(run_config["train"]["output_dir"])])
    )
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{step_dir} is a LoRA checkpoint of a from-scratch model, whose frozen base is kept once in "
        f"{BASE_FILE} of the run's output_dir; not found at {', '.join(map(str, candidates))}"
    )


def adopt_base(source: Path, output_dir: str | Path, identity: dict[str, Any]) -> Path | None:
    """Rank 0, when a preset LoRA run resumes from another run's checkpoint: copy that run's base
    file (``identity``: its ``base_identity``, known to the caller) into this run's ``output_dir``
    (atomic: a temporary file, fsync, rename), unless the file there is that base already (the same
    file, or the same identity). A file there of another identity, a stale leftover, is replaced.
    Returns the copy, or None when nothing was copied.

    Why: this run's checkpoints hold adapters only; without its own copy the run could later be
    neither resumed nor exported once the other run's directory is moved or deleted."""
    target = base_file(output_dir)
    if target.exists() and (target.resolve() == source.resolve() or base_identity(target) == identity):
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with open(source, "rb") as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 16 * 2**20)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, target)
    return target


IDENTITY_ATTR = "_lora_base_identity"  # set on the model by lora.attach, read by each checkpoint save


#: The spread digest (``store_integrity.sampled_content_hash``, as token stores are checked): this
#: many chunks of SPREAD_BYTES at even steps through each file.
SPREAD_CHUNKS, SPREAD_BYTES = 1024, 4096


def _directory_digest(directory: Path) -> dict[str, dict[str, int]]:
    names = sorted({"config.json", *(p.name for p in directory.glob("*.safetensors"))})
    out = {}
    for name in names:
        file = directory / name
        if file.is_file():
            size = file.stat().st_size
            out[name] = {
                "size": size,
                "crc32": ckpt.sampled_crc32(file, size),
                "spread": sampled_content_hash(file, SPREAD_CHUNKS, SPREAD_BYTES),
            }
    return out


def _same_files(got: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    """The same files with the same digests, each compared on the digests its record holds (one
    written before the spread digest has size and crc32 only)."""
    if set(got) != set(want):
        return False
    return all(all(got[name].get(k) == v for k, v in want[name].items()) for name in want)


def base_identity(source: Path) -> dict[str, Any]:
    """The identity of a base: ``{"sha256"}`` of a preset's base file, ``{"files"}`` of a directory."""
    source = Path(source)
    if source.is_dir():
        return {"kind": "directory", "files": _directory_digest(source)}
    return {"kind": "file", "sha256": file_sha256(source)}


def recorded_base_identity(step_dir: Path) -> dict[str, Any] | None:
    """The base identity ``step_dir``'s lora.json records (None: a checkpoint from before it was)."""
    try:
        return json.loads((step_dir / CHECKPOINT_FILE).read_text()).get("base")
    except (OSError, ValueError):
        return None


def check_base_identity(step_dir: Path, source: Path) -> dict[str, Any] | None:
    """Refuse a base ``source`` that is not the one ``step_dir`` was trained on; returns the recorded
    identity (None when the checkpoint records none)."""
    want = recorded_base_identity(step_dir)
    if want is None:
        return None
    got = base_identity(source)
    same = (
        got.get("sha256") == want.get("sha256")
        if want.get("kind") == "file"
        else _same_files(got.get("files") or {}, want.get("files") or {})
    )
    if not same:
        where = (
            f"a from-scratch run keeps its base in {BASE_FILE} of its output_dir: copy the run's own "
            f"{BASE_FILE} into {step_dir.parent.parent}"
            if want.get("kind") == "file"
            else "model_name_or_path must name the pretrained model it was trained on"
        )
        raise ValueError(
            f"{source}: not the base this LoRA checkpoint was trained on ({step_dir / CHECKPOINT_FILE} "
            f"records {_short(want)}, this base has {_short(got)}); the path may have been reused by "
            f"another run or the model replaced since. {where}"
        )
    return want


def _short(identity: Mapping[str, Any]) -> str:
    if identity.get("kind") == "file":
        return f"SHA-256 {str(identity.get('sha256'))[:16]}..."
    files = identity.get("files") or {}
    return f"{len(files)} files of {sum(f['size'] for f in files.values()):,} bytes (sizes + sampled CRC-32s)"


def base_source(step_dir: Path, run_config: Mapping[str, Any]) -> Path:
    """Where the frozen base of a LoRA checkpoint is read from (the pretrained directory, resolved;
    or the preset run's base file)."""
    source = run_config["model"].get("model_name_or_path")
    if source is None:
        return find_base_file(step_dir, run_config)
    try:
        return Path(resolve_model(source, run_config["model"].get("revision")))
    except (HubResolveError, OSError) as err:  # the resolver's words say nothing of LoRA
        raise FileNotFoundError(
            f"{step_dir} is a LoRA checkpoint: its adapters are merged onto (and resume on) the frozen "
            f"base it was trained from, model_name_or_path {source!r}, which cannot be read now ({err}). "
            "Put the base back at that path (a resume may instead name its new place with "
            "--model_name_or_path); it must be the same model: the checkpoint records its identity"
        ) from err


def load_base_file(path: Path) -> dict[str, torch.Tensor]:
    """A preset run's base file, or an error naming it when it cannot be read (truncated, damaged)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(
            f"{path}: the LoRA run's frozen base cannot be read ({err}); it is truncated or damaged: "
            f"restore the run's {BASE_FILE} from a copy"
        ) from err
