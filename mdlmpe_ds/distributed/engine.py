"""Everything that touches DeepSpeed: config checks, the DeepSpeed process-group session, ZeRO-3
construction order, `deepspeed.initialize`, gather helpers. The only library module that imports
deepspeed; rank, world size and barriers are plain torch (distributed.py).

Construction order (why this module exists): the process group first, then the model is built
inside `deepspeed.zero.Init`, so every parameter -- backbone and MDLMPE alike -- is partitioned the
moment its module's `__init__` returns and the whole model never materialises on one rank;
pretrained weights are then streamed in one tensor at a time under `GatheredParameters`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mdlmpe_ds.config.run import RunConfig
from mdlmpe_ds.distributed import collectives
from mdlmpe_ds.distributed.process_group import on_cpu, rank


def _deepspeed():
    """Import deepspeed lazily (no work at import time) with the known CPU traps handled (below)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    # Trap: the first init_distributed JIT-compiles the shm all-reduce op (~35 s) on CPU; it is only
    # used by inference all-reduce, so mark it unavailable.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


# ---------------------------------------------------------------------------- process group
@contextlib.contextmanager
def distributed_session(timeout_min: float, setup_timeout_min: float | None = None) -> Iterator[None]:
    """init_distributed with a finite timeout (a collective reached by one rank fails instead of
    hanging 30 min), and destroy_process_group in a finally (avoids gloo's teardown abort).

    Also the gloo groups of `collectives` (host-tensor collectives; the data-setup barrier, which
    waits up to ``setup_timeout_min``, default ``timeout_min``)."""

    deepspeed = _deepspeed()
    backend = "gloo" if on_cpu() else "nccl"
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        # A plain `python launch/...py` (one rank, no launcher): a one-process group on this host.
        # Without these DeepSpeed falls back to MPI discovery, which needs mpi4py.
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(minutes=timeout_min))
    if not on_cpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    collectives.init(timeout_min, timeout_min if setup_timeout_min is None else setup_timeout_min)
    try:
        yield
    finally:
        collectives.reset()
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------- ds config
def _explicit(value: Any) -> bool:
    return value is not None and value != "auto"


#: What the training config's side of a mismatch means, where a number alone does not say it.
_AGREE_HINTS = {
    "gradient_clipping": "; optim.clip 0 (--clip 0) turns clipping off, as gradient_clipping 0 does",
}

#: DeepSpeed's Adam parameters that change the algorithm away from the AdamW this trainer runs
#: (deepspeed/runtime/engine.py:_configure_basic_optimizer, get_optimizer_configuration): key ->
#: (the value AdamW needs, what another value trains). DeepSpeed reads them by truthiness, and
#: "adam_w_mode": false under "type": "Adam" picks torch.optim.Adam / FusedAdam / CPUAdam in L2
#: mode (weight decay added to the gradient), which trains without a word otherwise.
ADAMW_PARAMS: dict[str, tuple[bool, str]] = {
    "adam_w_mode": (True, "Adam with L2 weight decay (added to the gradient, then scaled by Adam)"),
    "amsgrad": (False, "AMSGrad (a running maximum of the second moment)"),
    "bias_correction": (True, "Adam without bias correction of the moments"),
    "maximize": (False, "gradient ascent"),
}


def check_adamw_params(path: str | Path, kind: Any, params: dict[str, Any]) -> None:
    """Refuse, naming the key and its value, a ds config's optimizer parameter that would make
    DeepSpeed train another algorithm than AdamW with decoupled weight decay (ADAMW_PARAMS)."""
    for key in ADAMW_PARAMS:
        problem = _adamw_param_problem(key, params[key], kind) if key in params else None
        if problem:
            raise ValueError(
                f"{path}: optimizer.params.{key}={json.dumps(params[key])} {problem}; remove the key "
                f"or set it to {json.dumps(ADAMW_PARAMS[key][0])}"
            )


