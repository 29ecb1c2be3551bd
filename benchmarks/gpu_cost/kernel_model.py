"""The time of one kernel launch on an H100, from its resources and its work: an ESTIMATE.

A launch is ``programs`` CTAs, each running ``iters`` iterations of its main loop (and a prologue).
Per program-iteration the kernel's work is split over the SM's pipes (issue slots, FP32, INT,
MUFU, tensor cores, the load/store path to shared memory / L1, and L2). The terms, each printed:

1. **Pipes.** Cycles per program-iteration on each pipe at its per-SM rate; L2 gets the SM's share
   of the chip's L2->SM bandwidth. The binding pipe sets the pace; the others add
   ``non_overlap / warps-per-scheduler`` of their time (one warp per scheduler cannot hide one
   pipe's latency behind another's work; more warps can).
2. **L2 traffic** is the kernel's own loads, stores and atomics with the re-read factor of its grid
   order (given by the design: bytes per iteration), plus **spills** that do not fit the L1 left
   after shared memory (``spill_miss`` of the accesses beyond it), plus **atomics** as a
   4-byte payload each through the L2 path, slowed by same-address serialisation
   (``1 + atomic_serial x (degree - 1)``, degree = programs adding to one address at once).
3. **Exposed latency.** CTAs per SM (registers, shared memory, warp slots) and the prefetch depth
   (``stages``) hide the L2 latency of each iteration's loads: a CTA's iteration takes at least its
   own work plus ``barriers x barrier_clk`` plus the part of the L2 latency that ``stages - 1``
   iterations of all resident CTAs do not cover; the SM runs its resident CTAs' iterations in
   ``max(c x work, that critical path)``.
4. **Waves and prologue.** Programs run in waves of ``c`` per SM; a last partial wave has fewer CTAs
   per SM (less hiding). Each program pays its prologue / epilogue work and one HBM latency.
5. **HBM.** The launch takes at least its unique HBM bytes at the achievable HBM bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from gpu_cost.assumptions import Scenario

#: Largest shared memory per SM an H100 gives CTAs (228 KiB), and the 1 KiB the driver reserves per CTA.
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_CTA = 1024
#: Largest shared memory one CTA may request on sm_90 (the opt-in maximum Triton checks at launch).
SHARED_PER_CTA_LIMIT = 232_448
MAX_CTAS_PER_SM = 32
MAX_WARPS_PER_SM = 64
PIPES = ("issue", "fp32", "alu", "mufu", "tensor", "shared", "l2")


@dataclass(frozen=True)
class Resources:
    """What one CTA of a kernel holds and does per iteration. ``source``: "AOT sm_90" when the
    numbers come from a compile (``mdlmpe_ds.attention.triton.aot``), else the stated assumption."""

    warps: int
    stages: int
    registers: int
    spill_bytes: int  # per thread (the local-memory stack)
    shared_bytes: int  # per CTA
    barriers: float  # block-wide barriers per main-loop iteration
    source: str = "assumed"


@dataclass(frozen=True)
class Work:
    """Work of one CTA in one main-loop iteration (or its prologue), all warps together:
    warp-instructions by pipe, bf16-equivalent tensor MACs by MMA kind ("HGMMA" / "HMMA"), bytes
    through shared memory / L1 (``shared_bytes``), bytes reaching L2 (``l2_bytes``, loads and stores
    after any reuse on the SM), spill (local-memory) bytes accessed, and fp32 atomic adds with the
    number of programs adding to the same address at the same time (``atomic_degree``)."""

    issue: float = 0.0
    fp32: float = 0.0
    alu: float = 0.0
    mufu: float = 0.0
    tensor_macs: dict[str, float] = field(default_factory=dict)
    shared_bytes: float = 0.0
    l2_bytes: float = 0.0
    spill_access_bytes: float = 0.0
    atomics: float = 0.0
    atomic_degree: float = 1.0

    def scaled(self, factor: float) -> Work:
        return replace(
            self,
            issue=self.issue * factor,
            fp32=self.fp32 * factor,
            alu=self.alu * factor,
            mufu=self.mufu * factor,
            tensor_macs={k: v * factor for k, v in self.tensor_macs.items()},
            shared_bytes=self.shared_bytes * factor,
            l2_bytes=self.l2_bytes * factor,
            spill_access_bytes=self.spill_access_bytes * factor,
            atomics=self.atomics * factor,
        )


@dataclass(frozen=True)
class Launch:
    """One kernel launch (``runs`` times per layer): ``programs`` CTAs of ``iters`` iterations."""

    name: str
    resources: Resources
    work: Work
    programs: int
    iters: float
    hbm_bytes: float = 0.0
    prologue: Work = field(default_factory=Work)
    runs: int = 1
    note: str = ""
    #: The load latency an iteration waits on when nothing hides it: "l2_latency" (operands that
    #: stay in L2) or "hbm_latency" (a stream read once, e.g. a [H, L, L] gradient from HBM).
    latency: str = "l2_latency"


@dataclass
class Timing:
    """A launch's estimated time (all runs of a layer), the binding term, and every term alone."""

    name: str
    ms: float
    bound: str
    terms_ms: dict[str, float]
    ctas_per_sm: int
    l2_gb: float
    hbm_gb: float


