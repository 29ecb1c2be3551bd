"""What a LoRA checkpoint holds beside DeepSpeed's shards (``lora.json``: the spec, the trainable names,
the base's identity), how a resume is checked against it, and the DeepSpeed save/load arguments of
a LoRA run.

Apart from the adapters (adapters.py) because these are the checkpoint callback's concerns
(training/callbacks.py calls the last four functions at each save and resume); a LoRA checkpoint
leaves the frozen base out, so it must say what it holds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from mdlmpe_ds.lora.adapters import spec_of
from mdlmpe_ds.lora.base import IDENTITY_ATTR
from mdlmpe_ds.lora.spec import CHECKPOINT_FILE, LoraSpec, from_mapping


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def write_checkpoint_meta(
    step_dir: Path, spec: LoraSpec, names: Iterable[str], base: dict[str, Any] | None = None
) -> None:
    """``lora.json``: the spec, the trainable parameter names the shards hold (checked on resume)
    and the identity of the frozen base the adapters were trained on (``base_identity``)."""
    tmp = step_dir / (CHECKPOINT_FILE + ".tmp")
    meta = {"lora": spec.to_dict(), "trainable": list(names), **({"base": base} if base else {})}
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, step_dir / CHECKPOINT_FILE)


def check_checkpoint(step_dir: Path, spec: LoraSpec | None, names: list[str]) -> None:
    """Before DeepSpeed loads ``step_dir`` (non-strict for LoRA: the frozen base is not in it): the
    checkpoint must be of the same kind (LoRA or full), the same r and targets, and hold exactly the adapter
    and MDLMPE parameters this model trains; else a clear error naming what differs."""
    file = step_dir / CHECKPOINT_FILE
    if spec is None:
        if file.is_file():
            raise ValueError(
                f"{step_dir} is a LoRA checkpoint ({file.name}) but this run is a full fine-tune: resume "
                f"it with --lora {parse_spec_text(file)}"
            )
        return
    if not file.is_file():
        raise ValueError(
            f"{step_dir} is a full fine-tune checkpoint (no {CHECKPOINT_FILE}); it cannot be resumed "
            f"as a LoRA run (--lora {spec.text()})"
        )
    try:
        saved = json.loads(file.read_text())
        saved_spec = from_mapping(saved["lora"], str(file))
        saved_names = list(saved["trainable"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{file}: unreadable LoRA checkpoint metadata ({err!r})") from err
    # r and targets decide the adapter tensors; alpha and dropout do not (a change of those is refused
    # or forced by training/resume_changes.py, before this)
    if (saved_spec.r, saved_spec.targets) != (spec.r, spec.targets):
        raise ValueError(
            f"{file}: checkpoint trained --lora {saved_spec.text()}, this run has --lora {spec.text()}"
        )
    missing = [n for n in names if n not in saved_names]
    extra = [n for n in saved_names if n not in names]
    if missing or extra:
        raise ValueError(
            f"{step_dir}: the checkpoint's adapter/MDLMPE parameters differ from this model's: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}"
        )


def parse_spec_text(file: Path) -> str:
    try:
        return from_mapping(json.loads(file.read_text())["lora"], str(file)).text()
    except (ValueError, KeyError, TypeError):
        return "..."


def checkpoint_save_kwargs(run) -> dict[str, bool]:
    """DeepSpeed save_checkpoint arguments: a LoRA run leaves the frozen base out of every save."""
    return {"exclude_frozen_parameters": True} if spec_of(run) is not None else {}


def checkpoint_load_kwargs(run) -> dict[str, bool]:
    """DeepSpeed load_checkpoint arguments: a LoRA checkpoint holds no frozen base (non-strict; the
    keys that must be there are checked by ``check_resume`` first)."""
    return {"load_module_strict": False} if spec_of(run) is not None else {}


def write_checkpoint_meta_of(step_dir: Path, run, model: nn.Module) -> None:
    spec = spec_of(run)
    if spec is not None:
        write_checkpoint_meta(step_dir, spec, trainable_names(model), getattr(model, IDENTITY_ATTR, None))


def check_resume(step_dir: Path, run, model: nn.Module) -> None:
    spec = spec_of(run)
    check_checkpoint(step_dir, spec, trainable_names(model) if spec is not None else [])
