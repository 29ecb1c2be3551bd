"""Hugging Face checkpoint directories: (sharded) safetensors read into a model and written from one.

The layout is the public checkpoints' own (docs/models.md §1-2): the family's ``config.json`` keys,
``model-0000K-of-0000N.safetensors`` shards with ``model.safetensors.index.json`` (or one
``model.safetensors``), and the exact upstream parameter names (``names.py``). Saving adds the
MDLMPE / absolute-position keys when the model has them, and a ``mdlmpe_ds`` block in config.json
with the project-only settings (position encoding, MDLMPE config); the config.json side is in
hf_config.py.

Loading is strict: every problem (missing shard file, missing or unexpected key, wrong shape,
config of the other family) is found before any weight is copied and reported with its name.
A checkpoint without any MDLMPE parameters (a RoPE base) gets them initialised as in docs/method.md
"Initialisation"; one missing only some of them (a damaged export) is refused, as is an integer
tensor for a float weight (it would be cast silently). Weights are
read one tensor at a time from memory-mapped files; ``gathered`` (e.g. ``deepspeed.zero.GatheredParameters``,
passed in by the engine) gathers one partitioned parameter at a time, so under ZeRO-3 no rank ever
holds the whole model.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mdlmpe_ds.attention.impl import AttentionImpl
from mdlmpe_ds.models.config import ModelConfig
from mdlmpe_ds.models.device import check_device
from mdlmpe_ds.models.hf_config import CONFIG_NAME, CheckpointError, hf_config_dict, read_hf_config, read_json
from mdlmpe_ds.models.names import from_checkpoint_name, to_checkpoint_name
from mdlmpe_ds.models.transformer import DiffusionLM, _is_mdlmpe_name

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
GatherFactory = Callable[..., contextlib.AbstractContextManager]


# ----------------------------------------------------------------------------------- weights
#: safetensors dtype names a weight may be stored in (it is cast to the model's dtype on load).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


@contextlib.contextmanager
def _open_safetensors(file: Path) -> Iterator[Any]:
    """``safe_open`` whose read errors name the file. A truncated or corrupt shard (an interrupted
    export or copy) otherwise surfaces as a bare "invalid header length" or "incomplete metadata,
    file not fully covered" from the Rust reader, which names no file."""
    try:
        with safe_open(file, framework="pt") as fh:
            yield fh
    except (SafetensorError, OSError) as err:
        size = file.stat().st_size if file.is_file() else 0
        raise CheckpointError(
            f"{file}: cannot read this safetensors file ({size} bytes): {err}; it is probably truncated "
            "or corrupt (re-export or copy it again)"
        ) from err


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it (index or single file); files must exist."""
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' in the index")
        missing = sorted({name for name in weight_map.values() if not (path / name).is_file()})
        if missing:
            raise CheckpointError(f"{index}: shard files listed in the index are missing: {missing}")
        return {key: path / name for key, name in weight_map.items()}
    single = path / SINGLE_NAME
    if single.is_file():
        with _open_safetensors(single) as fh:
            return dict.fromkeys(fh.keys(), single)
    raise CheckpointError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


def _expected_keys(model: DiffusionLM) -> dict[str, tuple[str, torch.nn.Parameter]]:
    """Checkpoint key -> (project name, parameter) for every parameter the checkpoint must hold."""
    family = model.config.family
    out = {}
    for name, param in model.named_parameters():  # tied lm_head is listed once, as embed.tokens
        out[to_checkpoint_name(name, family)] = (name, param)
    return out


def _shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))


def check_checkpoint(model: DiffusionLM, path: str | os.PathLike) -> tuple[dict[str, Path], list[str]]:
    """Strict check of a directory against ``model``: returns (key -> file, absent MDLMPE names).

    Raises ``CheckpointError`` listing missing keys, unexpected keys and shape mismatches.
    """
    path = Path(path)
    files = _checkpoint_files(path)
    expected = _expected_keys(model)
    family = model.config.family
    missing = [key for key in expected if key not in files]
    absent_mdlmpe = [expected[key][0] for key in missing if _is_mdlmpe_name(expected[key][0])]
    missing = [key for key in missing if not _is_mdlmpe_name(expected[key][0])]
    unexpected = sorted(key for key in files if key not in expected)
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {missing}")
    all_mdlmpe = sum(_is_mdlmpe_name(name) for name, _ in expected.values())
    if 0 < len(absent_mdlmpe) < all_mdlmpe:  # a RoPE base lacks all of them; a damaged export only some
        problems.append(
            f"missing MDLMPE keys ({len(absent_mdlmpe)}) while the others are there: {absent_mdlmpe} "
            "(only a checkpoint without any MDLMPE weights, a RoPE base, starts them from their "
            "initial values)"
        )
    if unexpected:
        hint = ""
        if all(from_checkpoint_name(key, family) is None for key in unexpected):
            other = "dream" if family == "llada" else "llada"
            if any(from_checkpoint_name(key, other) is not None for key in unexpected):
                hint = f" (these are {other} names: is config.json of the right family?)"
        problems.append(f"unexpected keys ({len(unexpected)}){hint}: {unexpected}")
    by_file: dict[Path, list[str]] = {}
    for key in expected:
        if key in files:
            by_file.setdefault(files[key], []).append(key)
    for file, keys in by_file.items():
        with _open_safetensors(file) as fh:
            held = set(fh.keys())
            stale = [key for key in keys if key not in held]
            if stale:  # the index points at a file without them: its weight_map is stale, not the file
                problems.append(
                    f"{INDEX_NAME} maps {len(stale)} keys to {file.name}, which does not hold them "
                    f"(the index is stale or from another export): {stale[:5]}"
                )
            for key in (k for k in keys if k in held):
                stored = fh.get_slice(key)
                got = tuple(stored.get_shape())
                want = _shape(expected[key][1])
                if got != want:
                    problems.append(f"wrong shape for {key} in {file.name}: checkpoint {got}, model {want}")
                if stored.get_dtype() not in FLOAT_DTYPES:  # an integer tensor would be cast silently
                    kind = stored.get_dtype()
                    problems.append(f"{key} in {file.name} is stored as {kind}, not a float type")
    if problems:
        raise CheckpointError(
            f"{path}: checkpoint does not match the {family} model:\n  " + "\n  ".join(problems)
        )
    return files, absent_mdlmpe


def _no_gather(params: Iterable[torch.nn.Parameter], modifier_rank: int | None = None):
    return contextlib.nullcontext()


@torch.no_grad()
def load_weights_into(
    model: DiffusionLM, path: str | os.PathLike, gathered: GatherFactory | None = None
) -> list[str]:
    """Copy a checkpoint directory into ``model`` one tensor at a time; returns the MDLMPE names that
    were absent and were initialised as in docs/method.md "Initialisation" instead.

    ``gathered(params, modifier_rank=0)`` is entered around each copy (ZeRO-3: gathers that one
    parameter on every rank, and rank 0's copy is scattered back on exit). Every rank reads the
    same tensor from the memory-mapped file, so all ranks hold identical values anyway.
    """
    gather = gathered or _no_gather
    files, absent_mdlmpe = check_checkpoint(model, path)
    expected = _expected_keys(model)
    by_file: dict[Path, list[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    if absent_mdlmpe:
        # 1. Fresh initial values (docs/method.md "Initialisation") for every MDLMPE parameter; the ones
        # present are overwritten below.
        model.reset_mdlmpe_parameters(gathered=gather)
    # 2. One tensor at a time, file by file.
    for file in sorted(by_file):
        with _open_safetensors(file) as fh:
            for key in by_file[file]:
                param = expected[key][1]
                with gather([param], modifier_rank=0):
                    param.copy_(fh.get_tensor(key).to(param.dtype))
    return absent_mdlmpe


def load_pretrained(
    path: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    impl: AttentionImpl | None = None,
    **overrides: Any,
) -> DiffusionLM:
    """Build the model described by ``path``/config.json (+ ``overrides``) and load its weights;
    ``impl``: how its MDLMPE attention runs (default ``AttentionImpl()``).

    The model is built on the meta device and materialised uninitialised (no random init of 8B
    parameters, one allocation in the target dtype); the strict check guarantees every backbone
    tensor is then overwritten, and absent MDLMPE parameters get their initial values (docs/method.md
    "Initialisation").
    """
    if device is not None:
        check_device(device)  # a device this machine lacks is named before any weight is read
    config = read_hf_config(path, **overrides)
    model = DiffusionLM(config, device="meta", impl=impl)
    if dtype is not None:
        model.to(dtype)
    model.to_empty(device=device if device is not None else "cpu")
    model.tie_weights()
    # Buffers are not in the checkpoint: restore their constructor values (all KV heads active).
    model.set_active_kv_heads(torch.ones(config.num_kv_heads, dtype=torch.bool))
    load_weights_into(model, path)
    return model


# ------------------------------------------------------------------------------------- saving
def _state_dict_of(
    model_or_state_dict: DiffusionLM | Mapping[str, torch.Tensor],
) -> Mapping[str, torch.Tensor]:
    if isinstance(model_or_state_dict, torch.nn.Module):
        return dict(model_or_state_dict.named_parameters())
    return model_or_state_dict


def save_pretrained(
    model_or_state_dict: DiffusionLM | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    config: ModelConfig,
    max_shard_bytes: int = 5 * 1024**3,
    extra_config: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write config.json and the weights under the upstream names (+ MDLMPE keys); returns the files.

    A state dict uses the project's names (``DiffusionLM.state_dict()`` or a ZeRO-3 consolidated
    one); with tied embeddings ``lm_head.weight`` is dropped as upstream. Several shards get
    ``model-0000K-of-0000N.safetensors`` and the index; one shard is written as ``model.safetensors``.
    """
    config.validate()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = _state_dict_of(model_or_state_dict)
    entries: list[tuple[str, torch.Tensor]] = []
    for name, tensor in state.items():
        if config.tie_embeddings and name == "lm_head.weight":
            continue
        entries.append((to_checkpoint_name(name, config.family), tensor))
    # 1. Plan the shards by byte size (order kept), then write one shard at a time.
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for key, tensor in entries:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, tensor))
        size += nbytes
    names = (
        [SINGLE_NAME]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    written = []
    for name, shard in zip(names, shards):
        # safetensors refuses shared or non-contiguous storage: give each tensor its own copy.
        tensors = {key: t.detach().to("cpu").contiguous().clone() for key, t in shard}
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        written.append(path / name)
    if len(shards) > 1:
        weight_map = {key: name for name, shard in zip(names, shards) for key, _ in shard}
        total = sum(t.numel() * t.element_size() for _, t in entries)
        with open(path / INDEX_NAME, "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
        written.append(path / INDEX_NAME)
    elif (path / INDEX_NAME).exists():
        (path / INDEX_NAME).unlink()  # a stale index from an earlier sharded save would shadow the file
    with open(path / CONFIG_NAME, "w") as fh:
        json.dump(hf_config_dict(config, extra_config), fh, indent=2)
    written.append(path / CONFIG_NAME)
    return written
