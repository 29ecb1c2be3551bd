"""Every reading of an older layout, in one place: what a checkpoint or an export written by an
earlier version of this package holds, read as this version spells it. Each shim names the layout
it reads; nothing here is needed for what this version writes.

Layouts read here (newest first):

- checkpoint format 2 (``config.json`` "format": 2, this version): MANIFEST.json always written.
- checkpoints without "format" (format 0): written before manifests existed (no MANIFEST.json to
  verify against) and, the oldest, before the data fingerprint was recorded.
- model configs (a checkpoint's ``model_config``, an export's project block) that still hold the
  checkpointing switches (``gradient_checkpointing``, ``recompute_mdlmpe_attention``), which are
  run-time choices now (models/recompute.py).
- MDLMPE config blocks that still hold attention-implementation keys (``backend``,
  ``block_size``, ``triton_tile``, ``compile``, ``checkpoint_blocks``), which moved to the run's
  attention section, and blocks written before ``phase_mlp`` existed (every layer owned its MLP).
- run configs (a checkpoint's ``run_config``) without a ``model`` section.

Pure functions of plain dicts: every layer may read an old layout through here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# -------------------------------------------------------------------- checkpoint format (config.json)
# "format": 2 = the version that always writes MANIFEST.json (checkpoint.FORMAT, what this version
# writes); 0 = no "format" key (older).
MANIFEST_SINCE_FORMAT = 2


def manifest_required(format_version: int) -> bool:
    """Checkpoint format 0 (no "format" key) predates manifests: a missing MANIFEST.json is normal
    there; from format 2 on it is damage."""
    return format_version >= MANIFEST_SINCE_FORMAT


def recorded_data_fingerprint(meta: Mapping[str, Any]) -> str | None:
    """The data fingerprint of a checkpoint's ``config.json``; None in checkpoints written before it
    was recorded (their resume cannot check the data)."""
    return meta.get("data_fingerprint")


# -------------------------------------------------------------------- MDLMPE block of a model config
# Keys the MDLMPE config once had that say how the attention is computed, not what it computes;
# they moved to the run's attention section (attention.impl.AttentionImpl). None: removed (every
# block now recomputes its pair tensors). A new config naming one is an error that says where it
# went (pe/config.py); blocks stored by older checkpoints and exports drop them.
MDLMPE_MOVED_KEYS: dict[str, str | None] = {
    "backend": "attention.backend",
    "block_size": "attention.query_block",
    "triton_tile": "attention.tile",
    "compile": "attention.compile",
    "checkpoint_blocks": None,
}

# Keys added after checkpoints and exports were first written, with the value that computes what
# those (which lack the key) computed: a stored block without one reads as that value.
MDLMPE_ADDED_KEYS: dict[str, Any] = {"phase_mlp": "per_layer"}


def drop_moved_mdlmpe_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """A stored MDLMPE block without the keys of MDLMPE_MOVED_KEYS: what an old checkpoint or export
    stored there is a run-time choice, and the model is the same without it."""
    return {k: v for k, v in data.items() if k not in MDLMPE_MOVED_KEYS}


def read_stored_mdlmpe(data: Mapping[str, Any]) -> dict[str, Any]:
    """A stored MDLMPE block (a checkpoint's or an export's) as this version spells it: the moved
    keys dropped, the added keys it lacks filled with the value it computed with (so an old
    checkpoint compares equal to the same model configured today)."""
    return {**MDLMPE_ADDED_KEYS, **drop_moved_mdlmpe_keys(data)}


# -------------------------------------------------------------------- model config
# Keys older model configs held that are run-time choices now (models/recompute.py), with the run
# configuration key and the Recompute field that set them; a stored config loads without them.
MODEL_RUNTIME_KEYS: dict[str, tuple[str, str]] = {
    "gradient_checkpointing": ("model.gradient_checkpointing", "layers"),
    "recompute_mdlmpe_attention": ("model.recompute_mdlmpe_attention", "mdlmpe_attention"),
}


def read_stored_model_config(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(a stored model config as this version spells it, the keys dropped): a checkpoint's or an
    export's model config without the run-time keys older versions wrote into it
    (MODEL_RUNTIME_KEYS at the top), its MDLMPE block read by ``read_stored_mdlmpe``. The model is
    the same without them."""
    out = {k: v for k, v in data.items() if k not in MODEL_RUNTIME_KEYS}
    dropped = sorted(set(data) - set(out))
    if isinstance(out.get("mdlmpe"), dict):
        out["mdlmpe"] = read_stored_mdlmpe(out["mdlmpe"])
        dropped += [f"mdlmpe.{k}" for k in sorted(set(data["mdlmpe"]) - set(out["mdlmpe"]))]
    return out, dropped


# -------------------------------------------------------------------- run config
def stored_model_section(run_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``model`` section of a checkpoint's stored run config; older checkpoints may lack it."""
    return run_config.get("model") or {}