def _adamw_param_problem(key: str, given: Any, kind: Any) -> str | None:
    """Why ``given`` is refused (None: it is AdamW's value). A non-boolean (the string "false",
    which DeepSpeed reads as true) would not mean what it says. Under "type": "AdamW" DeepSpeed
    ignores adam_w_mode, but a false one still says the user meant Adam: refused as well."""
    needed, other = ADAMW_PARAMS[key]
    if not isinstance(given, bool):
        return "must be true or false (a JSON boolean: DeepSpeed reads any other value by its truthiness)"
    if given == needed:
        return None
    if key == "adam_w_mode" and str(kind).lower() == "adamw":
        what = f"asks for {other}, which contradicts optimizer.type {kind!r} (DeepSpeed ignores it there)"
    else:
        what = f"(optimizer.type {kind!r}) trains {other}"
    return f"{what}; this trainer's optimizer is AdamW with decoupled weight decay (optim.weight_decay)"


def prepare_ds_config(path: str | Path, run: RunConfig, world: int) -> dict[str, Any]:
    """Read the ds config, check it against the training config and fill its "auto" values.

    The training config owns the batch arithmetic and the optimizer hyper-parameters. A value the
    ds config sets explicitly must agree with it (else a clear error naming both numbers and both
    sources); "auto" or absent values are filled in. train_batch_size = micro x grad_accum x world.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config not found: {path}")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from err
    t, o = run.train, run.optim
    wanted = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world,
        "gradient_clipping": o.clip,
    }
    train_key = {
        "train_micro_batch_size_per_gpu": "train.micro_batch_size",
        "gradient_accumulation_steps": "train.grad_accum",
        "train_batch_size": f"train.micro_batch_size x train.grad_accum x world size {world}",
        "gradient_clipping": "optim.clip",
    }
    for key, value in wanted.items():
        given = ds.get(key)
        if _explicit(given) and not math.isclose(float(given), float(value)):
            raise ValueError(
                f"batch/optimizer mismatch: {path} sets {key}={given} but the training config gives "
                f'{train_key[key]} = {value}; make them agree (or set {key} to "auto" in {path})'
                f"{_AGREE_HINTS.get(key, '')}"
            )
        ds[key] = value
    stage = ds.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise ValueError(f"{path}: zero_optimization.stage must be 3 for this trainer, got {stage!r}")
    opt = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    if str(opt.get("type", "")).lower() not in ("adamw", "adam"):
        raise ValueError(f"{path}: optimizer.type must be AdamW, got {opt.get('type')!r}")
    params = opt.setdefault("params", {})
    check_adamw_params(path, opt.get("type"), params)
    for key, value in {
        "lr": run.lr,
        "betas": list(o.betas),
        "eps": o.eps,
        "weight_decay": o.weight_decay,
    }.items():
        given = params.get(key)
        if _explicit(given) and given != value:
            raise ValueError(f"{path}: optimizer.params.{key}={given} disagrees with optim.{key}={value}")
        params[key] = value
    if on_cpu():
        # Trap: without torch_adam DeepSpeed JIT-compiles FusedAdam (~100 s) on CPU.
        params["torch_adam"] = True
        if "offload_optimizer" in ds["zero_optimization"] or "offload_param" in ds["zero_optimization"]:
            raise ValueError(
                f"{path}: CPU offload configs are for GPU nodes; use ds_configs/zero3_cpu_test.json"
            )
    if "scheduler" in ds:
        raise ValueError(
            f"{path}: remove the 'scheduler' section: the trainer owns warmup + cosine (optim.*)"
        )
    precision = t.precision
    if precision == "auto":
        precision = "fp32" if on_cpu() else ("bf16" if ds.get("bf16", {}).get("enabled") else "fp32")
    if ds.get("fp16", {}).get("enabled"):
        raise ValueError(
            f"{path}: fp16 is not supported by this trainer (it needs dynamic loss scaling, which the "
            f'loop does not run; bf16 has fp32\'s range): set "fp16": {{"enabled": false}} and use '
            f"bf16 (train.precision bf16 or auto on a GPU) or fp32"
        )
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": precision == "bf16"}
    ds["fp16"] = {"enabled": False}
    ds.setdefault("steps_per_print", 10**9)
    return ds


def param_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    return torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32


def resolved_precision(ds_config: dict[str, Any]) -> str:
    """ "bf16" or "fp32": what train.precision (possibly "auto") resolved to in a config that
    ``prepare_ds_config`` prepared. A resume compares it with the checkpoint's record: the optimizer
    state DeepSpeed wrote differs between the two (``bf16_zero_pp_rank_*`` files in bf16)."""
    return "bf16" if param_dtype(ds_config) == torch.bfloat16 else "fp32"


# ---------------------------------------------------------------------------- model + engine
def build_model(
    model_factory: Callable[[], torch.nn.Module],
    ds_config: dict[str, Any],
    *,
    meta: bool = False,
) -> torch.nn.Module:
    """Build the model with ZeRO-3 partitioning live (every rank must call this: it is collective).

    `model_factory` constructs the full model (backbone + MDLMPE parameters) in one call, so every
    parameter is created inside the same `zero.Init` context. With meta=True it is built on the meta
    device instead (dry runs: counts parameters, allocates nothing).
    """
    if meta:
        with torch.device("meta"):
            return model_factory()
    deepspeed = _deepspeed()

    # pe/ modules initialise each parameter in the constructor of the layer that owns it, so the
    # values survive zero.Init partitioning each module as soon as its own __init__ returns.
    # dtype is left to the ds config on purpose. DeepSpeed 0.19.8's zero.Init._set_dtype
    # (runtime/zero/partition_parameters.py) evaluates, whenever an explicit dtype is passed,
    #   dtype or torch.float16 if fp16_supported() else torch.bfloat16 if is_bf16_supported else fp32
    # which parses as `(dtype or fp16) if fp16_supported() else (bf16 if ... else fp32)`: on a CPU
    # accelerator without fp16 support (AVX2-only AMD EPYC) an "fp32" run got bf16 parameters.
    # With dtype=None it reads bf16.enabled / fp16.enabled from the config, which prepare_ds_config set.
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = model_factory()
    check_param_dtypes(model, param_dtype(ds_config))
    # The MDLMPE phase MLP and embedding projection are read as raw tensors by another module's forward
    # (the attention kernels, the embedding path), not through their own forward, so ZeRO-3's module
    # hooks would never gather them: register them as external parameters of each module whose forward
    # reads them (gathered for its forward and its backward). The model lists the pairs: a shared
    # phase MLP is not a child of the layers that read it, and is registered with every one of them.
    for reader, param in getattr(model, "zero3_external_parameters", list)():
        deepspeed.zero.register_external_parameter(reader, param)
    return model


def add_parameters(
    model: torch.nn.Module,
    add: Callable[[torch.nn.Module], Any],
    ds_config: dict[str, Any],
    *,
    meta: bool = False,
) -> None:
    """``add(model)`` creates new parameters on a built model (LoRA adapters, mdlmpe_ds/lora/attach.py):
    inside ``zero.Init``, so they are partitioned like every other parameter and in the model's
    dtype (checked), or on the meta device for a dry run. Collective under ZeRO-3."""
    if meta:
        with torch.device("meta"):
            add(model)
        return
    deepspeed = _deepspeed()
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        add(model)
    check_param_dtypes(model, param_dtype(ds_config))


def copy_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (plain parameter names) into the partitioned model, one parameter at a time
    (every rank passes the same values; rank 0's are kept); a missing or unexpected name is an error."""
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise KeyError(f"no parameters named {unknown[:5]} in the model")
    deepspeed = _deepspeed()
    with torch.no_grad():
        for name, value in tensors.items():
            param = params[name]
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.copy_(value.to(param.dtype))


