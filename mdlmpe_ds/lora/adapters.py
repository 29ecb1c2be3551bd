"""LoRA through `peft` on our ``DiffusionLM``: injection, the frozen backbone, the parameter names and counts,
and the adapters' initial draw.

What is trained: the low-rank adapters A [r, in], B [out, r] of the chosen projections and, in full,
every MDLMPE parameter (phase MLPs, W_p, b_p, the gate): those are new, so a low-rank delta of an
untrained weight makes no sense. Everything else (embeddings, norms, projections, LM head) is frozen.
The adapted projection computes ``W x + (alpha / r) B A dropout(x)``.

peft wraps a projection ``q_proj`` as ``q_proj.base_layer`` (the original ``nn.Linear``) plus
``q_proj.lora_A.default`` / ``q_proj.lora_B.default``; ``base_name`` maps the wrapped names back to the
plain model's. Import peft before ``deepspeed.zero.Init`` is entered (``import_peft``): importing it
inside the context fails.

The rest of LoRA builds on this module: ``spec`` (the ``--lora`` text), ``base`` (the frozen base
and its identity), ``export`` (merge and peft adapter directories), ``checkpoints`` (what a LoRA
checkpoint holds and how a resume is checked), ``attach`` (the run assembly's call: base, inject,
counts); this one needs neither the engine nor the checkpoint format.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mdlmpe_ds.compat import stored_model_section
from mdlmpe_ds.lora.spec import ADAPTER, TARGETS, LoraSpec, parse
from mdlmpe_ds.models.transformer import _is_mdlmpe_name


def spec_of(run_config) -> LoraSpec | None:
    """The run's spec (``model.lora``), None for a full fine-tune. Takes a RunConfig or its dict."""
    if isinstance(run_config, dict):  # a checkpoint's config.json (older ones may lack sections)
        text = stored_model_section(run_config).get("lora")
    else:
        text = run_config.model.lora
    return parse(text, "model.lora") if text else None


# ---------------------------------------------------------------------------- injection
def import_peft():
    """peft, imported before ``deepspeed.zero.Init`` is entered (its import fails inside it)."""
    import peft

    return peft


def target_pattern(spec: LoraSpec) -> str:
    """A full-match regex over module names: the chosen projections of every block, nothing else
    (never the nn.Linear layers inside the MDLMPE phase MLPs or the LM head)."""
    paths = "|".join(TARGETS[t].replace(".", r"\.") for t in spec.targets)
    return rf"layers\.\d+\.({paths})"


def peft_config(spec: LoraSpec, base_model: str | None = None):
    from peft import LoraConfig

    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=target_pattern(spec),
        bias="none",
        base_model_name_or_path=base_model,
    )


def inject(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """Wrap the target projections with LoRA adapters in place, then freeze all but adapters and
    MDLMPE. Under ZeRO-3 call it inside ``zero.Init`` (the adapters are partitioned like the rest)."""
    peft = import_peft()
    with warnings.catch_warnings():
        # under zero.Init peft's own init of A meets an already partitioned (empty) tensor; A and B
        # are set afterwards by reset_adapters
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
        peft.inject_adapter_in_model(peft_config(spec), model)
    freeze_backbone(model)
    return model


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_mdlmpe_name(name: str) -> bool:

    return _is_mdlmpe_name(name)


def is_trainable_name(name: str) -> bool:
    return is_adapter_name(name) or is_mdlmpe_name(name)


def freeze_backbone(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        param.requires_grad_(is_trainable_name(name))


def base_name(name: str) -> str:
    """``layers.0.attn.q_proj.base_layer.weight`` -> ``layers.0.attn.q_proj.weight``."""
    return name.replace(".base_layer.", ".")


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """{trainable, frozen, adapter, mdlmpe} element counts (full counts under ZeRO-3; tied once)."""
    out = {"trainable": 0, "frozen": 0, "adapter": 0, "mdlmpe": 0}
    for name, param in model.named_parameters():
        n = _numel(param)
        out["trainable" if param.requires_grad else "frozen"] += n
        if is_adapter_name(name):
            out["adapter"] += n
        elif is_mdlmpe_name(name):
            out["mdlmpe"] += n
    return out


def adapter_parameter_count(model_config, spec: LoraSpec) -> int:
    """Adapter elements r (in + out) per target per layer, from the model config (memory plan)."""
    d, hd = model_config.hidden_size, model_config.head_dim
    shapes = {
        "q": (d, model_config.num_heads * hd),
        "k": (d, model_config.num_kv_heads * hd),
        "v": (d, model_config.num_kv_heads * hd),
        "o": (model_config.num_heads * hd, d),
        "gate": (d, model_config.intermediate_size),
        "up": (d, model_config.intermediate_size),
        "down": (model_config.intermediate_size, d),
    }
    return model_config.num_layers * sum(spec.r * sum(shapes[t]) for t in spec.targets)


@torch.no_grad()
def reset_adapters(
    model: nn.Module,
    seed: int,
    gathered: Callable[..., Any] | None = None,
    is_rank0: bool = True,
) -> None:
    """A = kaiming-uniform (peft's default, a = sqrt(5)) from a generator seeded by ``seed`` and the
    module's name, B = 0: the adapted model starts as the base, and every rank holds rank 0's draw
    (``gathered(params, modifier_rank=0)`` under ZeRO-3; values set on rank 0 are scattered)."""
    pairs = [
        (name, module)
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and ADAPTER in getattr(module, "lora_A", {})
    ]
    for name, module in pairs:
        a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
        context = gathered([a, b], modifier_rank=0) if gathered else contextlib.nullcontext()
        with context:
            if is_rank0:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                value = torch.empty(a.shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)
                a.copy_(value.to(a.dtype))
                b.zero_()
