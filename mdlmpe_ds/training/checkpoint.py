"""The checkpoint format: layout, manifest, verification, metadata, and finding the one to resume.

The protocol that writes and reads a checkpoint (staging, fsync, COMPLETE, swap, prune; DeepSpeed's
load and the RNG) is checkpointer.py; this module is what both it and the readers (export,
evaluation, ``--resume`` resolution, startup repair) share about the files.

Layout::

    output_dir/checkpoints/
        step_000020/
            ds/                       DeepSpeed's ZeRO-3 shards (model, optimizer, lr scheduler)
            trainer_state_rank{r}.pt  sampler position, RNG states, counters (one per rank)
            config.json               the training config + model config + world size + data fingerprint
            MANIFEST.json             every file's size and a sampled CRC-32 (written before COMPLETE)
            COMPLETE                  written last, by rank 0, after a barrier, fsync'd
            ds_universal/             optional: DeepSpeed's universal copy of ds/, for a resume on
                                      another world size (launch/convert_checkpoint.py), with its
                                      own MANIFEST.json and COMPLETE (checkpointer.write_universal)
        latest                        holds the tag of the newest COMPLETE checkpoint (atomic rename)
        superseded/                   checkpoints newer than the one a run resumed from (never resumed)

What is atomic: a checkpoint is written into ``step_N.saving/``; every rank fsyncs its files, rank 0
writes the manifest and COMPLETE there and only then renames the directory to ``step_N`` (moving an
existing ``step_N`` aside first and deleting it after). A directory named ``step_N`` is therefore
complete unless its files were damaged later, which the manifest catches: ``--resume auto`` verifies
sizes and checksums, skips a damaged checkpoint naming the bad file, and falls back to the newest
good one. A kill between the two renames is repaired by ``recover_interrupted`` at the next start.
keep-last-k deletes older checkpoints only after the new one is complete, and never the new one.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mdlmpe_ds import compat
from mdlmpe_ds.models.config import drop_stored_runtime_keys
from mdlmpe_ds.training.weights_only import weights_saves

COMPLETE = "COMPLETE"
LATEST = "latest"
MANIFEST = "MANIFEST.json"
STAGING = ".saving"  # suffix of a checkpoint being written
REPLACED = ".replaced"  # suffix of an older copy of the same step while the new one is swapped in
SUPERSEDED = "superseded"
DS_TAG = "ds"
DS_UNIVERSAL_TAG = (
    "ds_universal"  # DeepSpeed's universal copy (python launch/convert_checkpoint.py to-universal)
)
UNIVERSAL_SCRATCH = DS_UNIVERSAL_TAG + ".converting"  # where a universal copy is written, then moved
# config.json's "format": 2 = this version, which always writes MANIFEST.json (a missing one is
# damage); checkpoints without the key were written before manifests existed.
FORMAT = 2
STEP_DIR = re.compile(r"^step_(\d{6,})$")


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoints_root(output_dir) / f"step_{step:06d}"


def staging_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoints_root(output_dir) / f"step_{step:06d}{STAGING}"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories, oldest first (by step number)."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def newest_complete(output_dir: str | Path) -> Path | None:
    """The newest checkpoint with COMPLETE; `latest` is only a hint and is ignored when it names an
    incomplete or missing directory."""
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def newest_verified(output_dir: str | Path, log=print) -> Path | None:
    """The newest complete checkpoint whose files match its manifest; each damaged one on the way is
    reported through ``log`` (naming the file) and skipped."""
    for path in reversed(complete_checkpoints(output_dir)):
        problems = verify(path)
        if not problems:
            return path
        log(f"warning: skipping damaged checkpoint {path}: " + "; ".join(problems))
    return None


def unusable_reasons(output_dir: str | Path) -> list[str]:
    """Each checkpoint directory of ``output_dir`` with why it cannot be resumed from (when none
    can): the error of ``--resume auto``, which must not start over silently."""
    out = []
    for path in existing_run(output_dir):
        if not is_complete(path):
            out.append(f"{path}: no {COMPLETE} marker (an interrupted save)")
        else:
            out.append(f"{path}: " + ("; ".join(verify(path)) or "unreadable"))
    return out


def resolve_checkpoint(path: str | Path, log=print) -> Path:
    """A step directory, a `latest` file, a checkpoints/ root or an output_dir -> a complete step
    directory whose files match its manifest (an output_dir: the newest such; damaged ones on the
    way are reported through ``log`` and skipped). The one resolver of resume, export and evaluation."""
    path = Path(path)
    if path.parent.name == SUPERSEDED and path.is_dir():
        root = path.parent.parent
        name = path.name.split("-")[0]
        raise ValueError(
            f"{path} is a superseded checkpoint: the continuation that was set aside when this run "
            f"resumed from an older checkpoint, which --resume never picks. To continue from it, move "
            f"the newer checkpoints of {root} aside and it back in place (mv {path} {root / name}), "
            f"then --resume {root / name}; to use its weights only, export it with "
            f"launch/export.py after moving it back"
        )
    if path.is_file() and path.name == LATEST:
        path = path.parent / path.read_text().strip()
    elif path.is_dir() and not STEP_DIR.match(path.name):
        newest = newest_verified(path.parent if path.name == "checkpoints" else path, log)
        if newest is None:
            raise FileNotFoundError(f"{path}: no complete checkpoint found{_what_it_holds(path)}")
        return newest
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if not is_complete(path):
        raise ValueError(f"{path}: checkpoint has no {COMPLETE} marker (interrupted save)")
    problems = verify(path)
    if problems:
        raise ValueError(f"{path}: checkpoint is damaged: " + "; ".join(problems))
    return path


def _what_it_holds(path: Path) -> str:
    """For "no complete checkpoint found": what ``path`` is instead, when it is something a user
    passes by mistake (a peft adapter export, a run stopped with a weights-only save)."""
    if (path / "adapter_config.json").is_file():
        return (
            " (it is a peft adapter export, launch/export.py --adapter-only: load it onto the run's "
            "--base-only export with peft, or pass the LoRA run's directory or a merged export)"
        )
    saves = weights_saves(path)
    if saves:
        return f" (a weights-only save of a stopped run is at {saves[-1]}: pass that directory)"
    return ""


def resolve_resume(resume: str | None, output_dir: str | Path, log=print) -> Path | None:
    """`--resume auto` -> newest complete checkpoint that passes verification (None: start fresh);
    an explicit path must be complete and intact (else an error naming the bad file)."""
    if resume is None:
        return None
    if resume == "auto":
        found = newest_verified(output_dir, log)
        if found is None and existing_run(output_dir):
            raise FileNotFoundError(
                f"--resume auto: {output_dir} holds checkpoints but none can be resumed from:\n  "
                + "\n  ".join(unusable_reasons(output_dir))
                + "\nNot starting over (that would replace them and the run's history). Repair or "
                "move them, resume one by path (--resume DIR), or start a new run with another "
                "--output_dir (or --overwrite_output_dir true without --resume, which deletes them)"
            )
        return found
    try:
        return resolve_checkpoint(resume, log)
    except (FileNotFoundError, ValueError) as err:
        raise type(err)(f"--resume {resume}: {err}; not resuming") from err


def existing_run(output_dir: str | Path) -> list[Path]:
    """Checkpoint directories (complete or not) already in ``output_dir``: a fresh run must not
    write over them without being told."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    return sorted(child for child in root.iterdir() if child.name.startswith("step_"))


