"""Load a model (and its tokenizer) for inference from an exported HF directory or a training run.

- An exported / Hugging Face directory (``config.json`` + safetensors): ``hf_io.load_pretrained``;
  a hub id (``org/name``) is first resolved to its snapshot (``mdlmpe_ds.hub.resolve``).
- A training output (output_dir, ``checkpoints/``, a step directory or ``latest``): the newest
  COMPLETE ZeRO-3 checkpoint is consolidated in this process from its fp32 master weights, as
  ``launch/export.py`` does, and the tokenizer recorded by the run is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mdlmpe_ds.hub.resolve import looks_like_hub_id, resolve
from mdlmpe_ds.models.config import ModelConfig
from mdlmpe_ds.models.device import check_device
from mdlmpe_ds.models.hf_config import CONFIG_NAME
from mdlmpe_ds.models.hf_io import load_pretrained
from mdlmpe_ds.models.transformer import DiffusionLM
from mdlmpe_ds.training import checkpoint as ckpt
from mdlmpe_ds.training.consolidate import checkpoint_state, consolidated_state

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def is_hf_dir(path: str | Path) -> bool:
    """An exported directory: config.json next to safetensors weights (one file or an index)."""
    path = Path(path)
    return (path / CONFIG_NAME).is_file() and any(path.glob("*.safetensors"))


def _from_training_run(path: Path) -> tuple[DiffusionLM, str | None]:

    step_dir = ckpt.resolve_checkpoint(path)
    saved = ckpt.read_saved_run(step_dir)
    config = ModelConfig.from_dict(saved.model_config, stored=True)
    model = DiffusionLM(config)
    # a LoRA run's checkpoint holds adapters + MDLMPE only: merged onto its base (consolidate.py)
    state = consolidated_state(step_dir, saved.run_config, config, checkpoint_state(step_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("active_kv")]
    if missing or unexpected:
        raise ValueError(
            f"{step_dir}: checkpoint does not match the model: missing {missing}, unexpected {unexpected}"
        )
    return model, saved.tokenizer


def tokenizer_dir_of(path: str | Path) -> str | None:
    """The tokenizer directory ``load_model(path)`` will return, read without loading weights: an
    export is its own, a training run names it in its checkpoint's metadata. None where that cannot
    be told without loading (a hub id, a damaged run: ``load_model`` reports those)."""
    if is_hf_dir(path):
        return str(path)
    if not Path(path).exists():
        return None
    try:
        return ckpt.read_saved_run(ckpt.resolve_checkpoint(path, log=lambda _message: None)).tokenizer
    except (OSError, ValueError):
        return None


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: str = "fp32"
) -> tuple[DiffusionLM, str | None]:
    """(model in eval mode on ``device`` in ``dtype``, tokenizer directory or None)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} must be one of {sorted(DTYPES)}")
    check_device(device)  # before minutes of loading, not torch's assertion after them
    path = _local(path, "model")
    if is_hf_dir(path):
        model, tokenizer = load_pretrained(path), str(path)
    elif path.exists():
        model, tokenizer = _from_training_run(path)
    else:
        raise FileNotFoundError(f"{path}: no such model directory or checkpoint")
    return model.to(device=device, dtype=DTYPES[dtype]).eval(), tokenizer


def load_tokenizer(path: str | Path) -> Any:
    """A Hugging Face tokenizer from a local directory or a hub id (read from the hub cache)."""
    from transformers import AutoTokenizer

    from mdlmpe_ds.models.hf_config import tokenizer_load_options

    local = _local(path, "tokenizer")
    return AutoTokenizer.from_pretrained(
        str(local), local_files_only=True, trust_remote_code=False, **tokenizer_load_options(local)
    )


def _local(path: str | Path, what: str) -> Path:
    """A local path as is; a hub id (``org/name``) through the hub cache or ``snapshot_download``."""

    if Path(path).exists():
        return Path(path)
    if not looks_like_hub_id(str(path)):
        if what == "tokenizer":  # transformers would call it a malformed repo id
            raise FileNotFoundError(
                f"the tokenizer directory {path} does not exist (a run records where its tokenizer was "
                "when it trained: was it moved or deleted? put it back, or point to the new place: "
                "launch/generate.py --tokenizer DIR)"
            )
        return Path(path)
    return resolve(str(path), what=what, tokenizer=what == "tokenizer")
