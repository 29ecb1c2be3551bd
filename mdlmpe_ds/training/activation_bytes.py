"""The memory plan's activation model: bytes per token that one transformer layer keeps for backward and
what it holds while it runs, by attention backend and checkpointing, and the scored LM head's chunk.

Apart from the plan (memory_plan.py) because these terms are read off the code of the layer and of
each attention backend (counts of the tensors autograd keeps) and are checked one by one against a
measured layer (memory_measure.py; tests/unit/test_memory_plan.py, the Triton tests); the plan
multiplies them by the run's shape and adds the ZeRO-3 states.
"""

from __future__ import annotations

import dataclasses

from mdlmpe_ds.attention import planned_backend
from mdlmpe_ds.attention.blocked import eager_block_rows
from mdlmpe_ds.attention.impl import AttentionImpl
from mdlmpe_ds.attention.triton.launch import PairLaunchConfig, pair_chunking
from mdlmpe_ds.attention.triton.plan import pair_buffer_bytes
from mdlmpe_ds.models.config import ModelConfig
from mdlmpe_ds.models.recompute import Recompute
from mdlmpe_ds.training.head_chunks import DEFAULT_CHUNK

FP32 = 4


def backend_on(impl: AttentionImpl, device: str, cfg: ModelConfig) -> AttentionImpl:
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
        # (fp32, the pairs padded to whole chunks as on a GPU: pair_backend.pair_components)
        mc, nc = pair_chunking(len(range(1, cfg.head_dim // 2, 2)), PairLaunchConfig().pair_chunk, False)
        pairs = mc * nc
        repeated = 2 * p * hq if cfg.num_kv_heads != cfg.num_heads else 0
        return FP32 * cfg.num_heads + repeated + 2 * pairs * FP32 * (cfg.num_heads + cfg.num_kv_heads)
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
    impl = backend_on(impl or AttentionImpl(), device, cfg)
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
    impl = backend_on(impl or AttentionImpl(), device, cfg)
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


__all__ = ["FP32", "attention_transient_bytes", "backend_on", "head_bytes", "layer_activation_bytes"]
