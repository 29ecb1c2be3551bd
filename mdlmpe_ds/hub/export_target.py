"""Where an export may be written, and how it replaces an earlier one without leaving stale files.

An export directory is built whole in a staging directory next to its target
(``.<name>.exporting-<host>-<pid>``) and swapped in by two renames (the earlier export aside, the new
one in, then the earlier one deleted). So a reader never sees a mix: a single-file
``model.safetensors`` from an earlier export cannot survive next to a new sharded export (where
`transformers` would load the old weights and ``hf_io`` the new ones), and an interrupted export
leaves the earlier one in place. Every file is made readable by others (0644 under the usual umask
022): an export is meant to be shared, and `safetensors` writes its files 0600.

The target is refused, by name, when the swap would destroy something that is not an export:
- a checkpoint directory, the ``checkpoints/`` folder or anything inside them (an export into
  ``STEP`` would overwrite the checkpoint's own ``config.json`` and make it unusable);
- a training run's output_dir itself, or a directory that holds the checkpoint being exported;
- the run's own model or tokenizer directory, or one inside or around it (a LoRA run's frozen base
  lives there only);
- an existing directory holding files an export never writes (they would be deleted);
- an existing export of another kind (merged model, ``--base-only`` base, ``--adapter-only``
  adapter): an adapter written over the base export it loads onto, or a merged model over the
  adapter, would delete the other silently, and once ``keep_last`` has rotated the checkpoint the
  export may be the only copy. Each export records its kind in ``EXPORT_MARKER``; an earlier
  export without one is told apart by its files (an adapter, or a model).
A new folder inside a run's output_dir (``outputs/run/export``) is fine: nothing of the run lives there.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import shutil
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path

from mdlmpe_ds.hub.export import TOKENIZER_FILES
from mdlmpe_ds.run_lock import pid_alive

#: Every name an export (merged, or --adapter-only) may write; anything else in an existing target is
#: the user's, and an export refuses to delete it.
EXPORT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "modeling_mdlmpe.py",
    "adapter_config.json",
    "adapter_model.safetensors",
    "mdlmpe.safetensors",
    "README.md",
    "mdlmpe_export.json",
    *TOKENIZER_FILES,
)
#: What an export is and where it came from ({"kind": ..., "checkpoint": ..., "step": ...}).
EXPORT_MARKER = "mdlmpe_export.json"
#: Export kinds (what the refusal calls each, the export.py flag that writes it): the merged (or
#: full fine-tune) model, a LoRA run's base with its trained MDLMPE weights, and the peft adapter
#: directory. "model" is an earlier export without a marker: merged or base.
EXPORT_KINDS = {
    "merged": ("a merged model", "--merge (the default)"),
    "base": ("a --base-only base", "--base-only"),
    "adapter": ("a peft adapter", "--adapter-only"),
}
_UNMARKED_MODEL = "model"
_STEP_NAME = re.compile(r"^step_\d{6,}")
_STAGING_INFIX = ".exporting-"
_ASIDE_INFIX = ".replaced-"


class ExportTargetError(ValueError):
    """An export target whose replacement would destroy a checkpoint, a run or the user's files."""


def _is_checkpoint(path: Path) -> bool:
    named = bool(_STEP_NAME.match(path.name)) and path.parent.name == "checkpoints"
    return named or ((path / "COMPLETE").is_file() and (path / "ds").is_dir())


def _is_run_dir(path: Path) -> bool:
    return (path / "checkpoints").is_dir()


def existing_kind(out: Path) -> str | None:
    """The kind of the export in ``out`` (``EXPORT_KINDS``): its marker's, else "adapter" or "model"
    (merged or base: an export written before markers) from its files; None if it holds none."""
    marker = out / EXPORT_MARKER
    if marker.is_file():
        with contextlib.suppress(ValueError, OSError):
            kind = json.loads(marker.read_text()).get("kind")
            if kind in EXPORT_KINDS:
                return kind
    if (out / "adapter_config.json").is_file():
        return "adapter"
    return _UNMARKED_MODEL if (out / "config.json").is_file() else None


def write_marker(stage: Path, kind: str, checkpoint: str | Path, step: int) -> None:
    """Record the export's kind and source in ``stage`` (``EXPORT_MARKER``)."""
    record = {"kind": kind, "checkpoint": str(Path(checkpoint).resolve()), "step": step}
    (stage / EXPORT_MARKER).write_text(json.dumps(record, indent=1) + "\n")


def _check_kind(out: Path, kind: str) -> None:
    """Refuse to replace an export of another kind (module doc)."""
    there = existing_kind(out)
    if there is None or there == kind or (there == _UNMARKED_MODEL and kind != "adapter"):
        return
    held = "a model" if there == _UNMARKED_MODEL else EXPORT_KINDS[there][0]
    name, flag = EXPORT_KINDS[kind]
    raise ExportTargetError(
        f"export target {out} holds {held} export; writing {name} ({flag}) "
        "there would delete it. Export each kind into its own directory (e.g. RUN/export, RUN/adapter, "
        "RUN/base), or remove the earlier export first if it is no longer needed"
    )


