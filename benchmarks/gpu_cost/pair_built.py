"""The ``triton-pair`` kernels as built (``mdlmpe_ds/attention/triton/pair_bias.py``), costed with
their own grids at the launcher's settings: an ESTIMATE to hold against the H100's measurements
(``measured.py``).

``designs.pair_bias_layer`` costs the pair design as it was planned: a program owns 16 rows,
loops over a 512-position span in 32-position steps and handles all 32 pairs of a head per step.
The built kernels differ, and the H100 showed it matters (their first build's backward pair
kernels took 3.5-15x the planned design's estimate):

- forward: one program per (tile_m x tile_n) tile of (query, key) positions; it computes alpha,
  beta once and loops over the heads and the pair chunks (16 pairs each), storing E per head;
- backward, query side: one program per tile_m query rows and key split, looping over the
  tile_n-key tiles of its split, and inside over the pair chunks and the heads;
- backward, key side: one program per key_tile_n keys and row split, looping over the
  key_tile_m-row tiles of its split, the pair chunks and the KV heads.

Each kernel has its own tile, warps and register cap (``launch.pair_kernel_settings``; sm_90: the
forward and query side 16 x 8 / 8 warps, the key side 32 x 8 / 8 warps / 128 registers) and its
own compiled resources (AOT sm_90, bf16, d_h 128: ``BUILT``); the backward's splits are the
launch rule's (``launch.pair_backward_splits``). An iteration is one (tile, pair chunk, head):
tile_m x tile_n x 16 (head, i, j, pair) elements. The backward kernels stream dBias [H, L, L]
(bf16, far larger than L2) once: each iteration's load waits on HBM latency unless other resident
warps hide it. alpha, beta (the phase MLP, and in the query-side pass its backward) are computed
once per tile and shared by the tile's iterations.
"""

from __future__ import annotations

import math

import torch

from gpu_cost.assumptions import Scenario
from gpu_cost.designs import PAIR_FP32, LayerEstimate, bias_attention, pair_phase_work
from gpu_cost.kernel_model import Launch, Resources, Work, launch_time
from gpu_cost.step import LLADA, NUM_MDLMPE
from mdlmpe_ds.attention.triton.launch import (
    PAIR_KERNELS,
    pair_backward_splits,
    pair_chunking,
    pair_kernel_settings,
    pair_launch_config,
)

#: The launcher's pair settings for sm_90, bf16, d_h 128 (pairs in chunks of 16).
CONFIG = pair_launch_config(LLADA["head_dim"], torch.bfloat16, 90)
CHUNK = CONFIG.pair_chunk
KERNELS = PAIR_KERNELS
#: Each kernel's own settings (tile, warps, register cap) under ``CONFIG``.
SETTINGS = {k: pair_kernel_settings(CONFIG, k) for k in KERNELS}


def _compiled(kernel: str, registers: int, spill_bytes: int, shared_bytes: int) -> Resources:
    """A pair kernel's AOT sm_90 compile at its launch settings; two block-wide barriers per
    iteration assumed."""
    own = SETTINGS[kernel]
    return Resources(
        own.num_warps, 1, registers, spill_bytes, shared_bytes, 2,
        source=f"AOT sm_90, {own.tile_m} x {own.tile_n}, {own.num_warps} warps, maxnreg {own.max_registers}",
    )  # fmt: skip


#: Registers, spill stack (B per thread) and shared memory of each kernel **as the H100 timed it**
#: (2026-11-28: the kernels of commit 2192ab5, with bf16 pair components whose per-head loads were
#: redistributed through shared memory), compiled ahead of time for sm_90 at ``CONFIG`` with the
#: launch's integer specialisation (``aot._DIVISIBLE_INTS``). The model's comparisons with those
#: measurements (``measured.py``) cost this build; its code is no longer in the tree, so this is
#: a record (``MEASURED_BUILD_LOOPS`` has its per-head loops). Today's kernels: ``TODAY``.
BUILT = {
    "pair_forward": _compiled("pair_forward", 106, 0, 40960),
    "pair_backward_q": _compiled("pair_backward_q", 255, 280, 40960),
    "pair_backward_k": _compiled("pair_backward_k", 128, 168, 73728),
}
#: Today's kernels (fp32 component-major pair arrays, loaded already broadcast over the tile; see
#: ``pair_bias``) at ``CONFIG``: (registers, spill bytes per thread, shared bytes), checked against
#: a fresh AOT compile by tests/unit/test_triton_resources.py. Not yet timed on a GPU.
TODAY = {
    "pair_forward": (122, 0, 40960),
    "pair_backward_q": (255, 256, 40960),
    "pair_backward_k": (128, 160, 73728),
}


def _loop(instructions, fp32, barriers, shared, shuffles, global_loads, spill) -> dict[str, int]:
    return dict(
        instructions=instructions, fp32=fp32, barriers=barriers, shared=shared, shuffles=shuffles,
        global_loads=global_loads, spill=spill,
    )  # fmt: skip


