"""A LoRA run's model made ready by the run assembly: the frozen base kept or found again, the adapters
injected (partitioned under ZeRO-3) and drawn, the counts for the plan.

Apart from the adapters (adapters.py) because this is the one LoRA module over the engine and the
checkpoint format: it writes the from-scratch base once, reads it back on resume, and adds the
adapters through ``engine.add_parameters``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from torch import nn

from mdlmpe_ds.distributed import engine as eng
from mdlmpe_ds.distributed import process_group
from mdlmpe_ds.lora.adapters import (
    import_peft,
    inject,
    is_mdlmpe_name,
    parameter_counts,
    reset_adapters,
    spec_of,
)
from mdlmpe_ds.lora.base import (
    IDENTITY_ATTR,
    adopt_base,
    base_file,
    base_identity,
    check_base_identity,
    find_base_file,
    load_base_file,
)
from mdlmpe_ds.training import checkpoint as ckpt

log = logging.getLogger(__name__)


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
    a resumed run loads it from there (collective), and one resumed from another run's checkpoint
    copies it into its own output_dir (``adopt_base``)."""
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
    identity = recorded or base_identity(source)
    setattr(model, IDENTITY_ATTR, identity)
    eng.copy_into(model, tensors)
    if process_group.rank() == 0:  # another run's checkpoint: this run keeps its own copy
        copied = adopt_base(source, run.train.output_dir, identity)
        if copied is not None:
            log.info(
                f"copied the frozen LoRA base {source} to {copied}: this run no longer needs {source.parent}"
            )
    process_group.barrier()


def memory_plan_kwargs(params: dict) -> dict[str, int]:
    """memory_plan.plan_memory's LoRA arguments (optimizer and gradients of trainable parameters
    only; the adapters added to the parameters); empty for a full fine-tune."""
    if "trainable" not in params:
        return {}
    return {"trainable_params": params["trainable"], "extra_params": params["adapter"]}
