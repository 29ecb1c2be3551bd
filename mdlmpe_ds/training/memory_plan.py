"""Per-GPU memory plan of a ZeRO-3 training run (``--dry-run`` prints it), and the CPU measurement
that checks its activation terms.

Why: an 8B run either fits in 80 GB or dies minutes into the job; the plan says beforehand, for a
world size, micro-batch B and length L, what each GPU holds:

- ZeRO-3 states, 1/world of each: bf16 parameters, bf16 gradients, fp32 master weights + Adam m, v
  (``offload_param`` / ``offload_optimizer`` move them to CPU RAM, reported separately);
- gathered parameters: the largest module gathered at once (the LM head / embedding table) plus
  DeepSpeed's prefetch bucket, and the reduce bucket for gradients;
- activations, per layer per token, by kind (counts of the tensors autograd keeps, read off the
  code: see ``layer_activation_bytes``): with gradient checkpointing each layer keeps its
  checkpoint inputs (the layer input; with the attention kept outside the recomputed segment also
  q, k, v, the attention output and what the MDLMPE backend saves), and one layer at a time is
  recomputed in backward with all its activations; the blocked MDLMPE path adds a transient
  O(C L) pair working set per layer;
- the scored-positions LM head and fp32 cross-entropy (models/scored_head.py): one chunk of
  [chunk, V] logits, their fp32 copy and gradient;
- a fixed allowance for the CUDA context and allocator slack.

Every figure is the plan's estimate. The activation terms (activation_bytes.py) are checked against a
measured CPU run of a real-width layer (memory_measure.py: live tensor bytes through a dispatch mode, fp32) in
tests/unit/test_memory_plan.py and benchmarks/memory_plan_check.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mdlmpe_ds.attention.impl import AttentionImpl
from mdlmpe_ds.models.config import ModelConfig
from mdlmpe_ds.models.recompute import Recompute
from mdlmpe_ds.models.transformer import DiffusionLM
from mdlmpe_ds.training.activation_bytes import FP32, backend_on, head_bytes, layer_activation_bytes
from mdlmpe_ds.training.head_chunks import configured_chunk

GIB = 2**30
# CUDA context, cuBLAS/NCCL workspaces and caching-allocator fragmentation, typical on an H100.
CUDA_OVERHEAD_BYTES = 3 * GIB


# ------------------------------------------------------------------------------ the plan
@dataclass
class MemoryPlan:
    """Per-GPU bytes by item (``items``: (name, bytes, note)) and CPU RAM per node for offload."""

    world: int
    micro_batch: int
    length: int
    items: list[tuple[str, float, str]] = field(default_factory=list)
    cpu_items: list[tuple[str, float, str]] = field(default_factory=list)
    device: str = "GPU"

    @property
    def total(self) -> float:
        return sum(b for _, b, _ in self.items)

    def item(self, name: str) -> float:
        return next(b for n, b, _ in self.items if n == name)

    def format(self) -> str:
        lines = [
            f"memory plan per {self.device} (estimate): world {self.world}, "
            f"micro-batch {self.micro_batch} x L {self.length} tokens"
        ]
        for name, value, note in self.items:
            lines.append(f"  {name:<34} {value / GIB:8.2f} GiB  {note}")
        lines.append(f"  {'total':<34} {self.total / GIB:8.2f} GiB")
        for name, value, note in self.cpu_items:
            lines.append(f"  CPU RAM per rank: {name:<17} {value / GIB:8.2f} GiB  {note}")
        return "\n".join(lines)


def _parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(all parameters, the largest single module's parameters) from the meta-device model."""

    with torch.device("meta"):
        model = DiffusionLM(cfg)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in model.modules())
    return total, largest


