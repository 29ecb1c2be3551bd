"""LLaDA / Dream backbones: config, presets, the transformer, and HF checkpoint
directories (hf_config: config.json; hf_io: the weights)."""

from mdlmpe_ds.models.config import FAMILIES, POSITION_ENCODINGS, ModelConfig
from mdlmpe_ds.models.hf_config import CheckpointError, read_hf_config
from mdlmpe_ds.models.hf_io import load_pretrained, load_weights_into, save_pretrained
from mdlmpe_ds.models.presets import PRESETS, preset
from mdlmpe_ds.models.recompute import Recompute
from mdlmpe_ds.models.transformer import DiffusionLM

__all__ = [
    "FAMILIES",
    "POSITION_ENCODINGS",
    "PRESETS",
    "CheckpointError",
    "DiffusionLM",
    "ModelConfig",
    "Recompute",
    "load_pretrained",
    "load_weights_into",
    "preset",
    "read_hf_config",
    "save_pretrained",
]
