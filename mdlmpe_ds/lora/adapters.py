"""LoRA SFT through `peft`: the spec (``--lora r=16,alpha=32,dropout=0.05,targets=q,k,v,o,gate,up,down``),
injection into our ``DiffusionLM``, the frozen backbone, and the maths and files of export.

What is trained: the low-rank adapters A [r, in], B [out, r] of the chosen projections and, in full,
every MDLMPE parameter (phase MLPs, W_p, b_p, the gate): those are new, so a low-rank delta of an
untrained weight makes no sense. Everything else (embeddings, norms, projections, LM head) is frozen.

The adapted projection computes ``W x + (alpha / r) B A dropout(x)``; merging writes
``W' = W + (alpha / r) B A`` [out, in], the same function in eval mode (dropout off).

peft wraps a projection ``q_proj`` as ``q_proj.base_layer`` (the original ``nn.Linear``) plus
``q_proj.lora_A.default`` / ``q_proj.lora_B.default``; ``base_name`` maps the wrapped names back to the
plain model's. Import peft before ``deepspeed.zero.Init`` is entered (``import_peft``): importing it
inside the context fails.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mdlmpe_ds.compat import stored_model_section
from mdlmpe_ds.distributed import engine as eng
from mdlmpe_ds.distributed import process_group
from mdlmpe_ds.lora.base import (  # noqa: F401  (re-exported: where the base is and which it is)
    IDENTITY_ATTR,
    base_file,
    base_identity,
    base_source,
    check_base_identity,
    file_sha256,
    find_base_file,
    load_base_file,
    recorded_base_identity,
)
from mdlmpe_ds.lora.spec import (  # noqa: F401  (re-exported: the spec's home)
    ADAPTER,
    BASE_FILE,
    CHECKPOINT_FILE,
    KEYS,
    MDLMPE_FILE,
    TARGET_ALIASES,
    TARGETS,
    LoraSpec,
    from_mapping,
    parse,
)
from mdlmpe_ds.models.hf_io import load_pretrained
from mdlmpe_ds.models.names import to_checkpoint_name
from mdlmpe_ds.models.transformer import _is_mdlmpe_name
from mdlmpe_ds.training import checkpoint as ckpt


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


# ---------------------------------------------------------------------------- export maths
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


# ---------------------------------------------------------------------------- checkpoints
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
    checkpoint must be of the same kind (LoRA or full), the same spec, and hold exactly the adapter
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
    if saved_spec != spec:
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


# ---------------------------------------------------------------------------- the trainer's call sites
def attach(model: nn.Module, run, ds_config: dict, resume_from: Path | None, params: dict, meta: bool) -> str:
    """For a LoRA run (``model.lora`` set; else nothing, returns ""): keep or restore the frozen base
    of a from-scratch model, inject the adapters (under zero.Init: engine.add_parameters), freeze
    the backbone; adds the trainable/frozen counts to ``params`` and returns the plan's LoRA line."""

    spec = spec_of(run)
    if spec is None:
        return ""
    if not meta and run.model.model_name_or_path is None:
        keep_base(model, run, resume_from)
    elif not meta:  # a pretrained directory: the one the checkpoint was trained on, recorded in each save
        source = Path(run.model.model_name_or_path)
        recorded = check_base_identity(resume_from, source) if resume_from is not None else None
        setattr(model, IDENTITY_ATTR, recorded or base_identity(source))
    if not meta:
        import_peft()  # before zero.Init: importing peft inside it fails
    # the adapters are created partitioned, then set to rank 0's deterministic draw (A
    # kaiming-uniform keyed by the seed and the module name, B = 0: the run starts at the base)
    eng.add_parameters(model, lambda m: inject(m, spec), ds_config, meta=meta)
    if not meta:
        reset_adapters(model, run.train.seed, eng.gathered_factory(), process_group.rank() == 0)
    counts = parameter_counts(model)
    params.update(counts)
    share = 100.0 * counts["trainable"] / max(1, counts["trainable"] + counts["frozen"])
    return (
        f"\nLoRA {spec.text()}: trainable {counts['trainable']:,} (adapters {counts['adapter']:,} + "
        f"MDLMPE {counts['mdlmpe']:,}), frozen {counts['frozen']:,} ({share:.2f}% trained)"
    )


def keep_base(model: nn.Module, run, resume_from: Path | None) -> None:
    """A from-scratch model's frozen base lives in no pretrained directory, and LoRA checkpoints do
    not hold it: a fresh run writes it once to ``output_dir/lora_base.safetensors`` (rank 0, atomic);
    a resumed run loads it from there (collective)."""
    from safetensors.torch import save_file

    names = [n for n, _ in model.named_parameters() if not is_mdlmpe_name(n)]
    if resume_from is None:
        tensors = eng.gathered_tensors(model, names)
        if tensors is not None:
            target = base_file(run.train.output_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, target)
            setattr(model, IDENTITY_ATTR, base_identity(target))  # recorded in every checkpoint (rank 0)
        process_group.barrier()
        return
    source = find_base_file(resume_from, ckpt.read_saved_run(resume_from).run_config)
    tensors = load_base_file(source)  # a truncated file is named as such first
    recorded = check_base_identity(resume_from, source)  # every rank: the same file, the same verdict
    if sorted(tensors) != sorted(names):
        missing = sorted(set(names) - set(tensors))
        raise ValueError(
            f"{source}: not this model's base (missing {missing[:5]}, has {len(tensors)} tensors)"
        )
    setattr(model, IDENTITY_ATTR, recorded or base_identity(source))
    eng.copy_into(model, tensors)


def memory_plan_kwargs(params: dict) -> dict[str, int]:
    """memory_plan.plan_memory's LoRA arguments (optimizer and gradients of trainable parameters
    only; the adapters added to the parameters); empty for a full fine-tune."""
    if "trainable" not in params:
        return {}
    return {"trainable_params": params["trainable"], "extra_params": params["adapter"]}


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