#: Per warp, one pass of each per-head loop (``sass.body_summary`` of ``sass.innermost_loops``),
#: AOT sm_90, bf16, d_h 128, ``CONFIG``. Today every kernel has one, over the query heads (KV heads
#: in the key side) with both pair chunks inside; the timed build's backward kernels had one per
#: pair chunk (their chunk loop outside the head loop), so a head ran both. Per head and chunk a
#: thread owns tile_m x tile_n x 16 / 256 (i, j, pair) elements: 8 in the forward and the query
#: side (16 x 8 tiles), 16 in the key side (32 x 8). ``TODAY_LOOPS`` is checked against a fresh
#: compile; ``MEASURED_BUILD_LOOPS`` is the build the H100 timed. ``per_head`` sums a kernel's.
TODAY_LOOPS = {
    "pair_forward": [_loop(176, 124, 2, 2, 4, 12, 0)],
    "pair_backward_q": [_loop(461, 274, 4, 10, 96, 14, 0)],
    "pair_backward_k": [_loop(468, 289, 22, 27, 48, 17, 24)],
}
MEASURED_BUILD_LOOPS = {
    "pair_forward": [_loop(226, 122, 10, 21, 8, 4, 0)],
    "pair_backward_q": [_loop(282, 138, 5, 14, 48, 4, 0), _loop(282, 138, 5, 14, 48, 4, 0)],
    "pair_backward_k": [_loop(275, 153, 14, 24, 24, 3, 3), _loop(279, 153, 14, 24, 24, 3, 7)],
}


def per_head(loops: list[dict[str, int]]) -> dict[str, int]:
    """What one warp issues per head (KV head in the key side) over all pair chunks: the sum of a
    kernel's per-head loops (each runs once per head)."""
    return {key: sum(loop[key] for loop in loops) for key in loops[0]}


#: Warp-instructions per pass of each kernel's widest loop (``sass.executed_per_pass``: the whole
#: program of the forward; one looped tile of each backward kernel), the per-head loops run for
#: the 32 heads of LLaDA-8B: today's kernels (checked against a fresh compile) and the build the
#: H100 timed.
TODAY_EXECUTED = {"pair_forward": 7560, "pair_backward_q": 17691, "pair_backward_k": 18442}
MEASURED_BUILD_EXECUTED = {"pair_forward": 9134, "pair_backward_q": 20882, "pair_backward_k": 21404}


def launch_splits(length: int, sms: int) -> dict[str, int]:
    """The backward kernels' loop splits the launch rule picks (LLaDA-8B, batch 1, bf16)."""
    splits = pair_backward_splits(
        CONFIG,
        length=length,
        batch=1,
        num_heads=LLADA["heads"],
        num_kv=LLADA["kv_heads"],
        padded_pairs=math.prod(pair_chunking(NUM_MDLMPE, CONFIG.pair_chunk, interpreting=False)),
        bias_itemsize=2,
        sms=sms,
    )
    return {"pair_forward": 1, "pair_backward_q": splits["q"][0], "pair_backward_k": splits["k"][0]}


def built_launch(kernel: str, length: int, sc: Scenario, rec: dict, splits: int = 1) -> Launch:
    """One built pair kernel at ``length`` (batch 1, LLaDA-8B) as a ``Launch``, at its own tile with
    its ``BUILT`` resources; ``splits`` divides the backward kernels' serial loop over that many
    programs (a split-K grid)."""
    heads, m = LLADA["heads"], NUM_MDLMPE
    own, res = SETTINGS[kernel], BUILT[kernel]
    tile_m, tile_n = own.tile_m, own.tile_n
    chunks = math.ceil(m / CHUNK)
    elems = tile_m * tile_n * CHUNK  # (head, i, j, pair) per iteration
    tile_elems = tile_m * tile_n
    rows, keys = math.ceil(length / tile_m), math.ceil(length / tile_n)
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
    operands = (tile_m + tile_n) * CHUNK * 2 * 2  # the pair components of both sides, bf16
    owned = tile_n if kernel == "pair_backward_k" else tile_m
    work = Work(
        issue=fp32 * sc["issue_overhead"] + share.issue,
        fp32=fp32 + share.fp32,
        alu=share.alu,
        mufu=share.mufu,
        tensor_macs=share.tensor_macs,
        shared_bytes=4.0 * elems,
        l2_bytes=operands + plane / chunks,
        atomics=0 if kernel == "pair_forward" else owned * CHUNK * 2,
        spill_access_bytes=sc["spill_passes"] * res.spill_bytes * res.warps * 32,
    )
    hbm = heads * length * length * 2  # E written, or dBias read, once
    return Launch(kernel, res, work, programs, loop_tiles * per_tile, hbm, Work(), runs=1, latency=latency)


def built_layer(length: int, sc: Scenario, rec: dict) -> LayerEstimate:
    """The ``triton-pair`` layer as the benchmark runs it: fwd + bwd once (no recompute), SDPA as
    the bias attention, each kernel at its own tile with its ``BUILT`` resources and the launch
    rule's splits."""
    splits = launch_splits(length, int(sc["sms"]))
    timings = [launch_time(built_launch(k, length, sc, rec, splits[k]), sc) for k in KERNELS]
    timings[1:1] = bias_attention(length, sc, "sdpa")
    glue = sc["glue_ms_2k"] * length / 2048
    return LayerEstimate("pair_bias built", length, timings, glue, sorted({r.source for r in BUILT.values()}))
