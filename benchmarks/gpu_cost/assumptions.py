"""Every figure the GPU cost model rests on, with its source and a low / central / high value.

A figure is an ``Assumption``: three values and the direction that makes a kernel faster
(``better``). A ``Scenario`` takes, for every assumption, its optimistic end ("low" scenario: the
lowest time), its central value, or its pessimistic end ("high" scenario), so every result comes as
an ordered low <= central <= high range. Machine figures whose uncertainty does not matter here (SM
count, clock, pipe widths) have low = central = high.

Sources are public documents (NVIDIA's H100 whitepaper and PTX ISA, the FlashAttention-2/3 papers,
pytorch/benchmark PR 2391, published microbenchmarks) or "modelling choice" where no public figure
exists; those are the ones a GPU run should settle (``benchmarks/bench_attention_gpu.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCENARIOS = ("low", "central", "high")


@dataclass(frozen=True)
class Assumption:
    """One named figure: ``low`` <= ``central`` <= ``high`` in its own unit; ``better`` says which end
    makes kernels faster ("high" for a bandwidth, "low" for a latency)."""

    name: str
    low: float
    central: float
    high: float
    unit: str
    source: str
    better: str = "high"

    def __post_init__(self) -> None:
        if not self.low <= self.central <= self.high:
            raise ValueError(f"assumption {self.name}: need low <= central <= high, got {self}")
        if self.better not in ("low", "high"):
            raise ValueError(f"assumption {self.name}: better must be 'low' or 'high'")

    def value(self, scenario: str) -> float:
        """The value a scenario takes: 'low' is the optimistic scenario (lowest time)."""
        if scenario == "central":
            return self.central
        optimistic = self.high if self.better == "high" else self.low
        pessimistic = self.low if self.better == "high" else self.high
        return {"low": optimistic, "high": pessimistic}[scenario]

    def line(self) -> str:
        fixed = self.low == self.high
        values = f"{self.central:g}" if fixed else f"{self.low:g} / {self.central:g} / {self.high:g}"
        return f"{self.name}: {values} {self.unit} [{self.source}]"


def _a(name, low, central, high, unit, source, better="high") -> Assumption:
    return Assumption(name, float(low), float(central), float(high), unit, source, better)


WHITEPAPER = "NVIDIA H100 Tensor Core GPU Architecture whitepaper (H100 SXM5)"
HOPPER_BENCH = (
    "microbenchmarks: Luo et al., 'Benchmarking and Dissecting the Nvidia Hopper GPU Architecture', "
    "arXiv:2402.13499; Chips and Cheese, 'Nvidia's H100: Funny L2, and Tons of Bandwidth' (2023)"
)
FA3_PAPER = "FlashAttention-3, Shah et al., arXiv:2407.08608 (H100 SXM5, bf16, d=128, non-causal)"
PR2391 = "pytorch/benchmark PR 2391 (H100 SXM, bf16, d=128, non-causal fwd, B*S=16k, 16 heads)"

#: The machine (H100 SXM5) and the modelling choices, by key.
ASSUMPTIONS: dict[str, Assumption] = {
    a.name: a
    for a in (
        _a("sms", 132, 132, 132, "SMs", WHITEPAPER),
        _a("clock_ghz", 1.755, 1.755, 1.755, "GHz SM clock", WHITEPAPER + " (boost)"),
        _a("issue", 4, 4, 4, "warp-instr/clk/SM", WHITEPAPER + ": 4 schedulers, 1 issue each"),
        _a("fp32", 4, 4, 4, "warp-instr/clk/SM", WHITEPAPER + ": 128 FP32 lanes"),
        _a("alu", 2, 2, 2, "warp-instr/clk/SM", WHITEPAPER + ": 64 INT32 lanes"),
        _a("mufu", 0.5, 0.5, 0.5, "warp-instr/clk/SM", WHITEPAPER + ": 16 SFU lanes"),
        _a("lsu", 1, 1, 1, "warp-instr/clk/SM", WHITEPAPER + ": 32 LD/ST lanes"),
        _a("shared_bw", 128, 128, 128, "B/clk/SM", WHITEPAPER + ": L1/shared 128 B/clk"),
        _a("l1_kib", 256, 256, 256, "KiB L1+shared per SM", WHITEPAPER),
        _a("regs", 65536, 65536, 65536, "32-bit registers/SM", WHITEPAPER),
        _a("tensor_mac", 2048, 2048, 2048, "dense BF16 MAC/clk/SM", WHITEPAPER + " (989 TFLOP/s)"),
        _a("eff_hgmma", 0.65, 0.75, 0.85, "of tensor peak, warpgroup MMA (wgmma)", "modelling choice"),
        _a("eff_hmma", 0.4, 0.5, 0.6, "of tensor peak, warp MMA (mma.sync)", "modelling choice"),
        _a("hbm_tbs", 2.6, 2.9, 3.2, "TB/s achievable HBM3", WHITEPAPER + ": 3.35 TB/s peak; 78-95% reached"),
        _a("l2_tbs", 4.0, 5.5, 8.0, "TB/s L2->SM, all SMs", HOPPER_BENCH),
        _a("l2_latency", 200, 260, 320, "clk L2 hit", HOPPER_BENCH, better="low"),
        _a("hbm_latency", 500, 650, 800, "clk HBM load", HOPPER_BENCH, better="low"),
        _a(
            "barrier_clk",
            20,
            40,
            80,
            "clk on a CTA's critical path per block-wide barrier (bar.sync latency + warp skew)",
            "modelling choice; bar.sync alone ~20 clk in Volta/Ampere microbenchmarks (Jia et al.)",
            better="low",
        ),
        _a(
            "non_overlap",
            0.1,
            0.26,
            0.55,
            "share of the non-binding resources' time added to the binding one, at 1 warp per "
            "scheduler (divided by the resident warps per scheduler)",
            "fitted on the calibration kernel at S=2048 (gpu_cost.calibrate): 0.26 at the tutorial's "
            "BM 128 / BN 64, 0.53 at the model's fastest setting of its autotuning space; low a choice",
            better="low",
        ),
        _a(
            "spill_miss",
            0.25,
            0.6,
            1.0,
            "share of spill accesses beyond the L1 left after shared memory that go to L2",
            "modelling choice (LRU reuse of the spill stack)",
            better="low",
        ),
        _a(
            "spill_passes",
            1,
            2,
            4,
            "passes over its spill stack per loop iteration, for a kernel given a stack but no SASS",
            "AOT sm_90 SASS of the fused forward ~2.9, backward ~11 passes per (larger) iteration at "
            "their settings before 2026-11-28 (2 heads per program, 4 warps: they spilled)",
            better="low",
        ),
        _a(
            "atomic_serial",
            0.0,
            0.05,
            0.15,
            "extra L2 time per additional program adding to the same address at once",
            "modelling choice (no public H100 figure; Nsight lts__t_requests_op_red settles it)",
            better="low",
        ),
        _a(
            "glue_ms_2k",
            0.15,
            0.3,
            0.5,
            "ms per MDLMPE layer of torch glue at L=2048 (scales with L)",
            "modelling choice: pair components, gradient sums, buffer zeroing, launches",
            better="low",
        ),
        _a(
            "issue_overhead",
            1.2,
            1.45,
            1.7,
            "issue slots per FP32 instruction (addressing, shuffles, conversions) in a kernel not yet "
            "compiled",
            "AOT sm_90 SASS of the fused forward / backward at 2 heads per program, 4 warps: 1.50 / 1.46 "
            "(1.79 / 1.66 at today's 1 head, 8 warps)",
            better="low",
        ),
        _a(
            "mma_pad",
            8,
            8,
            16,
            "K (or N) slots one rank-2 pair product occupies in an MMA",
            "PTX ISA: mma.m16n8k8 (bf16) smallest K; k16 if only m16n8k16 is used",
            better="low",
        ),
        # RoPE baselines (per-length rates for the FA3 forward come from PR 2391, see step.py).
        _a("fa3_fwd_scale", 0.9, 1.0, 1.1, "x the published FA3 forward TFLOP/s at the length", PR2391),
        _a("fa3_bwd", 400, 450, 520, "TFLOP/s FA3 backward", FA3_PAPER + ": bwd 1.5-1.75x FA2's"),
        _a(
            "fa2_fwd",
            300,
            330,
            360,
            "TFLOP/s FA2 forward (torch SDPA flash backend)",
            FA3_PAPER + " (FA2 bars)",
        ),
        _a("fa2_bwd", 250, 280, 310, "TFLOP/s FA2 backward", FA3_PAPER + " (FA2 bars)"),
        _a(
            "mea_fwd",
            150,
            200,
            250,
            "TFLOP/s memory-efficient SDPA forward with an additive mask/bias",
            "modelling choice: CUTLASS sm_80 kernels (no wgmma on H100)",
        ),
        _a(
            "mea_bwd", 100, 140, 180, "TFLOP/s memory-efficient SDPA backward with a bias", "modelling choice"
        ),
        _a(
            "triton_bias_fwd",
            300,
            380,
            434,
            "TFLOP/s Triton flash forward with an additive bias (before the bias read)",
            PR2391 + ": the tutorial kernel 434 at S=2048; a bias tile costs issue slots",
        ),
        _a(
            "triton_bias_bwd",
            180,
            230,
            280,
            "TFLOP/s Triton flash backward with bias and dBias",
            "modelling choice: ~0.6x the forward rate, as FA2's bwd/fwd",
        ),
        _a("mfu", 0.40, 0.45, 0.55, "MFU of the non-attention matmuls", "modelling choice (8B dense, bf16)"),
        _a(
            "scored_share",
            0.3,
            0.5,
            1.0,
            "share of positions through the LM head (masked positions only)",
            "mdlmpe_ds/models/scored_head.py: the head runs on the scored (masked) positions",
            better="low",
        ),
    )
}


@dataclass
class Scenario:
    """The value of every assumption in one scenario ("low", "central" or "high"), with overrides
    (e.g. a fitted constant, or a test halving the L2 bandwidth)."""

    name: str = "central"
    overrides: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in SCENARIOS:
            raise ValueError(f"scenario {self.name!r}: expected one of {SCENARIOS}")
        unknown = set(self.overrides) - set(ASSUMPTIONS)
        if unknown:
            raise ValueError(f"scenario overrides name unknown assumptions {sorted(unknown)}")

    def __getitem__(self, key: str) -> float:
        if key in self.overrides:
            return self.overrides[key]
        return ASSUMPTIONS[key].value(self.name)

    def with_(self, **overrides: float) -> Scenario:
        return Scenario(self.name, {**self.overrides, **overrides})

    @property
    def clock_hz(self) -> float:
        return self["clock_ghz"] * 1e9

    def l2_bytes_per_clk_sm(self) -> float:
        """L2->SM bandwidth per SM per clock (the whole chip's shared fairly by the SMs)."""
        return self["l2_tbs"] * 1e12 / (self["sms"] * self.clock_hz)


def scenarios(**overrides: float) -> list[Scenario]:
    return [Scenario(name, dict(overrides)) for name in SCENARIOS]