def gathered_tensors(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor] | None:
    """Full copies of the named parameters on rank 0 (None on the others), one gathered at a time;
    collective."""
    deepspeed = _deepspeed()
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] | None = {} if rank() == 0 else None
    for name in names:
        with deepspeed.zero.GatheredParameters([params[name]], modifier_rank=None):
            if out is not None:
                out[name] = params[name].detach().clone().cpu()
    return out


def check_param_dtypes(model: torch.nn.Module, expected: torch.dtype) -> None:
    """Fail loudly if any parameter was created in another dtype than the resolved precision
    (a DeepSpeed change, or an accelerator quirk, must never turn an fp32 run into bf16 silently)."""
    wrong = [(n, p.dtype) for n, p in model.named_parameters() if p.dtype != expected]
    if wrong:
        listed = ", ".join(f"{n}: {d}" for n, d in wrong[:5])
        raise RuntimeError(
            f"the model's parameters should be {expected} (train.precision and the ds config's bf16 "
            f"section) but {len(wrong)} are not ({listed}{', ...' if len(wrong) > 5 else ''}); DeepSpeed's "
            f"zero.Init picked another dtype on this accelerator"
        )


def init_mdlmpe_parameters(model: torch.nn.Module) -> None:
    """Re-run the MDLMPE initialisation (docs/method.md "Initialisation") on the gathered parameters, rank 0's
    values kept.

    Construction already gives these values; this makes every rank hold rank 0's draw of the
    randomly initialised MDLMPE layers (W1, W_p) before pretrained weights are streamed in.
    """
    names = set(model.mdlmpe_parameter_names())
    params = [p for n, p in model.named_parameters() if n in names]
    if not params:
        return
    deepspeed = _deepspeed()
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        if rank() == 0:
            model.reset_mdlmpe_parameters()


