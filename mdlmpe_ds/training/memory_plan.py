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

Every figure is the plan's estimate. The activation terms are checked against a measured CPU run
of a real-width layer (``measure_layer``: live tensor bytes through a dispatch mode, fp32) in
tests/unit/test_memory_plan.py and benchmarks/memory_plan_check.py.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from mdlmpe_ds.attention import planned_backend
from mdlmpe_ds.attention.blocked import eager_block_rows
from mdlmpe_ds.attention.impl import AttentionImpl
from mdlmpe_ds.attention.triton.backend import pair_buffer_bytes
from mdlmpe_ds.models.block import Block, LayerContext
from mdlmpe_ds.models.config import ModelConfig
from mdlmpe_ds.models.recompute import Recompute
from mdlmpe_ds.models.transformer import DiffusionLM, build_shared_phase
from mdlmpe_ds.pe.encoder import MDLMPEEncoder
from mdlmpe_ds.pe.rope import rotary_angles
from mdlmpe_ds.training.head_chunks import DEFAULT_CHUNK, configured_chunk

GIB = 2**30
# CUDA context, cuBLAS/NCCL workspaces and caching-allocator fragmentation, typical on an H100.
CUDA_OVERHEAD_BYTES = 3 * GIB
FP32 = 4


# ------------------------------------------------------------------------------ activation model
def _backend_on(impl: AttentionImpl, device: str, cfg: ModelConfig) -> AttentionImpl:
    """``impl`` with the backend ``auto`` resolved as the model will run it on ``device``, by the
    attention's own rule (attention.planned_backend: the fused Triton kernel on a GPU unless the
    coordinate is learned, the blocked path otherwise)."""
    return dataclasses.replace(impl, backend=planned_backend(impl.backend, device, cfg.mdlmpe))


