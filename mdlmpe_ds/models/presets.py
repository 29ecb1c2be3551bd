"""Named model configurations (docs/models.md §8, §1, paper Appendix B).

- ``llada-8b`` / ``dream-7b``: the public checkpoints' own ``config.json`` values; ``llada-8b-2layers``
  the same widths with 2 layers (GPU smoke runs).
- ``llada-100m`` / ``dream-100m``: the paper's from-scratch setting (hidden 768, 12 layers, 12 heads,
  4 KV heads, RMSNorm, SiLU, tied embeddings, L = 1024). The paper does not state the MLP width;
  3072 (4x, SMDM's 113M size) gives ~104M non-embedding parameters, the paper's "100M". The
  vocabulary is each family's native one (126,464 for LLaDA, as the paper says; 152,064 for Dream,
  whose mask id 151666 would not fit the smaller table). Special ids are the family's own.
- ``llada-tiny`` / ``dream-tiny``: a few hundred thousand parameters, for tests and the CPU demo
  (callers that bring their own tokenizer override ``vocab_size`` and the special ids).
- ``llada-mech``: d 96, 3 layers, 3 heads of d_h 32, L 256: the mechanism study's size.
"""

from __future__ import annotations

from typing import Any

from mdlmpe_ds.models.config import ModelConfig, check_model_keys
from mdlmpe_ds.pe.config import MDLMPEConfig

_LLADA_IDS = {"vocab_size": 126464, "mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081}
_DREAM_IDS = {"vocab_size": 152064, "mask_token_id": 151666, "eos_token_id": 151643, "pad_token_id": 151643}
_LLADA_NUMERICS = {"family": "llada", "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
_DREAM_NUMERICS = {"family": "dream", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
_TINY_IDS = {"vocab_size": 512, "mask_token_id": 511, "eos_token_id": 510, "pad_token_id": 510}

_PRESETS: dict[str, dict[str, Any]] = {
    # docs/models.md §1.1 (GSAI-ML/LLaDA-8B-{Base,Instruct} config.json).
    "llada-8b": {
        **_LLADA_NUMERICS,
        **_LLADA_IDS,
        "hidden_size": 4096,
        "num_layers": 32,
        "num_heads": 32,
        "num_kv_heads": 32,
        "intermediate_size": 12288,
        "max_seq_len": 4096,
        "tie_embeddings": False,
    },
    # docs/models.md §1.2 (Dream-org/Dream-v0-{Base,Instruct}-7B, Qwen2.5-7B layout).
    "dream-7b": {
        **_DREAM_NUMERICS,
        **_DREAM_IDS,
        "hidden_size": 3584,
        "num_layers": 28,
        "num_heads": 28,
        "num_kv_heads": 4,
        "intermediate_size": 18944,
        "max_seq_len": 131072,
        "tie_embeddings": False,
    },
    "llada-100m": {
        **_LLADA_NUMERICS,
        **_LLADA_IDS,
        "hidden_size": 768,
        "num_layers": 12,
        "num_heads": 12,
        "num_kv_heads": 4,
        "intermediate_size": 3072,
        "max_seq_len": 1024,
        "tie_embeddings": True,
    },
    "dream-100m": {
        **_DREAM_NUMERICS,
        **_DREAM_IDS,
        "hidden_size": 768,
        "num_layers": 12,
        "num_heads": 12,
        "num_kv_heads": 4,
        "intermediate_size": 3072,
        "max_seq_len": 1024,
        "tie_embeddings": True,
    },
    "llada-tiny": {
        **_LLADA_NUMERICS,
        **_TINY_IDS,
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 4,
        "intermediate_size": 192,
        "max_seq_len": 256,
        "tie_embeddings": False,
    },
    "dream-tiny": {
        **_DREAM_NUMERICS,
        **_TINY_IDS,
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 192,
        "max_seq_len": 256,
        "tie_embeddings": False,
    },
}

# The mechanism study (launch/mechanism_study.py): heads of d_h 32 (F = 16 rotary pairs),
# so that at L = 256 (W = 48) the MDLMPE basis varies inside the window; ~0.35M non-embedding parameters.
_PRESETS["llada-mech"] = {
    **_PRESETS["llada-tiny"],
    "hidden_size": 96,
    "num_layers": 3,
    "num_heads": 3,
    "num_kv_heads": 3,
    "intermediate_size": 256,
    "max_seq_len": 256,
}

# LLaDA-8B's widths cut to 2 layers (random init): the GPU runbook's 1-GPU smoke run (make gpu-check).
_PRESETS["llada-8b-2layers"] = {**_PRESETS["llada-8b"], "num_layers": 2}

PRESETS: tuple[str, ...] = tuple(_PRESETS)


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named configuration with ``overrides`` applied, validated.

    ``mdlmpe`` may be an ``MDLMPEConfig`` or a dict of its fields to change; MDLMPE's L_ref follows
    ``max_seq_len`` unless the override sets it explicitly.
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {PRESETS}")
    check_model_keys(overrides, f"preset {name!r} overrides")
    values = {**_PRESETS[name], **overrides}
    mdlmpe = values.pop("mdlmpe", None)
    if mdlmpe is None:
        mdlmpe = MDLMPEConfig(max_seq_len=values["max_seq_len"])
    elif isinstance(mdlmpe, dict):
        mdlmpe = MDLMPEConfig.from_dict({"max_seq_len": values["max_seq_len"], **mdlmpe})
    elif not isinstance(mdlmpe, MDLMPEConfig):
        raise TypeError(f"preset {name!r}: mdlmpe must be an MDLMPEConfig or a dict, got {type(mdlmpe)}")
    return ModelConfig(**values, mdlmpe=mdlmpe).validate()
