"""Hugging Face ``config.json`` of the two families: read into a ``ModelConfig`` and written from one.

The keys are the public checkpoints' own (docs/models.md §1-2): LLaDA's OLMo-style keys or Dream's
Qwen2 keys, plus a ``mdlmpe_ds`` block with the project-only settings (position encoding, MDLMPE
config). Upstream options this implementation reproduces only at one value are checked, and a
config of the other family or without a required key is an error naming the file and the key.

Apart from the weights (hf_io.py) because a config is read on its own: the run assembly builds the
model from it before any weight exists (under ZeRO-3, partitioned), and export writes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mdlmpe_ds.compat import read_stored_mdlmpe
from mdlmpe_ds.models.config import ModelConfig
from mdlmpe_ds.pe.config import MDLMPEConfig

CONFIG_NAME = "config.json"
PROJECT_KEY = "mdlmpe_ds"  # config.json block with the settings upstream configs do not have


# Upstream options this implementation reproduces only at these values (docs/models.md §1).
_LLADA_REQUIRED = {
    "block_type": "llama",
    "activation_type": "silu",
    "layer_norm_type": "rms",
    "include_bias": False,
    "include_qkv_bias": False,
    "rope": True,
    "alibi": False,
    "attention_layer_norm": False,
    "input_emb_norm": False,
    "scale_logits": False,
    "block_group_size": 1,
    "bias_for_layer_norm": False,
}
_DREAM_REQUIRED = {"hidden_act": "silu", "rope_scaling": None, "use_sliding_window": False}


class CheckpointError(ValueError):
    """A checkpoint directory that does not match the model; the message names every problem."""


# ---------------------------------------------------------------------------------------- config
def detect_family(raw: Mapping[str, Any], where: str = CONFIG_NAME) -> str:
    """'llada' for LLaDA's OLMo-style keys (``d_model``, ``n_heads``...), 'dream' for Qwen2 keys."""
    model_type = str(raw.get("model_type", "")).lower()
    if model_type == "llada" or "d_model" in raw:
        return "llada"
    if model_type in ("dream", "qwen2") or "num_hidden_layers" in raw:
        return "dream"
    raise CheckpointError(
        f"{where}: cannot tell the model family (model_type={raw.get('model_type')!r}); expected LLaDA keys "
        "(d_model, n_heads, ...) or Dream/Qwen2 keys (hidden_size, num_hidden_layers, ...)"
    )