def gathered_factory() -> Callable[..., contextlib.AbstractContextManager]:
    """`GatheredParameters` for models/hf_io.load_weights_into, which calls it as
    `gathered(params, modifier_rank=0)` (keeps deepspeed out of models/)."""
    return _deepspeed().zero.GatheredParameters


@contextlib.contextmanager
def gathered(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Read-only full view of partitioned parameters on every rank (collective); every parameter is
    left as it was found.

    Parameters ZeRO-3 already holds whole (the "persistent" ones under
    stage3_param_persistence_threshold, i.e. all small MDLMPE weights with the shipped zero3.json)
    are not passed to GatheredParameters: its exit would partition them, the next forward would
    then fetch them through the module getter and register them as external parameters of another
    module, and the recorded fetch trace broke at the next update ("tracing error ... expected
    layers.0.attn.phase.fc1.weight"; seen on resume, where the trace is recorded after a log step).
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    deepspeed = _deepspeed()
    partitioned = [p for p in params if getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE]
    if not partitioned:
        yield
        return
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def warmup_cosine(warmup: int, total: int, cosine: bool, min_ratio: float) -> Callable[[int], float]:
    """lr multiplier at update n: linear warmup from 1/warmup to 1, then cosine down to min_ratio."""

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def initialize(model: torch.nn.Module, ds_config: dict[str, Any], run: RunConfig, total_updates: int):
    """deepspeed.initialize with the config's AdamW and our warmup + cosine LambdaLR.

    The scheduler is a LambdaLR stepped by DeepSpeed once per applied optimizer update; its
    `last_epoch` is in DeepSpeed's checkpoint, so resume continues the exact lr.
    """
    deepspeed = _deepspeed()
    factor = _lr_factor(run, total_updates)

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=copy.deepcopy(ds_config),
        lr_scheduler=scheduler,
    )
    return engine


def _lr_factor(run: RunConfig, total_updates: int) -> Callable[[int], float]:
    return warmup_cosine(
        run.warmup_updates(total_updates), total_updates, run.optim.cosine, run.optim.min_lr_ratio
    )


def apply_optim_settings(engine, run: RunConfig, total_updates: int) -> None:
    """After ``load_checkpoint``: DeepSpeed has restored the optimizer's param groups (lr, betas,
    eps, weight decay) and the LambdaLR's base lrs as they were saved, so a resume with a new
    optim.lr or schedule would silently continue the old one. Write this run's values back: the
    base lr, the schedule (warmup, cosine, floor, total) and the lr of the resumed update, computed
    as LambdaLR does (``base * factor(last_epoch)``), so unchanged settings give the same numbers."""
    scheduler = engine.lr_scheduler
    factor = _lr_factor(run, total_updates)
    groups = {id(g): g for opt in (scheduler.optimizer, engine.optimizer) for g in opt.param_groups}
    scheduler.base_lrs = [run.lr] * len(scheduler.optimizer.param_groups)
    scheduler.lr_lambdas = [factor] * len(scheduler.optimizer.param_groups)
    for group in groups.values():
        group.update(
            betas=tuple(run.optim.betas),
            eps=run.optim.eps,
            weight_decay=run.optim.weight_decay,
            initial_lr=run.lr,
        )
        group["lr"] = run.lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]


