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
Each kernel is costed with its own compiled resources (AOT sm_90, bf16, d_h 128): those of the
build the H100 timed (``MEASURED``), of the same kernels at ``.maxnreg`` 128 (``CAPPED``), and of
today's build (``CONFIGURED``: split loops, the key side capped).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from gpu_cost.assumptions import Scenario
from gpu_cost.designs import PAIR_FP32, LayerEstimate, bias_attention, pair_phase_work
from gpu_cost.kernel_model import Launch, Resources, Work, launch_time
from gpu_cost.step import LLADA, NUM_MDLMPE
from mdlmpe_ds.attention.triton.launch import PAIR_KERNELS, pair_backward_splits, pair_launch_config

#: The launcher's pair settings for sm_90, bf16, d_h 128 (8 x 16 tiles, pairs in chunks of 16).
CONFIG = pair_launch_config(LLADA["head_dim"], torch.bfloat16, 90)
TILE_M, TILE_N, CHUNK = CONFIG.tile_m, CONFIG.tile_n, CONFIG.pair_chunk
KERNELS = PAIR_KERNELS


def _compiled(registers: int, spill_bytes: int, build: str) -> Resources:
    """A pair kernel's AOT sm_90 compile: 8 warps, 1 stage, 40 KiB shared (all three kernels);
    two block-wide barriers per iteration assumed."""
    return Resources(8, 1, registers, spill_bytes, 40960, 2, source=f"AOT sm_90, {build}")


#: The build the H100 timed (no split, no register cap): registers and spill per thread.
MEASURED = {
    "pair_forward": _compiled(96, 0, "as measured"),
    "pair_backward_q": _compiled(255, 216, "as measured"),
    "pair_backward_k": _compiled(165, 0, "as measured"),
}
#: The same backward kernels compiled at .maxnreg 128.
CAPPED = {
    "pair_forward": MEASURED["pair_forward"],
    "pair_backward_q": _compiled(128, 1096, "maxnreg 128"),
    "pair_backward_k": _compiled(128, 24, "maxnreg 128"),
}
#: Today's build: split backward loops, the key side under key_max_registers (128).
CONFIGURED = {
    "pair_forward": MEASURED["pair_forward"],
    "pair_backward_q": _compiled(255, 224, "split loops"),
    "pair_backward_k": _compiled(CONFIG.key_max_registers, 32, "split loops, key side capped"),
}


def built_launch(
    kernel: str, length: int, sc: Scenario, rec: dict, res: Resources, splits: int = 1
) -> Launch:
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
    share = pair_phase_work(kernel, rec).scaled(tile_elems * m / per_tile)  # the tile's MLP, spread
    plane = tile_elems * 2  # the tile's E (stored per head) or dBias (read per head), bf16
    operands = (TILE_M + TILE_N) * CHUNK * 2 * 2  # the pair components of both sides, bf16
    own = TILE_N if kernel == "pair_backward_k" else TILE_M
    work = Work(
        issue=fp32 * sc["issue_overhead"] + share.issue,
        fp32=fp32 + share.fp32,
        alu=share.alu,
        mufu=share.mufu,
        tensor_macs=share.tensor_macs,
        shared_bytes=4.0 * elems,
        l2_bytes=operands + plane / chunks,
        atomics=0 if kernel == "pair_forward" else own * CHUNK * 2,
        spill_access_bytes=sc["spill_passes"] * res.spill_bytes * res.warps * 32,
    )
    hbm = heads * length * length * 2  # E written, or dBias read, once
    return Launch(kernel, res, work, programs, loop_tiles * per_tile, hbm, Work(), runs=1, latency=latency)


def built_layer(
    length: int, sc: Scenario, rec: dict, resources: dict[str, Resources] = MEASURED, splits: int = 1
) -> LayerEstimate:
    """The ``triton-pair`` layer, fwd + bwd once (no recompute), SDPA as the bias attention, each
    kernel with its ``resources``: by default the quantities the H100 benchmark timed."""
    timings = [launch_time(built_launch(k, length, sc, rec, resources[k], splits), sc) for k in KERNELS]
    timings[1:1] = bias_attention(length, sc, "sdpa")
    glue = sc["glue_ms_2k"] * length / 2048
    sources = sorted({r.source for r in resources.values()})
    return LayerEstimate(f"pair_bias built (splits {splits})", length, timings, glue, sources)


#: Changes to the measured backward pair kernels the model is asked about: (label, splits,
#: compiled resources, stages or None).
CHANGES = (
    ("as first built and measured (no split, 1 CTA per SM)", 1, MEASURED, None),
    ("split the serial loop 4 ways (split-K)", 4, MEASURED, None),
    ("at most 128 registers (2 CTAs per SM)", 1, CAPPED, None),
    ("both", 4, CAPPED, None),
    ("both, and 2 pipelining stages", 4, CAPPED, 2),
)
BACKWARD = ("pair_backward_k", "pair_backward_q")


def changes_table(length: int, rec: dict) -> str:
    """docs/gpu.md's table: the model's central ms of the two backward pair kernels under each of
    ``CHANGES`` and as configured now (an ESTIMATE)."""
    sc = Scenario("central")
    lines = ["| change | key side | query side |", "|---|---|---|"]
    for label, splits, resources, stages in CHANGES:
        ms = [
            launch_time(
                built_launch(k, length, sc, rec, replace(resources[k], stages=stages or 1), splits), sc
            ).ms
            for k in BACKWARD
        ]
        lines.append(f"| {label} | {ms[0]:.1f} | {ms[1]:.1f} |")
    now = configured_ms(length, rec, sc)
    lines.append(
        f"| as configured now: the launch rule's splits, the key side at 128 registers | "
        f"{now['pair_backward_k']:.1f} | {now['pair_backward_q']:.1f} |"
    )
    return "\n".join(lines)


def configured_ms(length: int, rec: dict, sc: Scenario) -> dict[str, float]:
    """The backward pair kernels as configured now (``CONFIGURED``, split by
    ``launch.pair_backward_splits`` at LLaDA-8B, batch 1, 132 SMs): ms per kernel, an ESTIMATE."""
    splits = pair_backward_splits(
        CONFIG,
        length=length,
        batch=1,
        num_heads=LLADA["heads"],
        num_kv=LLADA["kv_heads"],
        num_pairs=NUM_MDLMPE,
        bias_itemsize=2,
        sms=int(sc["sms"]),
    )
    side = {"pair_backward_q": "q", "pair_backward_k": "k"}
    return {
        k: launch_time(built_launch(k, length, sc, rec, CONFIGURED[k], splits[side[k]][0]), sc).ms
        for k in BACKWARD
    }
