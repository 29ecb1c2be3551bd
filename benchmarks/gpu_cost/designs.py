"""MDLMPE attention designs as lists of kernel launches per LLaDA-8B layer (batch 1): an ESTIMATE.

- ``current``: today's four kernels (``mdlmpe_ds/attention/triton/kernels.py``) at the launcher's
  sm_90 settings: phase_forward writes alpha, beta [|M|, L, L] fp32 (twice: forward and the
  backward's recompute), the forward and backward stream them per head group from L2 (16x and
  32x: the grid runs the 16 head groups of a tile together), the backward adds dE/d delta with
  atomics (16 head groups on the same lines at once), dQ with atomics, then phase_backward.
  Resources and counts: the recorded AOT compile (``recorded``).
- ``no_rewrite`` (c): the same kernels with alpha, beta in fp16, 8 warps and 2 stages (the warps
  and stages compiled: spills 1,992 -> 632 B in the backward, 800 -> 0 in the forward), the pair
  components loaded once per tile (assumed: the per-pair load -> barrier chain becomes one per
  tile, barriers / 32).
- ``pair_bias`` (a): a head-looped pair kernel computes alpha, beta once per (i, j) tile for all 32
  heads and writes the per-head correction E [H, L, L] bf16; a flash attention with an additive
  bias (SDPA memory-efficient with a float bias, or a Triton flash-with-bias) does the rest. The
  backward recomputes E, the attention's backward returns dE (dBias), and two pair kernels fold
  it: pass Q (a program owns 16 query rows of all heads: dq and d delta in registers / shared,
  the phase MLP's backward in registers) and pass K (owns 16 key rows: dk). No dE/d delta
  atomics; dq / dk partials of the key spans are added once per program.
- ``pair_bias_tc`` (b): (a) with the rank-2 pair products C = q_m.k_m, S = q_m x k_m and the dq / dk
  pair contractions on tensor cores (mma with ``mma_pad`` of its K / N slots used per pair).

The pair kernels of (a) and (b) do not exist yet: their resources (8 warps, 2 stages, no spills,
160 KiB shared, 2 barriers per iteration) and FP32 operation counts per (head, i, j, pair) are
stated assumptions below; pass a compiled kernel's resources (``recorded.from_compile``) to
replace them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from gpu_cost.assumptions import Scenario
from gpu_cost.kernel_model import Launch, Resources, Timing, Work, launch_time
from gpu_cost.sass import LoopCounts
from gpu_cost.step import BWD_FLOPS_RATIO, LLADA, NUM_MDLMPE, attention_flops
from mdlmpe_ds.attention.triton.launch import PHASE_KEY_SPAN, launch_config

DESIGNS = ("current", "no_rewrite", "pair_bias", "pair_bias_tc")
#: Attention with an additive bias used by the pair-bias designs.
BIAS_ATTENTION = ("triton", "sdpa")
#: Today's fused kernels at the launcher's sm_90 bf16 settings (d_h 128): the attention kernels'
#: tile and heads per program, the phase kernels' tile and key span.
_LAUNCH = launch_config(LLADA["head_dim"], torch.bfloat16, 90)
TILE, GROUP, PHASE_TILE, PHASE_SPAN = (
    _LAUNCH.tile,
    _LAUNCH.heads_per_program,
    _LAUNCH.phase_tile,
    PHASE_KEY_SPAN,
)
#: Heads per program of each recorded variant (``recorded.VARIANTS``): the no-rewrite tune-up
#: ("w8s2") was designed at 2.
VARIANT_GROUP = {"default": GROUP, "w8s2": 2}

#: FP32 operations per (head, i, j, pair) the pair kernels of (a) and (b) execute (counted from the
#: algebra: E = alpha C + beta S with C, S 2 FMAs each; backward a = dE alpha, b = dE beta, dq / dk
#: 2 FMAs per component, d delta = dE (-beta C + (1 + alpha) S)); (b) leaves on CUDA cores what
#: the MMAs cannot do (the alpha / beta weighting, conversions).
PAIR_FP32 = {
    "pair_bias": {"pair_forward": 6.0, "pair_backward_q": 13.0, "pair_backward_k": 6.0},
    "pair_bias_tc": {"pair_forward": 2.0, "pair_backward_q": 6.0, "pair_backward_k": 3.0},
}
#: Rank-2 products per (head, i, j, pair) each pair kernel of (b) puts on tensor cores (each uses
#: ``mma_pad`` MACs): C and S; the dq (pass Q) or dk (pass K) contraction of a and b.
PAIR_MMAS = {"pair_forward": 2, "pair_backward_q": 4, "pair_backward_k": 2}
#: Shared-memory operand bytes per (head, i, j, pair): (a) reads q / k pair components per FMA
#: group; (b) feeds them to MMAs from shared memory once per tile.
PAIR_SHARED = {"pair_bias": 4.0, "pair_bias_tc": 0.5}
PAIR_OWN, PAIR_LOOP, PAIR_SPAN = 16, 32, 512
ASSUMED_PAIR_RESOURCES = Resources(
    warps=8,
    stages=2,
    registers=255,
    spill_bytes=0,
    shared_bytes=160 * 1024,
    barriers=2,
    source="assumed (not built): 8 warps, 2 stages, no spills, 160 KiB shared, 2 barriers/iteration",
)


@dataclass
class LayerEstimate:
    """One design's per-layer estimate at one length: kernel timings and torch glue."""

    design: str
    length: int
    timings: list[Timing]
    glue_ms: float
    notes: list[str] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return sum(t.ms for t in self.timings) + self.glue_ms