def plan_memory(
    cfg: ModelConfig,
    ds_config: dict[str, Any],
    world: int,
    micro_batch: int,
    length: int,
    scored_fraction: float = 1.0,
    head_chunk: int | None = None,
    impl: AttentionImpl | None = None,
    recompute: Recompute | None = None,
    trainable_params: int | None = None,
    extra_params: int = 0,
    device: str = "cuda",
) -> MemoryPlan:
    """The plan for ``cfg`` under ``ds_config`` (after ``engine.prepare_ds_config``: bf16 or fp32,
    offload sections, buckets) on ``world`` GPUs, ``micro_batch`` sequences of ``length`` tokens.
    ``scored_fraction``: share of tokens in the loss (masked); 1.0 is the worst case.
    ``head_chunk``: rows per LM-head chunk (default: what training uses, ``configured_chunk()``).
    ``impl``: how the MDLMPE attention runs (default ``AttentionImpl()``); ``recompute``: the
    checkpointing (default ``Recompute()``: none).
    LoRA (mdlmpe_ds/lora/adapters.py): ``extra_params`` adapter elements are added to the parameters, and
    gradients and optimizer states are those of ``trainable_params`` only (default: all).
    ``device`` "cpu": the ranks are CPU processes, so no CUDA context allowance is added."""
    head_chunk = head_chunk or configured_chunk()
    impl = backend_on(impl or AttentionImpl(), "cuda", cfg)  # a plan per GPU
    recompute = recompute or Recompute()
    if world < 1 or micro_batch < 1 or length < 1:
        raise ValueError(
            f"memory plan needs world, micro-batch and L >= 1; got {world}, {micro_batch}, {length}"
        )
    zero = ds_config.get("zero_optimization", {})
    p = 2 if ds_config.get("bf16", {}).get("enabled") else FP32
    total, largest = _parameter_counts(cfg)
    total += extra_params
    shard = total / world
    trainable = total if trainable_params is None else trainable_params
    trained_shard = trainable / world
    off_param = zero.get("offload_param", {}).get("device", "none") not in ("none", None)
    off_optim = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    plan = MemoryPlan(world, micro_batch, length)
    dtype = "bf16" if p == 2 else "fp32"
    master = FP32 if p != FP32 else 0  # fp32 runs update the parameters themselves
    optim_bytes = trained_shard * (master + 2 * FP32)
    if off_param:
        plan.cpu_items.append(("parameters", shard * p, f"{dtype} shard ({total:,} / {world})"))
    else:
        plan.items.append(("parameters (ZeRO-3 shard)", shard * p, f"{dtype}, {total:,} / {world}"))
    if off_optim:
        plan.cpu_items.append(
            ("optimizer + grads", optim_bytes + trained_shard * p, "fp32 master, Adam m, v; grads")
        )
    else:
        trained = "" if trainable == total else f", {trainable:,} trainable"
        plan.items.append(("gradients (ZeRO-3 shard)", trained_shard * p, dtype + trained))
        plan.items.append(
            (
                "optimizer states (ZeRO-3 shard)",
                optim_bytes,
                ("fp32 master + " if master else "")
                + "Adam m, v fp32"
                + ("" if trainable == total else f" of {trainable:,} trainable"),
            )
        )
    prefetch = float(zero.get("stage3_prefetch_bucket_size", 5e7))
    reduce = float(zero.get("reduce_bucket_size", 5e8))
    live = float(zero.get("stage3_max_live_parameters", 1e9))
    plan.items.append(
        (
            "gathered parameters",
            # LoRA: the largest module (embedding table / LM head) is frozen, so it has no gradient
            min(live, largest + prefetch) * p + (largest * p if trainable == total else 0),
            f"largest module {largest:,} + prefetch {prefetch:,.0f}"
            + (", and its full gradient" if trainable == total else " (frozen: no gradient)"),
        )
    )
    plan.items.append(("gradient reduce bucket", reduce * p, f"reduce_bucket_size {reduce:,.0f}"))
    tokens = micro_batch * length
    per_layer = layer_activation_bytes(cfg, p, micro_batch, length, "cuda", impl, recompute)
    how = (
        "no checkpointing"
        if not recompute.layers
        else (
            "attention outside the checkpoint"
            if recompute.attention_outside_checkpoint(cfg.position_encoding, impl.keeps_pair_tensors)
            else "layer inputs"
        )
    )
    plan.items.append(
        (
            "activations kept (other layers)",
            (cfg.num_layers - 1) * tokens * per_layer["kept"],
            f"{per_layer['kept'] / 1024:.1f} KB/token/layer x {cfg.num_layers - 1} layers ({how})",
        )
    )
    backend = impl.backend if cfg.position_encoding == "mdlmpe" else "sdpa"
    plan.items.append(
        (
            "layer in backward (peak)",
            tokens * per_layer["peak"],
            f"{per_layer['peak'] / 1024:.1f} KB/token: kept + recomputed + grads + {backend} working set "
            f"{per_layer['transient'] / 1024:.1f}",
        )
    )
    features = tokens * (cfg.head_dim // 2) * FP32 * 4 if cfg.position_encoding == "mdlmpe" else 0
    plan.items.append(
        (
            "embeddings, features, grads of x",
            tokens * (3 * cfg.hidden_size * p) + features,
            "embedding output, two [B, L, d] gradients; MDLMPE A, D (fp32)",
        )
    )
    scored = max(1, round(tokens * scored_fraction))
    plan.items.append(
        (
            "LM head + CE (scored, chunked)",
            head_bytes(cfg, p, scored, head_chunk),
            f"{scored:,} scored tokens, chunks of {head_chunk} x V {cfg.vocab_size:,}",
        )
    )
    if device == "cpu":
        plan.device = "CPU rank"
    else:
        plan.items.append(("CUDA context, allocator slack", float(CUDA_OVERHEAD_BYTES), "allowance"))
    return plan


__all__ = ["CUDA_OVERHEAD_BYTES", "GIB", "MemoryPlan", "plan_memory"]
