"""The RoPE baselines and the rest of the LLaDA-8B training step, with the run's recompute.

Gradient checkpointing is on by default (``model.gradient_checkpointing``): every layer's forward
runs twice (once more in backward), so the matmuls of the step cost 8 FLOPs per weight per token
(forward, recompute, 2x backward) instead of 6, and the RoPE attention, inside the checkpointed
segment, runs its forward twice. The MDLMPE attention stays outside that segment by default
(``models.recompute.Recompute.attention_outside_checkpoint``; ``recompute_mdlmpe_attention`` is
off): it runs forward once and backward once. The LM head runs on the scored (masked) positions
only, in checkpointed chunks (``models/scored_head.py``). Norms, embeddings, element-wise ops and
the optimizer are the same on both sides and left out (they lower the true ratio).

The RoPE attention is costed three ways: at published FlashAttention-3 rates (the target's
baseline), and at the two paths ``attention.common.rope_attention`` really takes through torch's
``scaled_dot_product_attention``: without padded keys (``key_valid`` is None) the flash backend
(FlashAttention-2 kernels); with a key-padding bias, which the flash backend does not take, the
memory-efficient backend.
"""

from __future__ import annotations

import itertools
import math

from gpu_cost.assumptions import Scenario

LLADA = dict(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=12288, vocab=126464)
#: MDLMPE pairs at d_h 128 (the odd f of F = 64).
NUM_MDLMPE = 32
#: FlashAttention-3 forward TFLOP/s by S (pytorch/benchmark PR 2391, H100 SXM, bf16, d 128,
#: non-causal); lengths between are interpolated in log S.
FA3_FWD_TFLOPS = {512: 430.0, 1024: 517.0, 2048: 566.0, 4096: 590.0, 8192: 614.0, 16384: 621.0}
#: Backward FLOPs over forward FLOPs of flash attention (5 tile products against 2).
BWD_FLOPS_RATIO = 2.5
#: Dense BF16 tensor-core peak of an H100 SXM5 (NVIDIA H100 whitepaper).
DENSE_BF16_FLOPS = 989.4e12
BASELINES = ("fa3", "sdpa_flash", "sdpa_mem_efficient")


def attention_flops(length: int, batch: int = 1) -> float:
    """Forward FLOPs of bidirectional attention of one layer: QK^T and PV, 2 * 2 * H * L^2 * d."""
    return 4.0 * batch * LLADA["heads"] * length**2 * LLADA["head_dim"]


def _interp(table: dict[int, float], length: int) -> float:
    keys = sorted(table)
    if length <= keys[0]:
        return table[keys[0]]
    if length >= keys[-1]:
        return table[keys[-1]]
    for lo, hi in itertools.pairwise(keys):
        if lo <= length <= hi:
            w = (math.log(length) - math.log(lo)) / (math.log(hi) - math.log(lo))
            return table[lo] + w * (table[hi] - table[lo])
    raise AssertionError("unreachable")


def attention_rates(baseline: str, length: int, sc: Scenario) -> tuple[float, float]:
    """(forward, backward) TFLOP/s of a RoPE attention path."""
    if baseline == "fa3":
        return _interp(FA3_FWD_TFLOPS, length) * sc["fa3_fwd_scale"], sc["fa3_bwd"]
    if baseline == "sdpa_flash":
        return sc["fa2_fwd"], sc["fa2_bwd"]
    if baseline == "sdpa_mem_efficient":
        return sc["mea_fwd"], sc["mea_bwd"]
    raise ValueError(f"baseline {baseline!r}: expected one of {BASELINES}")


def rope_layer_ms(baseline: str, length: int, sc: Scenario, recompute: bool = True) -> dict[str, float]:
    """ms of one layer's RoPE attention: forward (twice under checkpointing) and backward."""
    fwd_rate, bwd_rate = attention_rates(baseline, length, sc)
    flops = attention_flops(length)
    fwd = flops / (fwd_rate * 1e12) * 1e3
    bwd = BWD_FLOPS_RATIO * flops / (bwd_rate * 1e12) * 1e3
    runs = 2 if recompute else 1
    return {"forward_ms": fwd, "backward_ms": bwd, "layer_ms": runs * fwd + bwd, "bwd_over_fwd": bwd / fwd}


def rest_of_step_ms(length: int, sc: Scenario, recompute: bool = True) -> float:
    """Projections, SwiGLU and the LM head of one sequence, forward + backward (+ recompute), at
    the ``mfu`` of the dense BF16 peak (989 TFLOP/s)."""
    m = LLADA
    per_layer = 4 * m["hidden"] ** 2 + 3 * m["hidden"] * m["ffn"]
    flops_per_weight = 8 if recompute else 6
    body = flops_per_weight * m["layers"] * per_layer * length
    head = flops_per_weight * m["hidden"] * m["vocab"] * length * sc["scored_share"]
    return (body + head) / (DENSE_BF16_FLOPS * sc["mfu"]) * 1e3


def ratio_range(
    mdlmpe_layer_ms: dict[str, float], baseline: str, length: int, overrides: dict | None = None
) -> tuple[float, float, float]:
    """(low, central, high) step ratio. The MDLMPE kernels and the RoPE side (baseline rates, MFU,
    LM-head share) move the ratio in opposite directions, so the range is the lowest and highest
    ratio over every pair of (MDLMPE scenario, RoPE-side scenario); central is central / central.
    ``mdlmpe_layer_ms``: the MDLMPE layer's ms per scenario name."""
    from gpu_cost.assumptions import SCENARIOS

    ratios = [
        step_ratio(mdlmpe_layer_ms[a], baseline, length, Scenario(b, dict(overrides or {})))
        for a in SCENARIOS
        for b in SCENARIOS
    ]
    central = step_ratio(
        mdlmpe_layer_ms["central"], baseline, length, Scenario("central", dict(overrides or {}))
    )
    return min(ratios), central, max(ratios)


def step_ratio(
    mdlmpe_layer_ms: float, baseline: str, length: int, sc: Scenario, recompute: bool = True
) -> float:
    """Whole-step time with MDLMPE attention on every layer over the RoPE step."""
    rest = rest_of_step_ms(length, sc, recompute)
    rope = rope_layer_ms(baseline, length, sc, recompute)["layer_ms"]
    layers = LLADA["layers"]
    return (rest + layers * mdlmpe_layer_ms) / (rest + layers * rope)