def _bytes_per_token_attention_kept(cfg: ModelConfig, impl: AttentionImpl, p: int) -> float:
    """What the attention core keeps for backward when it runs outside the recomputed segment
    (``Recompute.attention_outside_checkpoint``), per token, besides q, k, v and its output."""
    hq = cfg.num_heads * cfg.head_dim
    hkv = cfg.num_kv_heads * cfg.head_dim
    stats = 2 * FP32 * cfg.num_heads  # the per-row max and log-sum of the softmax, fp32 per query head
    if impl.backend == "triton":
        return stats  # and q, k, v, out (already counted)
    if impl.backend == "triton-pair":  # SDPA's log-sum-exp, K, V repeated (GQA), the pair copies of q, k
        pairs = len(range(1, cfg.head_dim // 2, 2))
        repeated = 2 * p * hq if cfg.num_kv_heads != cfg.num_heads else 0
        return FP32 * cfg.num_heads + repeated + 2 * pairs * p * (cfg.num_heads + cfg.num_kv_heads)
    # blocked: fp32 copies of q, k, v (the pair path runs in fp32; the same tensors as q, k, v when
    # they are fp32 already), each block's fp32 output and softmax statistics, the key dims of the
    # MDLMPE pairs (k1, k2) and A, D transposed, made contiguous: what every block saves
    pairs = len(range(1, cfg.head_dim // 2, 2))
    copies = (0 if p == FP32 else FP32 * (hq + 2 * hkv)) + FP32 * hq
    pair_slices = 2 * pairs * cfg.num_kv_heads * FP32 + 2 * (cfg.head_dim // 2) * FP32
    return copies + pair_slices + stats


def layer_activation_bytes(
    cfg: ModelConfig,
    p: int,
    batch: int,
    length: int,
    device: str = "cpu",
    impl: AttentionImpl | None = None,
    recompute: Recompute | None = None,
) -> dict[str, float]:
    """Bytes per token of one layer, activations in ``p`` bytes per element (2 bf16, 4 fp32), on
    [batch, length]:

    ``kept``: what each layer keeps between its forward and its backward as configured
    (checkpointing on: its checkpoint inputs; off: ``full``);
    ``full``: everything one layer's forward keeps for backward when not checkpointed;
    ``peak``: the most this layer holds at once during its own backward (its kept tensors, the
    recomputed segment, activation gradients, the attention's working set), the other layers
    holding ``kept`` meanwhile.

    Counted from the code (models/transformer.py, models/layers.py, pe/rope.py, attention/*) as
    two segments, like the layer's ``checkpointed`` form: ``project`` (norm, q, k, v, rotary) and
    ``finish`` (o_proj, residual, norm, SwiGLU), around the attention. Backward runs the MLP part
    first (its gradients are the widest), then the attention with its pair working set. ``impl``:
    how the MDLMPE attention runs (default ``AttentionImpl()``); ``recompute``: the checkpointing
    (default ``Recompute()``: none).
    """
    impl = _backend_on(impl or AttentionImpl(), device, cfg)
    recompute = recompute or Recompute()
    d, m = cfg.hidden_size, cfg.intermediate_size
    hq = cfg.num_heads * cfg.head_dim
    hkv = cfg.num_kv_heads * cfg.head_dim
    upcast = 0 if p == FP32 else FP32  # x.float() is a copy only below fp32
    norm = upcast * d + p * d  # RMSNorm: the fp32 view of its input and the normalised output
    qkv = p * (hq + 2 * hkv)
    if cfg.uses_rotary and cfg.rope_fp32:  # LLaDA: fp32 copies of q, k, the fp32 result, its cast
        rotary = upcast * (hq + hkv) + FP32 * (hq + hkv) + (p * (hq + hkv) if p != FP32 else 0)
    elif cfg.uses_rotary:  # Dream: rotated in the activation dtype
        rotary = p * (hq + hkv)
    else:
        rotary = 0
    project = norm + qkv + rotary
    mdlmpe = cfg.position_encoding == "mdlmpe"
    if mdlmpe:  # the output and what the backend keeps
        attention = (
            p * hq + _bytes_per_token_attention_kept(cfg, impl, p) + _pair_bytes_saved(cfg, impl, length, p)
        )
    else:  # SDPA: output, log-sum-exp; GQA: k, v repeated to every query head
        attention = p * hq + FP32 * cfg.num_heads + (2 * p * hq if cfg.num_kv_heads != cfg.num_heads else 0)
    # o_proj input (heads merged: a copy), the residual h, norm, SwiGLU gate, silu, up, product, output
    finish = p * hq + p * d + norm + 4 * p * m + p * d
    full = project + attention + finish
    # activation gradients alive at the peak of each phase: SwiGLU's two [m] and one [d]; the
    # attention's output, q, k, v and input gradients (blocked MDLMPE: also fp32 ones of q, k, v)
    grads_mlp = p * (2 * m + d)
    grads_attention = p * (2 * hq + 2 * hkv + d)
    if mdlmpe and impl.backend == "triton-pair":  # fp32 pair gradients of q, k
        grads_attention += FP32 * (hq + hkv)
    elif mdlmpe and impl.backend != "triton":
        grads_attention += FP32 * (hq + 2 * hkv)
    transient = attention_transient_bytes(cfg, batch, length, device, impl, p) / (batch * length)
    attention_phase = grads_attention + transient
    if not recompute.layers:
        kept = full
        peak = max(full + grads_mlp, project + attention + attention_phase)
    elif recompute.attention_outside_checkpoint(cfg.position_encoding, impl.keeps_pair_tensors):
        # layer input, rotated q, k, v (first segment's outputs), the attention output (second
        # segment's input) and what the attention core keeps; one segment recomputed at a time
        kept = p * d + qkv + attention
        peak = kept + max(finish + grads_mlp, project + attention_phase)
    else:
        kept = p * d  # the layer input only; the whole layer is recomputed
        peak = kept + max(full + grads_mlp, project + attention + attention_phase)
    return {"kept": float(kept), "full": float(full), "peak": float(peak), "transient": float(transient)}


def _pair_bytes_saved(cfg: ModelConfig, impl: AttentionImpl, length: int, p: int = FP32) -> float:
    """Per token: the O(L) pair tensors a layer keeps when its MDLMPE attention saves them: the
    reference path ~8 fp32 [F] values per (i, j), fitted to measured layers at L = 128, 256;
    triton-pair the bias E that SDPA keeps, [Hq] per (i, j) in the activation dtype (p bytes)."""
    if impl.backend == "triton-pair":
        return float(p * cfg.num_heads * length)
    if impl.keeps_pair_tensors:
        return float(FP32 * 8 * (cfg.head_dim // 2) * length)
    return 0.0


def attention_transient_bytes(
    cfg: ModelConfig,
    batch: int,
    length: int,
    device: str = "cpu",
    impl: AttentionImpl | None = None,
    p: int = 2,
) -> float:
    """Working memory of one layer's attention beyond the per-token terms (transient, one layer at
    a time): the blocked MDLMPE path's fp32 pair tensors of one query block of C rows, about 12
    [B, C, |M|, L] fp32 tensors at the peak of its backward (alpha, beta, their gradients, the
    phase MLP's pieces; measured ~1.5 KB x C x L at d_h = 128, cf. the 1.4-1.7 KB of docs/method.md
    "Cost and precision"); the Triton kernels' alpha, beta and dE/d delta buffers, three
    [B, |M|, L, L] fp32 tensors bounded per launch by ``impl.pair_buffer_gib``; triton-pair's bias
    gradient dE, [B, Hq, L, L] in the activation dtype (``p`` bytes; its bias E, kept by SDPA, is
    counted per token). SDPA tiles on chip; paths that save their pair tensors count them per token
    (``_pair_bytes_saved``)."""
    if cfg.position_encoding != "mdlmpe":
        return 0.0
    impl = _backend_on(impl or AttentionImpl(), device, cfg)
    pairs = cfg.head_dim // 2
    if impl.backend == "triton":
        return float(pair_buffer_bytes(batch, length, len(range(1, pairs, 2)), impl.pair_buffer_bytes))
    if impl.backend == "triton-pair":
        return float(batch * cfg.num_heads * length * length * p)
    if _pair_bytes_saved(cfg, impl, length):  # saved: counted per token there
        return 0.0

    rows = impl.query_block
    if not impl.compile:
        hidden = cfg.mdlmpe.hidden_width(pairs)
        rows = eager_block_rows(impl.query_block, batch, length, pairs, hidden, cfg.num_heads, device)
    return float(batch * min(rows, length) * length * FP32 * 12 * len(range(1, pairs, 2)))


def head_bytes(cfg: ModelConfig, p: int, scored_tokens: int, chunk: int = DEFAULT_CHUNK) -> float:
    """The scored-positions head: the gathered [M, d] hidden rows and their norm, and at the peak of
    one chunk's backward recompute [n, V] logits in ``p`` bytes, their fp32 copy (below fp32), the
    fp32 log-softmax and the fp32 logit gradient (measured: 3 fp32 [n, V] tensors in an fp32 run,
    benchmarks/memory_plan_check.py)."""
    n = min(chunk, max(scored_tokens, 1))
    upcast = 0 if p == FP32 else FP32
    return float(2 * scored_tokens * cfg.hidden_size * p + n * cfg.vocab_size * (p + upcast + 2 * FP32))


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
    impl = _backend_on(impl or AttentionImpl(), "cuda", cfg)  # a plan per GPU
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


# ------------------------------------------------------------------------------ measuring on the CPU
class LiveTensorBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the tensor storages created under this mode and still alive: ``current``, and the
    ``peak`` since ``reset_peak``. Not counted: the storages of ``existing`` tensors (parameters,
    inputs, shared per-forward features; also when an op returns a view of them) and 2-D outputs
    with a parameter's element count (``ignore_numels``: weight gradients, listed separately)."""

    def __init__(self, existing: list[torch.Tensor] = (), ignore_numels: set[int] | None = None) -> None:
        super().__init__()
        self.ignore_numels = ignore_numels or set()
        self.current = self.peak = 0
        self._existing = {t.untyped_storage().data_ptr() for t in existing}
        self._seen: set[int] = set()

    def reset_peak(self) -> None:
        self.peak = self.current

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        for t in flat:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            if t.dim() == 2 and t.numel() in self.ignore_numels:
                continue
            storage = t.untyped_storage()
            key, nbytes = id(storage), storage.nbytes()
            if key in self._seen or nbytes == 0 or storage.data_ptr() in self._existing:
                continue
            self._seen.add(key)
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key, nbytes)
        return out


def measure_layer(
    cfg: ModelConfig,
    batch: int,
    length: int,
    seed: int = 0,
    impl: AttentionImpl | None = None,
    recompute: Recompute | None = None,
) -> dict[str, float]:
    """One real transformer layer of ``cfg`` (fp32, CPU, training mode, checkpointing as
    ``recompute`` says, default none) on [batch, length]: bytes per token of the tensors it keeps
    after forward (``kept``, the layer output standing in for the input it holds) and the peak of
    live tensors during its backward above what was kept (``backward``: the recomputed layer and
    the gradients)."""

    torch.manual_seed(seed)
    impl = impl or AttentionImpl()
    recompute = recompute or Recompute()
    block = Block(cfg, impl=impl, shared_phase=build_shared_phase(cfg)).train()
    # The layer's weights: its own, and the model's phase MLP when phase_mlp="shared".
    shared_mlp = block.attn.phase_mlp if block.attn.phase is None else None
    weights = [*block.parameters(), *(shared_mlp.parameters() if shared_mlp is not None else [])]
    ctx = LayerContext()
    ids = torch.randint(0, cfg.vocab_size, (batch, length))
    ids[:, ::3] = cfg.mask_token_id
    if cfg.uses_rotary:
        ctx.cos, ctx.sin = rotary_angles(length, cfg.head_dim, cfg.rope_theta)
    if cfg.position_encoding == "mdlmpe":
        encoder = MDLMPEEncoder(cfg.mdlmpe, cfg.head_dim, cfg.hidden_size, cfg.rope_theta, cfg.mask_token_id)
        with torch.no_grad():
            ctx.features = encoder.features(ids)
        for p in block.attn.phase_mlp.parameters():  # a non-zero residual, as after training starts
            torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(batch, length, cfg.hidden_size, requires_grad=True)
    grad = torch.randn(batch, length, cfg.hidden_size)
    numels = {p.numel() for p in weights if p.dim() == 2}
    shared = [x, grad, *weights, *(t for t in (ctx.cos, ctx.sin) if t is not None)]
    if ctx.features is not None:  # computed once per forward for every layer: not this layer's
        shared += [t for t in ctx.features if isinstance(t, torch.Tensor)]
    tracker = LiveTensorBytes(shared, numels)
    for p in weights:  # drop each weight gradient once formed (ZeRO-3 reduces it away)
        p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    with tracker:
        if recompute.layers:
            outside = recompute.attention_outside_checkpoint(cfg.position_encoding, impl.keeps_pair_tensors)
            y = block.checkpointed(x, ctx, outside)
        else:
            y = block(x, ctx)
        kept = tracker.current
        tracker.reset_peak()
        y.backward(grad)
        backward = tracker.peak - kept
    tokens = batch * length
    return {"kept": kept / tokens, "backward": backward / tokens}


__all__ = [
    "LiveTensorBytes",
    "MemoryPlan",
    "attention_transient_bytes",
    "head_bytes",
    "layer_activation_bytes",
    "measure_layer",
    "plan_memory",
]
