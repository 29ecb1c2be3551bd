"""A training checkpoint's weights as the plain model's state dict, in one process: the ZeRO-3
shards gathered from their fp32 master copies (or a stopped run's model-only save read whole), a
LoRA run's adapters merged onto its base, and every tensor in the shape the model declares. Both
the export (launch/export.py) and evaluation's loader (evaluation/loading.py) read checkpoints
through here, so what an export writes and what an evaluation scores are the same weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from mdlmpe_ds.distributed import engine
from mdlmpe_ds.lora import export as lora_export
from mdlmpe_ds.models.config import ModelConfig
from mdlmpe_ds.models.transformer import DiffusionLM
from mdlmpe_ds.training import weights_only


def checkpoint_state(step_dir: str | Path) -> dict[str, torch.Tensor]:
    """The fp32 state as saved: a model-only save (weights_only.py) read whole, else the ZeRO-3
    shards consolidated from their fp32 master weights (no GPU, no process group). A LoRA run's
    state holds adapters and MDLMPE weights only (see ``consolidated_state``)."""
    if weights_only.is_weights_dir(step_dir):
        return weights_only.load(step_dir)
    return engine.fp32_state_dict_from_checkpoint(Path(step_dir))


def as_declared_shapes(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """``state`` with each tensor shaped as the plain model declares it: the engine stores
    MDLMPE's scalar gate as [1] where the model declares [] (same elements, other shape)."""
    with torch.device("meta"):
        reference = dict(DiffusionLM(config).state_dict())
    shaped = {}
    for name, tensor in state.items():
        want = reference.get(name)
        if want is not None and tuple(want.shape) != tuple(tensor.shape) and want.numel() == tensor.numel():
            tensor = tensor.reshape(want.shape)
        shaped[name] = tensor
    return shaped


def consolidated_state(
    step_dir: Path, run_config: Mapping, config: ModelConfig, state: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The plain model's fp32 state dict of the checkpoint in ``step_dir`` (``state``: its saved
    state when already read): a LoRA run's adapters merged onto its frozen base with the trained
    MDLMPE weights (lora_export.merged_state), then every tensor in its declared shape."""
    state = checkpoint_state(step_dir) if state is None else state
    return as_declared_shapes(lora_export.merged_state(step_dir, run_config, state), config)