def consolidated_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The full (unpartitioned) state dict, gathered one parameter at a time; on rank 0, else None.

    Collective: every rank must call it. Peak memory on rank 0 is the model size in the parameter
    dtype (plus one gathered tensor), never the optimizer state.
    """
    module = engine.module
    out = gathered_tensors(module, [name for name, _ in module.named_parameters()])
    for name, buf in module.named_buffers():
        if out is not None and buf is not None and not name.endswith("inv_freq"):
            out[name] = buf.detach().clone().cpu()
    return out


@contextlib.contextmanager
def _chatter_on_stderr() -> Iterator[None]:
    """DeepSpeed's reports (zero_to_fp32's print calls, its logger, whose handler writes to the
    stdout of import time) go to stderr while this is open. Why: ``generate.py`` and
    ``evaluate.py`` keep stdout for their answers and tables, so ``generate.py ... > out.txt``
    must hold completions only, not "Processing zero checkpoint ..."."""
    import logging
    import sys

    with contextlib.redirect_stdout(sys.stderr):  # print(), and the import's own messages
        from deepspeed.utils import logger  # imported here: the accelerator warning on stderr

        moved = [
            h for h in logger.handlers if isinstance(h, logging.StreamHandler) and h.stream is not sys.stderr
        ]
        before = [h.setStream(sys.stderr) for h in moved]
        try:
            yield
        finally:
            for handler, stream in zip(moved, before, strict=True):
                handler.setStream(stream)


def fp32_state_dict_from_checkpoint(step_dir: Path) -> dict[str, torch.Tensor]:
    """Consolidate a ZeRO-3 checkpoint's fp32 master weights in one process (no process group),
    with DeepSpeed's zero_to_fp32 reader; its reports go to stderr (``_chatter_on_stderr``)."""
    with _chatter_on_stderr():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag="ds")


def load_universal_instructions(
    ckpt_dir: Path, saved_world: int, world: int, problems: Sequence[str] = ()
) -> str:
    """What to run when a checkpoint of another world size has no usable universal copy: convert it
    once, or, when a copy is there but ``problems`` (checkpoint.universal_problems) keep it from
    loading, rebuild it."""
    head = (
        f"checkpoint {ckpt_dir} was written by {saved_world} ranks but this run has {world}. "
        f"ZeRO-3 shards are tied to the data-parallel world size. "
    )
    command = f"  python launch/convert_checkpoint.py to-universal {ckpt_dir}\n"
    if problems:
        return (
            head
            + "Its universal copy cannot be loaded:\n  "
            + "\n  ".join(problems)
            + f"\nRebuild it with\n{command}(it replaces the copy; the checkpoint itself is intact), "
            f"then resume again."
        )
    return (
        head + f"Convert it once with\n{command}"
        f"(DeepSpeed's ds_to_universal), then resume again: the universal copy is picked up automatically."
    )


def ds_to_universal(src: Path, dst: Path) -> None:
    """DeepSpeed's ds_to_universal: the ZeRO-3 shards in `src` (one world size) as a universal
    checkpoint in the new folder `dst` (single process, no process group). Its options are given as
    the namespace its own parser builds (every option of the pinned DeepSpeed, at its default but
    the folders and one worker each), so nothing here reads or rewrites the process's argv.

    It writes `dst` in place (its scratch `tmp/` inside it) and a `latest_universal` file beside
    it, so a killed call leaves a partial folder: call it through
    ``checkpointer.write_universal``, which gives it a scratch folder and seals the result."""
    from deepspeed.checkpoint import ds_to_universal as tool

    options = argparse.Namespace(
        input_folder=str(src),
        output_folder=str(dst),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    tool.main(options)
