"""Checkpoint name maps: the project's module names <-> the exact upstream parameter names.

LLaDA (docs/models.md §2.1, ``modeling_llada.py``) and Dream (§2.2, Qwen2 naming), plus the extra keys
this project adds; MDLMPE keys never collide with upstream names:

project name                      LLaDA (model.transformer. ...)     Dream
embed.tokens.weight               wte.weight                         model.embed_tokens.weight
embed.positions.weight (abs.)     wpe.weight                         model.embed_positions.weight
embed.mdlmpe.*                    mdlmpe.*                           model.mdlmpe.*
shared_phase.* (phase_mlp shared) mdlmpe_phase.*                     model.mdlmpe_phase.*
layers.N.attn_norm.weight         blocks.N.attn_norm.weight          model.layers.N.input_layernorm.weight
layers.N.attn.{q,k,v}_proj.*      blocks.N.{q,k,v}_proj.*            model.layers.N.self_attn.{q,k,v}_proj.*
layers.N.attn.o_proj.weight       blocks.N.attn_out.weight           model.layers.N.self_attn.o_proj.weight
layers.N.attn.phase.*             blocks.N.mdlmpe_phase.*            model.layers.N.self_attn.mdlmpe_phase.*
layers.N.mlp_norm.weight          blocks.N.ff_norm.weight            model.layers.N.post_attention_layernorm.*
layers.N.mlp.gate_proj.weight     blocks.N.ff_proj.weight            model.layers.N.mlp.gate_proj.weight
layers.N.mlp.up_proj.weight       blocks.N.up_proj.weight            model.layers.N.mlp.up_proj.weight
layers.N.mlp.down_proj.weight     blocks.N.ff_out.weight             model.layers.N.mlp.down_proj.weight
norm.weight                       ln_f.weight                        model.norm.weight
lm_head.weight (untied only)      ff_out.weight                      lm_head.weight
"""

from __future__ import annotations

import re

# (project prefix, upstream prefix) pairs; the first matching prefix wins.
_TOP: dict[str, tuple[tuple[str, str], ...]] = {
    "llada": (
        ("embed.tokens.", "model.transformer.wte."),
        ("embed.positions.", "model.transformer.wpe."),
        ("embed.mdlmpe.", "model.transformer.mdlmpe."),
        ("shared_phase.", "model.transformer.mdlmpe_phase."),
        ("norm.", "model.transformer.ln_f."),
        ("lm_head.", "model.transformer.ff_out."),
    ),
    "dream": (
        ("embed.tokens.", "model.embed_tokens."),
        ("embed.positions.", "model.embed_positions."),
        ("embed.mdlmpe.", "model.mdlmpe."),
        ("shared_phase.", "model.mdlmpe_phase."),
        ("norm.", "model.norm."),
        ("lm_head.", "lm_head."),
    ),
}
_LAYER_PREFIX = {"llada": "model.transformer.blocks.", "dream": "model.layers."}
_LAYER: dict[str, tuple[tuple[str, str], ...]] = {
    "llada": (
        ("attn_norm.", "attn_norm."),
        ("attn.q_proj.", "q_proj."),
        ("attn.k_proj.", "k_proj."),
        ("attn.v_proj.", "v_proj."),
        ("attn.o_proj.", "attn_out."),
        ("attn.phase.", "mdlmpe_phase."),
        ("mlp_norm.", "ff_norm."),
        ("mlp.gate_proj.", "ff_proj."),
        ("mlp.up_proj.", "up_proj."),
        ("mlp.down_proj.", "ff_out."),
    ),
    "dream": (
        ("attn_norm.", "input_layernorm."),
        ("attn.phase.", "self_attn.mdlmpe_phase."),
        ("attn.", "self_attn."),
        ("mlp_norm.", "post_attention_layernorm."),
        ("mlp.", "mlp."),
    ),
}
_PROJECT_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _swap(name: str, table: tuple[tuple[str, str], ...], forward: bool) -> str | None:
    for ours, theirs in table:
        src, dst = (ours, theirs) if forward else (theirs, ours)
        if name.startswith(src):
            return dst + name[len(src) :]
    return None


def to_checkpoint_name(name: str, family: str) -> str:
    """Project parameter name -> upstream checkpoint key of ``family``."""
    match = _PROJECT_LAYER.match(name)
    if match:
        mapped = _swap(match.group(2), _LAYER[family], forward=True)
        if mapped is not None:
            return f"{_LAYER_PREFIX[family]}{match.group(1)}.{mapped}"
    else:
        mapped = _swap(name, _TOP[family], forward=True)
        if mapped is not None:
            return mapped
    raise KeyError(f"no {family} checkpoint name for model parameter {name!r}")


def from_checkpoint_name(key: str, family: str) -> str | None:
    """Upstream checkpoint key -> project parameter name, or None if it is not a key of ``family``."""
    prefix = _LAYER_PREFIX[family]
    if key.startswith(prefix):
        index, _, rest = key[len(prefix) :].partition(".")
        if not index.isdigit():
            return None
        mapped = _swap(rest, _LAYER[family], forward=False)
        return None if mapped is None else f"layers.{index}.{mapped}"
    return _swap(key, _TOP[family], forward=False)
