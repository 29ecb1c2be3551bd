"""The ``triton-pair`` kernels as built (``mdlmpe_ds/attention/triton/pair_bias.py``), costed with
their own grids: an ESTIMATE to hold against the H100's measurements (``measured.py``).

``designs.pair_bias_layer`` costs the pair design as it was planned: a program owns 16 rows,
loops over a 512-position span in 32-position steps and handles all 32 pairs of a head per step.
The built kernels differ, and the H100 showed it matters (their backward pair kernels took 3.5-15x
the planned design's estimate):

- forward: one program per (8 x 16) tile of (query, key) positions; it computes alpha, beta once
  and loops over the heads and the pair chunks (16 pairs each), storing E per head;
- backward, query side: one program per 8 query rows, looping over every 16-key tile of the
  sequence (``splits`` > 1: over 1 / splits of them), and inside over the pair chunks and the heads;
- backward, key side: one program per 16 keys, looping over every 8-row tile, the pair chunks and
  the KV heads.

An iteration is one (tile, pair chunk, head): 8 x 16 x 16 (head, i, j, pair) elements. The
backward kernels stream dBias [H, L, L] (bf16, far larger than L2) once: each iteration's load
waits on HBM latency unless other resident warps hide it. alpha, beta (the phase MLP, and in the
query-side pass its backward) are computed once per tile and shared by the tile's iterations.
The kernels' resources are their compiled ones (``measured.BUILT_PAIR_RESOURCES``).
"""

from __future__ import annotations

import math

from gpu_cost.assumptions import Scenario
from gpu_cost.designs import PAIR_FP32, LayerEstimate, _add, bias_attention, per_pair_element
from gpu_cost.kernel_model import Launch, Resources, Work, launch_time
from gpu_cost.step import LLADA, NUM_MDLMPE

#: pair_launch_config for sm_90, bf16, d_h 128: 8 x 16 tiles, pairs in chunks of 16.
TILE_M, TILE_N, CHUNK = 8, 16, 16
KERNELS = ("pair_forward", "pair_backward_q", "pair_backward_k")


def built_launch(kernel: str, length: int, rec: dict, res: Resources, splits: int = 1) -> Launch:
    """One built pair kernel at ``length`` (batch 1, LLaDA-8B) as a ``Launch``; ``splits`` divides
    the backward kernels' serial loop over that many programs (a split-K grid)."""
    heads, m = LLADA["heads"], NUM_MDLMPE
    chunks = math.ceil(m / CHUNK)
    elems = TILE_M * TILE_N * CHUNK  # (head, i, j, pair) per iteration
    tile_elems = TILE_M * TILE_N
    rows, keys = math.ceil(length / TILE_M), math.ceil(length / TILE_N)
    if kernel == "pair_forward":
        programs, loop_tiles, latency = rows * keys, 1, "l2_latency"
    elif kernel == "pair_backward_q":
        programs, loop_tiles, latency = rows * splits, keys / splits, "hbm_latency"
    elif kernel == "pair_backward_k":
        programs, loop_tiles, latency = keys * splits, rows / splits, "hbm_latency"
    else:
        raise ValueError(f"kernel {kernel!r}: expected one of {KERNELS}")
    per_tile = chunks * heads  # iterations per (own tile, looped tile)
    fp32 = PAIR_FP32["pair_bias"][kernel] * elems / 32  # warp-instructions
    phase = per_pair_element(*rec["default"]["phase_forward"])
    if kernel == "pair_backward_q":
        back = per_pair_element(*rec["default"]["phase_backward"])
        phase = Work(
            issue=phase.issue + back.issue,
            fp32=phase.fp32 + back.fp32,
            alu=phase.alu + back.alu,
            mufu=phase.mufu + back.mufu,
            tensor_macs=_add(phase.tensor_macs, back.tensor_macs),
        )
    share = phase.scaled(tile_elems * m / per_tile)  # the tile's MLP spread over its iterations
    plane = tile_elems * 2  # the tile's E (stored per head) or dBias (read per head), bf16
    operands = (TILE_M + TILE_N) * CHUNK * 2 * 2  # the pair components of both sides, bf16
    own = TILE_N if kernel == "pair_backward_k" else TILE_M
    work = Work(
        issue=fp32 * 1.45 + share.issue,
        fp32=fp32 + share.fp32,
        alu=share.alu,
        mufu=share.mufu,
        tensor_macs=share.tensor_macs,
        shared_bytes=4.0 * elems,
        l2_bytes=operands + plane / chunks,
        atomics=0 if kernel == "pair_forward" else own * CHUNK * 2,
        spill_access_bytes=res.spill_bytes * res.warps * 32 * 0.5,
    )
    hbm = heads * length * length * 2  # E written, or dBias read, once
    return Launch(kernel, res, work, programs, loop_tiles * per_tile, hbm, Work(), runs=1, latency=latency)