def _require(raw: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in raw:
        raise CheckpointError(f"{where}: required key {key!r} is missing")
    return raw[key]


def config_from_hf_dict(raw: Mapping[str, Any], where: str = CONFIG_NAME, **overrides: Any) -> ModelConfig:
    """ModelConfig from a parsed config.json; ``overrides`` win (e.g. the run's ``max_seq_len``)."""
    family = detect_family(raw, where)
    if "family" in overrides and overrides["family"] != family:
        raise CheckpointError(
            f"{where}: describes a {family} model (model_type={raw.get('model_type')!r}), "
            f"but a {overrides['family']} model was requested"
        )
    required = _LLADA_REQUIRED if family == "llada" else _DREAM_REQUIRED
    for key, value in required.items():
        if key in raw and raw[key] != value:
            raise CheckpointError(f"{where}: {key}={raw[key]!r} is not supported (only {value!r})")
    if family == "llada":
        d_model = _require(raw, "d_model", where)
        n_heads = _require(raw, "n_heads", where)
        mlp = raw.get("mlp_hidden_size") or int(raw.get("mlp_ratio", 4) * d_model)
        values: dict[str, Any] = {
            "family": "llada",
            # LLaDA's embedding table has ``embedding_size`` rows when set (126464 for LLaDA-8B).
            "vocab_size": raw.get("embedding_size") or _require(raw, "vocab_size", where),
            "hidden_size": d_model,
            "num_layers": _require(raw, "n_layers", where),
            "num_heads": n_heads,
            "num_kv_heads": raw.get("n_kv_heads") or n_heads,
            "intermediate_size": mlp,
            "rms_norm_eps": raw.get("rms_norm_eps", 1e-5),
            "rope_theta": raw.get("rope_theta", 10000.0),
            "max_seq_len": raw.get("max_sequence_length", 4096),
            "tie_embeddings": bool(raw.get("weight_tying", False)),
            "mask_token_id": raw.get("mask_token_id", 126336),
            "eos_token_id": raw.get("eos_token_id", 126081),
            "pad_token_id": raw.get("pad_token_id", 126081),
        }
    else:
        heads = _require(raw, "num_attention_heads", where)
        values = {
            "family": "dream",
            "vocab_size": _require(raw, "vocab_size", where),
            "hidden_size": _require(raw, "hidden_size", where),
            "num_layers": _require(raw, "num_hidden_layers", where),
            "num_heads": heads,
            "num_kv_heads": raw.get("num_key_value_heads") or heads,
            "intermediate_size": _require(raw, "intermediate_size", where),
            "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
            "rope_theta": raw.get("rope_theta", 10000.0),
            "max_seq_len": raw.get("max_position_embeddings", 2048),
            "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
            "mask_token_id": raw.get("mask_token_id", 151666),
            "eos_token_id": raw.get("eos_token_id", 151643),
            "pad_token_id": raw.get("pad_token_id", 151643),
        }
    project = dict(raw.get(PROJECT_KEY) or {})
    mdlmpe = project.pop("mdlmpe", None)
    values.update(project)
    values.update(overrides)
    # An older export's block may hold attention-implementation keys (a run-time choice now): dropped.
    mdlmpe_values = read_stored_mdlmpe(dict(mdlmpe or {}))
    if isinstance(values.get("mdlmpe"), MDLMPEConfig):
        mdlmpe_cfg = values.pop("mdlmpe")
    else:
        mdlmpe_values.update(values.pop("mdlmpe", None) or {})
        mdlmpe_values["max_seq_len"] = values["max_seq_len"]  # L_ref follows the model (docs/method.md
        # "Window")
        mdlmpe_cfg = MDLMPEConfig.from_dict(mdlmpe_values)
    try:
        return ModelConfig(**values, mdlmpe=mdlmpe_cfg).validate()
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: {err}") from err


def read_hf_config(path: str | os.PathLike, **overrides: Any) -> ModelConfig:
    """ModelConfig of a checkpoint directory (family detected from its config.json)."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise CheckpointError(f"{file}: no config.json in the checkpoint directory")
    return config_from_hf_dict(read_json(file), str(file), **overrides)


def hf_config_dict(config: ModelConfig, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The family's own config.json for ``config`` (+ the ``mdlmpe_ds`` block, + ``extra`` keys)."""
    if config.family == "llada":
        raw: dict[str, Any] = {
            "model_type": "llada",
            "architectures": ["LLaDAModelLM"],
            "d_model": config.hidden_size,
            "n_layers": config.num_layers,
            "n_heads": config.num_heads,
            "n_kv_heads": config.num_kv_heads,
            "mlp_hidden_size": config.intermediate_size,
            "mlp_ratio": 4,
            "vocab_size": config.vocab_size,
            "embedding_size": config.vocab_size,
            "weight_tying": config.tie_embeddings,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta,
            "rope_full_precision": True,
            "max_sequence_length": config.max_seq_len,
            "layer_norm_with_affine": True,
            "attention_dropout": 0.0,
            "residual_dropout": 0.0,
            "embedding_dropout": 0.0,
            "flash_attention": False,
            "init_std": config.init_std,
            "use_cache": False,
            "mask_token_id": config.mask_token_id,
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
            **_LLADA_REQUIRED,
        }
    else:
        raw = {
            "model_type": "Dream",
            "architectures": ["DreamModel"],
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "intermediate_size": config.intermediate_size,
            "vocab_size": config.vocab_size,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta,
            "max_position_embeddings": config.max_seq_len,
            "tie_word_embeddings": config.tie_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": config.init_std,
            "use_cache": False,
            "mask_token_id": config.mask_token_id,
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
            **_DREAM_REQUIRED,
        }
    raw[PROJECT_KEY] = {
        "position_encoding": config.position_encoding,
        "init_std": config.init_std,
        "mdlmpe": config.mdlmpe.to_dict(),
    }
    raw.update(extra or {})
    return raw


def read_json(file: Path) -> Any:
    """A parsed JSON file of the checkpoint; a truncated or corrupt one is an error naming it."""
    try:
        with open(file, encoding="utf-8") as fh:
            return json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: not valid JSON ({err}); is the file truncated?") from err


def tokenizer_load_options(directory: str | os.PathLike) -> dict[str, Any]:
    """Extra ``AutoTokenizer.from_pretrained`` arguments for ``directory``: a plain config when its
    config.json names a model type transformers does not know (LLaDA, our exports). Without it,
    transformers (trust_remote_code off) falls back to a blank config and prints "You are using a
    model of type `llada` to instantiate a model of type ``" on every load; the tokenizer class
    comes from tokenizer_config.json either way."""
    file = Path(directory) / CONFIG_NAME
    if not file.is_file():
        return {}
    try:
        model_type = json.loads(file.read_text()).get("model_type")
    except (ValueError, OSError, AttributeError):
        return {}
    from transformers import CONFIG_MAPPING, PretrainedConfig

    return {} if model_type in CONFIG_MAPPING else {"config": PretrainedConfig()}


__all__ = [
    "CONFIG_NAME",
    "PROJECT_KEY",
    "CheckpointError",
    "config_from_hf_dict",
    "detect_family",
    "hf_config_dict",
    "read_hf_config",
    "read_json",
    "tokenizer_load_options",
]
