"""LoRA export: the maths of merging adapters into the base (W' = W + (alpha / r) B A [out, in], the same
function as the adapted model in eval mode) and the files of a peft-loadable adapter directory.

Apart from the adapters (adapters.py) because it reads checkpoints' consolidated states and writes
files, for ``launch/export.py`` and for evaluation's consolidation (``merged_state``), never during
training.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mdlmpe_ds.lora.adapters import (
    base_name,
    is_adapter_name,
    is_mdlmpe_name,
    peft_config,
    spec_of,
)
from mdlmpe_ds.lora.base import base_source, check_base_identity, load_base_file
from mdlmpe_ds.lora.spec import MDLMPE_FILE, TARGETS, LoraSpec
from mdlmpe_ds.models.hf_io import load_pretrained
from mdlmpe_ds.models.names import to_checkpoint_name


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """(base, adapters, mdlmpe) of a LoRA model's state dict: base under plain names, adapters as
    ``{module: (A, B)}``, MDLMPE under its names."""
    base, adapters, mdlmpe = {}, {}, {}
    for name, tensor in state.items():
        if is_adapter_name(name):
            module, rest = name.split(".lora_", 1)
            which = rest[0]  # "A" or "B"
            adapters.setdefault(module, {})[which] = tensor
        elif is_mdlmpe_name(name):
            mdlmpe[name] = tensor
        else:
            base[base_name(name)] = tensor
    for module, pair in adapters.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter of {module} is incomplete: has only lora_{''.join(pair)}")
    return base, {m: (p["A"], p["B"]) for m, p in adapters.items()}, mdlmpe


def merge(
    base: Mapping[str, torch.Tensor],
    adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    mdlmpe: Mapping[str, torch.Tensor],
    spec: LoraSpec,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The plain model's state dict: W' = W + (alpha / r) B A for each adapted projection (fp32
    maths), MDLMPE weights as trained, every other base tensor as is; all in ``dtype``."""
    out = {name: t.to(torch.float32) for name, t in base.items()}
    for module, (a, b) in adapters.items():  # a [r, in], b [out, r]
        key = f"{module}.weight"
        if key not in out:
            raise KeyError(f"the base has no {key} for the adapter of {module}")
        delta = (b.to(torch.float32) @ a.to(torch.float32)) * spec.scale  # [out, in]
        if delta.shape != out[key].shape:
            raise ValueError(
                f"adapter of {module}: B A is {tuple(delta.shape)}, {key} is {tuple(out[key].shape)}"
            )
        out[key] = out[key] + delta
    out.update({name: t.to(torch.float32) for name, t in mdlmpe.items()})
    return {name: t.to(dtype) for name, t in out.items()}


def _export_module(module: str, family: str | None) -> str:
    """A project module name (``layers.3.attn.q_proj``) as the module of the exported model that
    ``AutoModel`` builds (LLaDA ``model.transformer.blocks.3.q_proj``; models/names.py); as is when
    ``family`` is None (our own ``DiffusionLM``)."""
    if family is None:
        return module

    return to_checkpoint_name(f"{module}.weight", family)[: -len(".weight")]


def export_target_pattern(spec: LoraSpec, family: str) -> str:
    """``target_pattern`` over the exported model's module names: the same projections of every
    block, under the family's upstream names (which the official LLaDA / Dream code uses too)."""
    names = {_export_module(f"layers.0.{TARGETS[t]}", family) for t in spec.targets}
    prefix = _export_module("layers.0.attn.q_proj", family).rsplit(".0.", 1)[0]
    tails = sorted(re.escape(name[len(prefix) + len(".0.") :]) for name in names)
    return rf"{re.escape(prefix)}\.\d+\.({'|'.join(tails)})"


# The MDLMPE modules of an export (the embedding path and every layer's phase MLP): new weights of a
# LoRA run, trained in full, so the adapter carries them whole as peft ``modules_to_save``.
EXPORT_MDLMPE_MODULES = ["mdlmpe", "mdlmpe_phase"]


def peft_state_dict(
    adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    mdlmpe: Mapping[str, torch.Tensor] | None = None,
    family: str | None = None,
) -> dict[str, torch.Tensor]:
    """Adapter tensors under peft's saved names (``base_model.model.<module>.lora_A.weight``), the
    names ``PeftModel.from_pretrained`` / ``set_peft_model_state_dict`` read, with ``<module>`` the
    exported model's (``family``) or ours (None); ``mdlmpe`` weights as whole saved modules."""
    out = {}
    for module, (a, b) in adapters.items():
        name = _export_module(module, family)
        out[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        out[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    if family is not None:
        for name, tensor in (mdlmpe or {}).items():
            out[f"base_model.model.{to_checkpoint_name(name, family)}"] = tensor.contiguous()
    return out


def write_adapter_dir(
    out: str | Path,
    adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    mdlmpe: Mapping[str, torch.Tensor],
    spec: LoraSpec,
    base_model: str | None,
    dtype: torch.dtype = torch.float32,
    family: str | None = None,
    revision: str | None = None,
) -> list[Path]:
    """A peft-loadable adapter directory (adapter_config.json + adapter_model.safetensors) plus the
    trained MDLMPE weights (mdlmpe.safetensors, project names). Returns the files written.

    ``family`` set: addressed to the exported model's modules, so it loads with
    ``PeftModel.from_pretrained(AutoModel.from_pretrained(export, trust_remote_code=True), out)``,
    the MDLMPE modules carried as ``modules_to_save``; None: to our ``DiffusionLM``.
    ``base_model`` / ``revision``: what the run names as its base (a hub id, never a cache path)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(spec, base_model)
    config.revision = revision
    if family is not None:
        config.target_modules = export_target_pattern(spec, family)
        config.modules_to_save = list(EXPORT_MDLMPE_MODULES) if mdlmpe else None
    config.save_pretrained(str(out))
    tensors = {k: v.to(dtype) for k, v in peft_state_dict(adapters, mdlmpe, family).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    save_file(
        {k: v.to(dtype).contiguous() for k, v in mdlmpe.items()},
        str(out / MDLMPE_FILE),
        metadata={"format": "pt"},
    )
    return [out / "adapter_config.json", out / "adapter_model.safetensors", out / MDLMPE_FILE]


def merged_state(
    step_dir: Path, run_config: Mapping[str, Any], state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A checkpoint's consolidated state as the plain model's: for a LoRA run the base (read_base)
    with the adapters merged in and the trained MDLMPE weights; a full fine-tune's state as is."""
    spec = spec_of(run_config)
    if spec is None:
        return dict(state)
    _, adapters, mdlmpe = split_state(state)
    return merge(read_base(step_dir, run_config), adapters, mdlmpe, spec)


def read_base(step_dir: Path, run_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The frozen base of a LoRA checkpoint under plain names: the pretrained directory recorded as
    ``model.model_name_or_path``, or the preset run's ``lora_base.safetensors``."""

    source = base_source(step_dir, run_config)
    if run_config["model"].get("model_name_or_path") is None:
        tensors = load_base_file(source)  # a truncated file is named as such first
        check_base_identity(step_dir, source)  # the base it was trained on, not what the path holds now
        return tensors
    check_base_identity(step_dir, source)
    model = load_pretrained(source)
    return {name: p.detach() for name, p in model.named_parameters() if not is_mdlmpe_name(name)}