def built_layer(length: int, sc: Scenario, rec: dict, res: Resources, splits: int = 1) -> LayerEstimate:
    """The ``triton-pair`` layer as built, fwd + bwd once (no recompute), SDPA as the bias
    attention: the quantities the H100 benchmark timed."""
    timings = [launch_time(built_launch(k, length, rec, res, splits), sc) for k in KERNELS]
    timings[1:1] = bias_attention(length, sc, "sdpa")
    glue = sc["glue_ms_2k"] * length / 2048
    return LayerEstimate(f"pair_bias built (splits {splits})", length, timings, glue, [res.source])


#: Changes to the built backward pair kernels the model is asked about: (label, splits,
#: register cap or None, stages or None).
CHANGES = (
    ("as first built and measured (no split, 1 CTA per SM)", 1, None, None),
    ("split the serial loop 4 ways (split-K)", 4, None, None),
    ("at most 128 registers (2 CTAs per SM)", 1, 128, None),
    ("both", 4, 128, None),
    ("both, and 2 pipelining stages", 4, 128, 2),
)


def changes_table(length: int, rec: dict, res: Resources) -> str:
    """docs/gpu.md's table: the model's central ms of the two backward pair kernels under each of
    ``CHANGES`` (an ESTIMATE)."""
    from dataclasses import replace

    sc = Scenario("central")
    lines = ["| change | key side | query side |", "|---|---|---|"]
    for label, splits, registers, stages in CHANGES:
        changed = replace(res, registers=registers or res.registers, stages=stages or res.stages)
        ms = [
            launch_time(built_launch(k, length, rec, changed, splits), sc).ms
            for k in ("pair_backward_k", "pair_backward_q")
        ]
        lines.append(f"| {label} | {ms[0]:.1f} | {ms[1]:.1f} |")
    now = configured_ms(length, rec, res, sc)
    lines.append(
        f"| as configured now: the launch rule's splits, the key side at 128 registers | "
        f"{now['pair_backward_k']:.1f} | {now['pair_backward_q']:.1f} |"
    )
    return "\n".join(lines)


def configured_ms(length: int, rec: dict, res: Resources, sc: Scenario) -> dict[str, float]:
    """The backward pair kernels under today's launch settings (``launch.pair_backward_splits`` at
    LLaDA-8B, batch 1, 132 SMs; the key side under ``key_max_registers`` with the 32 B of spill of
    its compile): ms per kernel, an ESTIMATE."""
    from dataclasses import replace

    from mdlmpe_ds.attention.triton.launch import PairLaunchConfig, pair_backward_splits

    config = PairLaunchConfig()
    splits = pair_backward_splits(
        config,
        length=length,
        batch=1,
        num_heads=LLADA["heads"],
        num_kv=LLADA["kv_heads"],
        num_pairs=NUM_MDLMPE,
        bias_itemsize=2,
        sms=int(sc["sms"]),
    )
    key_res = replace(res, registers=config.key_max_registers, spill_bytes=32)
    return {
        "pair_backward_q": launch_time(
            built_launch("pair_backward_q", length, rec, res, splits["q"][0]), sc
        ).ms,
        "pair_backward_k": launch_time(
            built_launch("pair_backward_k", length, rec, key_res, splits["k"][0]), sc
        ).ms,
    }