def counts_work(res: Resources, counts: LoopCounts) -> Work:
    """Per-iteration work of a compiled kernel (its SASS counts are per warp)."""
    w, c = res.warps, counts.counts
    return Work(
        issue=counts.total * w,
        fp32=c["fp32"] * w,
        alu=c["alu"] * w,
        mufu=c["mufu"] * w,
        tensor_macs={k: v * w for k, v in counts.tensor_macs.items()},
        shared_bytes=(counts.lsu_bytes - counts.spill_bytes) * w,
        spill_access_bytes=counts.spill_bytes * w,
    )


def phase_grid(length: int) -> tuple[int, float]:
    """(programs, iterations each) of a phase kernel: the upper half of the [L/16]^2 tile plane in
    key spans of 256 positions (``triton.launch.phase_key_span``)."""
    rows = math.ceil(length / PHASE_TILE)
    span = max(1, min(rows, PHASE_SPAN // PHASE_TILE))
    programs = sum(math.ceil((rows - t) / span) for t in range(rows))
    return programs, rows * (rows + 1) / 2 / programs


def per_pair_element(res: Resources, counts: LoopCounts) -> Work:
    """Work per (i, j, pair) of a phase kernel (one iteration: a 16 x 16 tile, all pairs)."""
    return counts_work(res, counts).scaled(1.0 / (PHASE_TILE**2 * NUM_MDLMPE))


def current_layer(
    length: int, sc: Scenario, rec: dict, variant: str = "default", shape: tuple[int, int] | None = None
) -> LayerEstimate:
    """Today's four kernels (variant "default") or the no-rewrite tune-up (variant "w8s2");
    ``shape`` = (tile, heads per program) with a ``rec`` variant compiled at them: the attention
    kernels at another launch setting (the H100 sweep's, ``measured.sweep_model_rows``)."""
    heads, d, m = LLADA["heads"], LLADA["head_dim"], NUM_MDLMPE
    tile, group = shape or (TILE, VARIANT_GROUP[variant])
    lp = math.ceil(length / tile) * tile
    tiles, groups = lp // tile, heads // group
    tuned = variant == "w8s2"
    ab = 2 if tuned else 4  # bytes of one alpha / beta element
    plane = m * lp * lp  # elements of one [|M|, L, L] pair plane
    qkvo = 4 * heads * length * d * 2
    out = []
    res, counts = rec["default"]["phase_forward"]
    programs, iters = phase_grid(lp)
    work = replace(counts_work(res, counts), l2_bytes=2 * 2 * PHASE_TILE**2 * m * ab)  # tile + mirror
    out.append(Launch("phase_forward", res, work, programs, iters, 2 * plane * ab, runs=2))
    for kernel, reloads in (("forward", 1), ("backward", 2)):
        res, counts = rec[variant][kernel]
        if tuned:
            res = replace(res, barriers=res.barriers / 32, source=res.source + "; barriers / 32 assumed")
        operands = 2 * group * tile * d * 2 + group * tile * (d // 2) * 4  # two bf16 tiles, pair parts
        work = replace(counts_work(res, counts), l2_bytes=reloads * 2 * m * tile**2 * ab + operands)
        hbm = 2 * plane * ab + qkvo
        if kernel == "backward":
            # d delta (16 head groups on the same lines at once), dQ + dqp (the key tiles resident
            # together, ~SMs / groups), dkp (this program only).
            adds = [
                (m * tile**2, groups),
                (group * tile * (d + 2 * m), sc["sms"] / groups),
                (group * tile * m * 2, 1),
            ]
            total = sum(a for a, _ in adds)
            work = replace(work, atomics=total, atomic_degree=sum(a * g for a, g in adds) / total)
            hbm += 2 * plane * 4
        prologue = Work(issue=counts.outside * res.warps)
        out.append(Launch(kernel, res, work, tiles * groups, tiles, hbm, prologue))
    res, counts = rec["default"]["phase_backward"]
    work = replace(counts_work(res, counts), l2_bytes=2 * PHASE_TILE**2 * m * 4)
    out.append(Launch("phase_backward", res, work, programs, iters, plane * 4))
    out.append(Launch("zero_ddelta", res, Work(), int(sc["sms"]), 0, plane * 4))
    name = "no_rewrite" if tuned else "current"
    glue = sc["glue_ms_2k"] * length / 2048
    return LayerEstimate(name, length, [launch_time(x, sc) for x in out], glue)


def _add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}}


def pair_phase_work(kernel: str, rec: dict) -> Work:
    """The phase MLP's work per (i, j, pair) inside pair kernel ``kernel``: the recorded phase
    forward (ratio, angle, MLP, alpha, beta), plus the recorded phase backward in the query-side
    backward, which runs the MLP's backward there."""
    phase = per_pair_element(*rec["default"]["phase_forward"])
    if kernel != "pair_backward_q":
        return phase
    back = per_pair_element(*rec["default"]["phase_backward"])
    return replace(
        phase,
        issue=phase.issue + back.issue,
        fp32=phase.fp32 + back.fp32,
        alu=phase.alu + back.alu,
        mufu=phase.mufu + back.mufu,
        tensor_macs=_add(phase.tensor_macs, back.tensor_macs),
        spill_access_bytes=0.0,
    )


def _pair_launch(kernel: str, design: str, length: int, sc: Scenario, rec: dict, res: Resources) -> Launch:
    """One head-looped pair kernel of design (a) or (b): a program owns PAIR_OWN rows (query rows
    for pair_forward / pass Q, key rows for pass K) of every head, loops over a span of PAIR_SPAN
    positions in PAIR_LOOP tiles and, inside, over the 32 heads; alpha, beta of a tile are
    computed once (the phase kernel's measured work per (i, j, pair)) and used for every head."""
    heads, m = LLADA["heads"], NUM_MDLMPE
    span = min(PAIR_SPAN, length)
    programs = math.ceil(length / PAIR_OWN) * math.ceil(length / span)
    iters = math.ceil(span / PAIR_LOOP) * heads
    elems = PAIR_OWN * PAIR_LOOP * m  # (head, i, j, pair) per iteration
    fp32 = PAIR_FP32[design][kernel] * elems / 32  # warp-instructions
    macs = {}
    if design == "pair_bias_tc":
        macs = {"HMMA": PAIR_MMAS[kernel] * sc["mma_pad"] * elems}
    tile_elems = PAIR_OWN * PAIR_LOOP
    work = Work(
        issue=fp32 * sc["issue_overhead"] + sum(macs.values()) / 1024,
        fp32=fp32,
        tensor_macs=macs,
        shared_bytes=PAIR_SHARED[design] * elems,
        spill_access_bytes=sc["spill_passes"] * res.spill_bytes * res.warps * 32,
        l2_bytes=PAIR_LOOP * m * 2 * 2 + tile_elems * 2,  # the looped pair components + E or dE (bf16)
    )
    # alpha, beta once per tile for all heads; pass Q also runs the phase MLP's backward there.
    share = pair_phase_work(kernel, rec).scaled(tile_elems * m / heads)
    work = replace(
        work,
        issue=work.issue + share.issue,
        fp32=work.fp32 + share.fp32,
        alu=share.alu,
        mufu=share.mufu,
        tensor_macs=_add(work.tensor_macs, share.tensor_macs),
    )
    owned = heads * PAIR_OWN * m * 2 * 2  # the owned rows' pair components, all heads (bf16)
    partial = 0 if kernel == "pair_forward" else heads * PAIR_OWN * m * 2  # dq / dk partial adds
    prologue = Work(l2_bytes=owned, atomics=partial, atomic_degree=math.ceil(length / span))
    ee = heads * length * length * 2  # E or dE, bf16
    hbm = ee + 2 * heads * length * m * 2 * 2
    return Launch(
        kernel, res, work, programs, iters, hbm, prologue, runs=2 if kernel == "pair_forward" else 1
    )


def bias_attention(length: int, sc: Scenario, kind: str) -> list[Timing]:
    """Flash attention with an additive bias [H, L, L] bf16: forward reads E, backward reads E and
    writes dE. Costed at its assumed TFLOP/s or its HBM bytes, whichever is longer."""
    fwd_rate, bwd_rate = (
        (sc["triton_bias_fwd"], sc["triton_bias_bwd"]) if kind == "triton" else (sc["mea_fwd"], sc["mea_bwd"])
    )
    heads, d = LLADA["heads"], LLADA["head_dim"]
    flops = attention_flops(length)
    ee = heads * length * length * 2
    io = heads * length * d * 2
    out = []
    for name, f, rate, hbm in (
        (f"attn_bias_fwd ({kind})", flops, fwd_rate, ee + 4 * io),
        (f"attn_bias_bwd ({kind})", BWD_FLOPS_RATIO * flops, bwd_rate, 2 * ee + 8 * io),
    ):
        compute = f / (rate * 1e12) * 1e3
        memory = hbm / (sc["hbm_tbs"] * 1e12) * 1e3
        bound = "tensor (rate)" if compute >= memory else "hbm"
        terms = {"tensor (rate)": compute, "hbm": memory}
        out.append(Timing(name, max(compute, memory), bound, terms, 1, 0.0, hbm / 1e9))
    return out


def pair_bias_layer(
    length: int,
    sc: Scenario,
    rec: dict,
    design: str = "pair_bias",
    attention: str = "triton",
    resources: Resources | None = None,
) -> LayerEstimate:
    """Design (a) or (b) with the bias attention ``attention`` ("triton" or "sdpa")."""
    res = resources or ASSUMED_PAIR_RESOURCES
    kernels = ("pair_forward", "pair_backward_q", "pair_backward_k")
    timings = [launch_time(_pair_launch(k, design, length, sc, rec, res), sc) for k in kernels]
    timings[1:1] = bias_attention(length, sc, attention)
    glue = sc["glue_ms_2k"] * length / 2048
    return LayerEstimate(f"{design} ({attention})", length, timings, glue, [res.source])


def layer(
    design: str, length: int, sc: Scenario, rec: dict, attention: str = "triton", pair_resources=None
) -> LayerEstimate:
    """One design's layer estimate; ``pair_resources`` replaces the assumed resources of the
    pair kernels of (a) and (b) (e.g. from a compile of a kernel being built)."""
    if design == "current":
        return current_layer(length, sc, rec, "default")
    if design == "no_rewrite":
        return current_layer(length, sc, rec, "w8s2")
    if design in ("pair_bias", "pair_bias_tc"):
        return pair_bias_layer(length, sc, rec, design, attention, pair_resources)
    raise ValueError(f"design {design!r}: expected one of {DESIGNS}")


def parse_resources(text: str) -> Resources:
    """``warps,stages,registers,spill_bytes,shared_bytes,barriers`` (e.g. a pair kernel's compile:
    ``python benchmarks/bench_attention_gpu.py --compile-only`` prints them) -> Resources."""
    parts = text.split(",")
    if len(parts) != 6:
        raise ValueError(
            f"pair resources {text!r}: expected warps,stages,registers,spill_bytes,shared_bytes,barriers"
        )
    warps, stages, registers, spill, shared = (int(p) for p in parts[:5])
    return Resources(warps, stages, registers, spill, shared, float(parts[5]), source=f"given: {text}")


def extra_memory_gib(design: str, length: int, batch: int, budget_gib: float | None = None) -> float:
    """Extra attention memory at the backward's peak, GiB, for ``batch`` sequences at once:
    current: alpha, beta, d delta fp32 ([|M|, L, L] each); no_rewrite: alpha, beta fp16 + d delta
    fp32; pair-bias: E and dE bf16 [H, L, L]. ``budget_gib``: the per-launch cap of the pair
    buffers (``--attention.pair_buffer_gib``): a launch then takes row blocks."""
    m, heads = NUM_MDLMPE, LLADA["heads"]
    per_seq = {
        "current": 3 * 4 * m * length**2,
        "no_rewrite": (2 * 2 + 4) * m * length**2,
        "pair_bias": 2 * 2 * heads * length**2,
        "pair_bias_tc": 2 * 2 * heads * length**2,
    }[design] / 2**30
    total = per_seq * batch
    return total if budget_gib is None else min(total, max(budget_gib, per_seq / math.ceil(length / TILE)))