# ---------------------------------------------------------------------------- writing
def fsync_dir(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


#: Bytes read for the sampled checksum: the head, the middle and the tail of every file. Cheap on
#: an 8B checkpoint (~100 GB), and it catches the real failures: truncation (the size), torn or
#: zero-filled writes at either end, a wrong file swapped in. It is not a full-content hash.
_SAMPLE = 1 << 20


def sampled_crc32(path: Path, size: int | None = None) -> int:
    size = path.stat().st_size if size is None else size
    crc = 0
    with open(path, "rb") as fh:
        for start in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
            fh.seek(start)
            crc = zlib.crc32(fh.read(min(_SAMPLE, size - start)), crc)
    return crc


def manifest_of(path: Path) -> dict[str, dict[str, int]]:
    """{relative file: {size, crc32}} for every file of a checkpoint but COMPLETE and the manifest."""
    out = {}
    for file in sorted(path.rglob("*")):
        rel = file.relative_to(path).as_posix()
        if file.is_file() and rel not in (COMPLETE, MANIFEST):
            size = file.stat().st_size
            out[rel] = {"size": size, "crc32": sampled_crc32(file, size)}
    return out


def verify(path: Path) -> list[str]:
    """What is wrong with a checkpoint's files against its manifest (empty: intact). A checkpoint
    written before manifests existed has none and passes."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        if compat.manifest_required(_format_of(path)):
            return [f"{manifest_file} is missing (this version always writes it: the checkpoint is damaged)"]
        return []
    try:
        manifest = json.loads(manifest_file.read_text())["files"]
    except (ValueError, KeyError) as err:
        return [f"{manifest_file} is unreadable ({err})"]
    problems = []
    for rel, want in manifest.items():
        file = path / rel
        if not file.is_file():
            problems.append(f"{file} is missing")
            continue
        size = file.stat().st_size
        if size != want["size"]:
            problems.append(f"{file} has {size} bytes, {want['size']} when saved (truncated or rewritten)")
        elif sampled_crc32(file, size) != want["crc32"]:
            problems.append(f"{file} does not match its checksum (corrupted after the save)")
    return problems


def universal_problems(path: Path) -> list[str] | None:
    """What keeps checkpoint ``path``'s universal copy from loading: None when no conversion was
    ever started (no copy, no scratch folder), [] when the copy is sealed and its files match its
    manifest, else each problem naming its file. Checked before DeepSpeed reads the copy: its loader
    fails on a partial copy with a bare AssertionError, and on a truncated file without its name."""
    copy, scratch = path / DS_UNIVERSAL_TAG, path / UNIVERSAL_SCRATCH
    if not copy.is_dir():
        if scratch.exists():
            return [f"the conversion into {copy} was interrupted (it left {scratch}, no copy)"]
        return None
    if not is_complete(copy):
        return [
            f"{copy / COMPLETE} is missing: an interrupted conversion, or a copy written before "
            f"conversions were sealed"
        ]
    if not (copy / MANIFEST).is_file():
        return [f"{copy / MANIFEST} is missing (the copy is damaged)"]
    return verify(copy)


def _format_of(path: Path) -> int:
    """config.json's checkpoint format (0: written before it was recorded, or unreadable)."""
    try:
        return int(json.loads((path / "config.json").read_text()).get("format", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def recover_interrupted(output_dir: str | Path) -> list[str]:
    """Rank 0, before resolving a resume or saving: finish or discard what a killed save left.

    - ``step_N.saving`` with COMPLETE was killed between its two renames: it is the newest copy of
      step N, so it becomes ``step_N`` (an older ``step_N`` goes);
    - ``step_N.saving`` without COMPLETE is an interrupted save: deleted (never resumed from);
    - ``step_N.replaced`` is the old copy of a step whose swap finished or is finished here: deleted,
      unless no ``step_N`` exists (then it is restored).
    Returns a description of each action."""
    root = checkpoints_root(output_dir)
    actions: list[str] = []
    if not root.is_dir():
        return actions
    for child in sorted(root.iterdir()):
        if child.name.endswith(STAGING) and child.is_dir():
            final = child.with_name(child.name[: -len(STAGING)])
            if is_complete(child):
                if final.exists():
                    shutil.rmtree(final)
                os.rename(child, final)
                actions.append(f"completed the interrupted swap of {final}")
            else:
                shutil.rmtree(child)
                actions.append(f"removed the interrupted save {child}")
    for child in sorted(root.iterdir()):
        if child.name.endswith(REPLACED) and child.is_dir():
            final = child.with_name(child.name[: -len(REPLACED)])
            if final.exists():
                shutil.rmtree(child)
            else:
                os.rename(child, final)
                actions.append(f"restored {final} from its interrupted replacement")
    return actions


def supersede_newer(output_dir: str | Path, resumed: Path) -> list[Path]:
    """Rank 0, when a run resumes from a checkpoint older than others in ``output_dir``: the newer ones
    belong to the abandoned continuation. They move to ``checkpoints/superseded/`` (kept for the
    user, never picked by ``--resume auto``), so a crash of the new continuation cannot resume into
    the old one. Returns their new paths."""
    step = step_of(resumed)
    root = checkpoints_root(output_dir)
    moved = []
    for child in existing_run(output_dir):
        match = STEP_DIR.match(child.name)
        if match and int(match.group(1)) > step:
            dest = root / SUPERSEDED / f"{child.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            dest.parent.mkdir(exist_ok=True)
            os.rename(child, dest)
            moved.append(dest)
    if moved:
        fsync_write(root / LATEST, f"{resumed.name}\n")
    return moved


#: The errnos of a write refused for space: a full disk and an exceeded quota.
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def no_space_words(code: int) -> tuple[str, str]:
    """What a write refused for space (``NO_SPACE_ERRNOS``) is called, and what makes room: the words
    of the checkpointer's and the tracker's errors, whichever file ran out."""
    if code == errno.EDQUOT:
        return "Disk quota exceeded", "raise the quota or free space"
    return "No space left on device", "free space"


def free_mib(where: Path) -> str:
    """Free MiB on ``where``'s filesystem (its nearest existing folder), or "?"."""
    try:
        while not where.exists() and where != where.parent:
            where = where.parent
        return f"{shutil.disk_usage(where).free / 2**20:.0f}"
    except OSError:
        return "?"


def fsync_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@dataclass
class SavedRun:
    """What a checkpoint's config.json holds about the run that wrote it."""

    path: Path
    step: int
    world_size: int
    run_config: dict[str, Any]
    model_config: dict[str, Any]
    tokenizer: str | None = None
    data_fingerprint: str | None = None  # absent in checkpoints written before it existed
    resolved: dict[str, Any] = field(default_factory=dict)  # write_meta's ``resolved``
    total_updates: int | None = None  # the run's total when saved; absent before it was recorded

    def resolved_value(self, key: str) -> Any | None:
        """What run-config ``key`` resolved to when the checkpoint was written (None: not recorded,
        e.g. a value used as written, or a checkpoint from before the record)."""
        return (self.resolved.get(key) or {}).get("value")


def read_saved_run(path: Path) -> SavedRun:
    meta_file = path / "config.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint of this trainer (no config.json)")
    try:
        meta = json.loads(meta_file.read_text())
        return SavedRun(
            path,
            meta["step"],
            meta["world_size"],
            meta["run_config"],
            meta["model_config"],
            meta.get("tokenizer"),
            compat.recorded_data_fingerprint(meta),
            meta.get("resolved") or {},
            meta.get("total_updates"),
        )
    except (ValueError, KeyError) as err:
        raise ValueError(f"{meta_file}: unreadable checkpoint metadata ({err!r})") from err


def check_same_data(saved: SavedRun, fingerprint: str, allow_change: bool) -> str | None:
    """Refuse to resume on other training data than the checkpoint's (same size or not): the sampler
    position and the noise draws would silently apply to different examples. Returns a warning to
    print when the user allowed the change, else None."""
    if saved.data_fingerprint is None or saved.data_fingerprint == fingerprint:
        return None
    message = (
        f"checkpoint {saved.path} was trained on other data or another tokenizer: data fingerprint "
        f"{saved.data_fingerprint[:16]} at save, {fingerprint[:16]} now"
    )
    if allow_change:
        return f"warning: {message}; continuing because train.allow_data_change is set"
    raise ValueError(
        f"{message}. Resume with the same dataset and tokenizer, or pass --allow_data_change true to "
        f"continue on the new data from this checkpoint's sampler position"
    )


#: Model-config keys a run flag sets (the model config stores the run's max length as L_ref, which
#: the MDLMPE features depend on): a difference there is named by its flag.
MODEL_KEY_FLAGS = {"max_seq_len": "--max_len"}


def check_same_model(saved: SavedRun, model_config: dict[str, Any]) -> None:
    """Fail fast (before DeepSpeed reads any shard) when the checkpoint is from another model. An
    older checkpoint's model config also held run-time keys (checkpointing switches; attention
    implementation keys in its MDLMPE block): not part of the model, so not compared
    (models.config.drop_stored_runtime_keys), and a resumed run may change them."""
    before, now = drop_stored_runtime_keys(saved.model_config), drop_stored_runtime_keys(model_config)
    diffs = [
        f"{key}: checkpoint {before.get(key)!r} vs run {now.get(key)!r}"
        + (
            f" (set by {MODEL_KEY_FLAGS[key]}: resume with {MODEL_KEY_FLAGS[key]} {before.get(key)})"
            if key in MODEL_KEY_FLAGS
            else ""
        )
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
    path: Path,
    step: int,
    world: int,
    run_config: dict,
    model_config: dict,
    tokenizer: str,
    data_fingerprint: str | None = None,
    resolved: dict | None = None,
    total_updates: int | None = None,
) -> None:
    """The checkpoint's ``config.json``: the run config as the user wrote it (hub ids, dataset
    names) and, under ``resolved``, what those names resolved to on the machine that wrote it
    (``{"section.key": {"value": local path or name, "commit": snapshot commit or null}}``; empty
    when nothing was resolved; absent in checkpoints written before it was recorded). A
    ``train.precision`` of "auto" is recorded there as the precision it ran in (checkpointer).
    ``total_updates``: the run's total at the save, which an ``--epochs`` run resumed on another
    number of ranks or grad_accum converts (runs/common.py: ``resumed_total``)."""
    meta = {
        "format": FORMAT,
        "step": step,
        "world_size": world,
        "run_config": run_config,
        "model_config": model_config,
        "tokenizer": tokenizer,
        "data_fingerprint": data_fingerprint,
        "resolved": resolved or {},
        "total_updates": total_updates,
    }
    fsync_write(path / "config.json", json.dumps(meta, indent=2, default=str))