def check_target(
    out: str | Path, checkpoint: str | Path, inputs: Sequence[str | None] = (), kind: str | None = None
) -> Path:
    """``out`` resolved, after the refusals of the module doc; ``checkpoint`` is the step directory
    being exported, ``inputs`` the run's own input directories (its model and tokenizer: a LoRA
    run's base, which its checkpoints do not hold; hub ids and None are skipped), ``kind`` the
    export's (``EXPORT_KINDS``; None: not checked)."""
    out, checkpoint = Path(out).resolve(), Path(checkpoint).resolve()
    advice = "choose a new directory outside the checkpoints, e.g. <output_dir>/export"
    for source in (Path(s).resolve() for s in inputs if s and Path(s).is_dir()):
        if out == source or source in out.parents or out in source.parents:
            raise ExportTargetError(
                f"export target {out} {'is' if out == source else 'overlaps'} the run's input directory "
                f"{source} (its model or tokenizer): replacing it would destroy what the run was trained "
                "from, and a LoRA run could then be neither exported nor resumed; choose a new directory"
            )
    if out == checkpoint or checkpoint in out.parents:
        relation = "is" if out == checkpoint else "is inside"
        raise ExportTargetError(
            f"export target {out} {relation} the checkpoint being exported ({checkpoint}); {advice}"
        )
    if out in checkpoint.parents:
        raise ExportTargetError(
            f"export target {out} holds the checkpoint being exported ({checkpoint}): replacing it "
            f"would delete the run; {advice}"
        )
    for place in (out, *out.parents):
        if _is_checkpoint(place):
            raise ExportTargetError(f"export target {out} is inside the checkpoint {place}; {advice}")
        if place.name == "checkpoints" and _is_run_dir(place.parent):
            raise ExportTargetError(f"export target {out} is inside the checkpoints folder {place}; {advice}")
    if _is_run_dir(out):
        raise ExportTargetError(f"export target {out} is a training run's output_dir; {advice}")
    if out.exists() and not out.is_dir():
        raise ExportTargetError(f"export target {out} exists and is not a directory")
    if out.is_dir():
        foreign = sorted(
            p.name for p in out.iterdir() if not any(fnmatch.fnmatch(p.name, pat) for pat in EXPORT_PATTERNS)
        )
        if foreign:
            shown = ", ".join(foreign[:8]) + (" ..." if len(foreign) > 8 else "")
            raise ExportTargetError(
                f"export target {out} holds files an export does not write ({shown}); replacing it would "
                "delete them: choose a new or empty directory, or move them away"
            )
        if kind is not None:
            _check_kind(out, kind)
    return out


def _modes(root: Path) -> None:
    """Files 0644 and folders 0755, less what the umask takes away (an export is for others)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(root, 0o755 & ~mask)
    for path in root.rglob("*"):
        os.chmod(path, (0o755 if path.is_dir() else 0o644) & ~mask)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_debris(out: Path) -> None:
    """Staging and set-aside directories of ``out`` left by an export killed on this host (its
    process is gone): they hold a partial or a superseded export, never the current one."""
    host = socket.gethostname()
    for infix in (_STAGING_INFIX, _ASIDE_INFIX):
        for path in out.parent.glob(f".{out.name}{infix}*"):
            owner_host, _, pid = path.name.split(infix, 1)[1].rpartition("-")
            if owner_host == host and pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)


#: Names an export target may hold that the export itself does not write: the user's (a model card,
#: generation defaults). A re-export carries them over instead of deleting them.
USER_FILES = ("README.md", "generation_config.json")


def _carry_user_files(out: Path, staging: Path) -> None:
    """Copy ``USER_FILES`` of the earlier export in ``out`` into ``staging`` unless the new export
    wrote its own: the swap replaces the whole directory."""
    for name in USER_FILES:
        if (out / name).is_file() and not (staging / name).exists():
            shutil.copy2(out / name, staging / name)


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh staging directory next to ``out``; after the block, ``out`` is exactly what was
    written there (module doc). On an error the staging directory goes and ``out`` is untouched."""
    tag = f"{socket.gethostname()}-{os.getpid()}"
    staging = out.parent / f".{out.name}{_STAGING_INFIX}{tag}"
    aside = out.parent / f".{out.name}{_ASIDE_INFIX}{tag}"
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_debris(out)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        _carry_user_files(out, staging)
        _modes(staging)
        for path in [*staging.rglob("*"), staging]:
            _fsync(path)
        if out.exists():
            os.rename(out, aside)
        try:
            os.rename(staging, out)
        except OSError:
            if aside.exists():
                os.rename(aside, out)  # the earlier export back in place
            raise
        _fsync(out.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)