def ctas_per_sm(res: Resources) -> int:
    """CTAs one SM holds at once: registers (64 K), shared memory (228 KiB, 1 KiB reserved each),
    warp slots (64) and the 32-CTA limit."""
    by_regs = 65536 // max(1, res.registers * 32 * res.warps)
    by_shared = SHARED_PER_SM // (res.shared_bytes + SHARED_RESERVED_PER_CTA) if res.shared_bytes else 64
    return max(1, min(MAX_WARPS_PER_SM // res.warps, by_regs, by_shared, MAX_CTAS_PER_SM))


def spill_l2_share(res: Resources, ctas: int, sc: Scenario) -> float:
    """Share of spill accesses that reach L2: the spill stacks of the resident CTAs against the
    L1 left after their shared memory; what does not fit misses with probability ``spill_miss``."""
    footprint = ctas * res.warps * 32 * res.spill_bytes
    if footprint == 0:
        return 0.0
    l1_left = max(0.0, sc["l1_kib"] * 1024 - ctas * (res.shared_bytes + SHARED_RESERVED_PER_CTA))
    return (1.0 - min(1.0, l1_left / footprint)) * sc["spill_miss"]


def pipe_cycles(work: Work, res: Resources, ctas: int, sc: Scenario) -> dict[str, float]:
    """SM cycles each pipe needs for ``work`` (one CTA's share of the SM's throughput)."""
    tensor = sum(
        macs / (sc["tensor_mac"] * sc["eff_hgmma" if kind == "HGMMA" else "eff_hmma"])
        for kind, macs in work.tensor_macs.items()
    )
    serial = 1.0 + sc["atomic_serial"] * max(0.0, work.atomic_degree - 1.0)
    atomic_bytes = work.atomics * 4.0 * serial  # 4 B payload per fp32 add, serialised per address
    l2 = work.l2_bytes + work.spill_access_bytes * spill_l2_share(res, ctas, sc) + atomic_bytes
    return {
        "issue": work.issue / sc["issue"],
        "fp32": work.fp32 / sc["fp32"],
        "alu": work.alu / sc["alu"],
        "mufu": work.mufu / sc["mufu"],
        "tensor": tensor,
        "shared": (work.shared_bytes + work.spill_access_bytes) / sc["shared_bw"],
        "l2": l2 / sc.l2_bytes_per_clk_sm(),
    }


#: Pipes that share the issue slots: the "core" resource is the busiest of them.
CORE_PIPES = ("issue", "fp32", "alu", "mufu")


def resources_cycles(pipes: dict[str, float]) -> dict[str, float]:
    """The independent resources of an SM: the core (issue slots and the FP32 / INT / MUFU units
    behind them: the busiest), the tensor cores, the shared-memory path and L2."""
    return {
        "core": max(pipes[p] for p in CORE_PIPES),
        "tensor": pipes["tensor"],
        "shared": pipes["shared"],
        "l2": pipes["l2"],
    }


def overlapped(pipes: dict[str, float], warps_per_scheduler: float, sc: Scenario) -> float:
    """Binding resource plus ``non_overlap / warps per scheduler`` of the others' time."""
    res = resources_cycles(pipes)
    top = max(res.values())
    rest = sum(res.values()) - top
    return top + sc["non_overlap"] / max(1.0, warps_per_scheduler) * rest


def round_cycles(
    cycles: float, res: Resources, ctas: int, sc: Scenario, latency: str = "l2_latency"
) -> float:
    """SM cycles for each of ``ctas`` resident CTAs to run one iteration (``cycles`` of SM
    throughput each): throughput, or one CTA's critical path (its work, its barriers, the load
    latency (``latency``: L2 or HBM) that ``stages - 1`` iterations of prefetch across the resident
    CTAs do not hide)."""
    exposed = max(0.0, sc[latency] - (res.stages - 1) * ctas * cycles)
    return max(ctas * cycles, cycles + res.barriers * sc["barrier_clk"] + exposed)


def launch_time(launch: Launch, sc: Scenario) -> Timing:
    """Estimated ms of a launch (all its runs), the binding term and each term alone."""
    res = launch.resources
    if res.shared_bytes > SHARED_PER_CTA_LIMIT:
        raise ValueError(
            f"{launch.name}: {res.shared_bytes:,} B of shared memory per CTA is over the sm_90 limit "
            f"{SHARED_PER_CTA_LIMIT:,}: it cannot launch"
        )
    ctas = ctas_per_sm(res)
    sms = int(sc["sms"])
    total = launch.programs
    full_waves, rest = divmod(total, sms * ctas)
    waves = [(ctas, full_waves)] + ([(math.ceil(rest / sms), 1)] if rest else [])
    cycles = 0.0
    for resident, count in waves:
        pipes = pipe_cycles(launch.work, res, resident, sc)
        per_iter = overlapped(pipes, res.warps * resident / 4, sc)
        pro = pipe_cycles(launch.prologue, res, resident, sc)
        prologue = overlapped(pro, res.warps * resident / 4, sc) * resident + sc["hbm_latency"]
        per_round = round_cycles(per_iter, res, resident, sc, launch.latency)
        cycles += count * (launch.iters * per_round + prologue)
    compute_s = cycles / sc.clock_hz
    hbm_s = launch.hbm_bytes / (sc["hbm_tbs"] * 1e12)
    seconds = max(compute_s, hbm_s)
    # Each term alone, over the whole launch (the SMs share the work evenly).
    pipes = pipe_cycles(launch.work, res, ctas, sc)
    scale = total * launch.iters / sms / sc.clock_hz * 1e3
    terms = {p: c * scale for p, c in pipes.items()}
    terms["hbm"] = hbm_s * 1e3
    terms["latency+barriers"] = max(0.0, compute_s * 1e3 - max(pipes.values()) * scale)
    bound = "hbm" if hbm_s >= compute_s else max(pipes, key=pipes.get)
    l2_bytes = (
        launch.work.l2_bytes
        + launch.work.atomics * 4
        + launch.work.spill_access_bytes * spill_l2_share(res, ctas, sc)
    )
    runs = launch.runs
    return Timing(
        name=launch.name,
        ms=seconds * 1e3 * runs,
        bound=bound,
        terms_ms={k: v * runs for k, v in terms.items()},
        ctas_per_sm=ctas,
        l2_gb=l2_bytes * total * launch.iters * runs / 1e9,
        hbm_gb=launch.hbm_bytes * runs / 1e9,
    )
