"""ESTIMATED cost of MDLMPE attention on an H100, from the kernels' own sm_90 machine code (no GPU).

Each of the four fused MDLMPE kernels (phase_forward, forward, backward, phase_backward) is
compiled ahead of time for sm_90 with the launch settings the launcher picks
(``mdlmpe_ds.attention.triton.aot``), at LLaDA-8B shapes (32 heads, d_h 128, bf16, all heads with
MDLMPE). Its SASS (``cuobjdump -sass``) is cut to the body of the main key/row loop, the per-pair
loops nested in it counted |M| = 32 times, and counted by class. The classes' per-SM issue rates
(below, printed) turn one loop iteration of one warp into SM cycles, assuming every pipe overlaps
perfectly: the busiest pipe (or the issue slots) sets the time. Programs run in waves of as many
per SM as its registers, shared memory and warp slots hold. Each kernel also moves the transient
pair buffers (alpha, beta, dE/d delta) through HBM: it takes the longer of its compute time and
that traffic at the HBM bandwidth. A plain Triton flash-attention forward (RoPE, the baseline) is
compiled and costed the same way; its backward is taken as 2.5x its forward (5 tile products
against 2). The rest of the LLaDA-8B step (projections, SwiGLU, LM head) comes from its FLOPs at a
stated MFU. Output: estimated time per layer and the MDLMPE / RoPE step ratio at L = 1024, 2048,
4096. This is a model, never a measurement: it ignores latency and L2 misses, and is as optimistic
for the baseline as for the kernels.

    python benchmarks/estimate_gpu.py                # the current launch settings
    python benchmarks/estimate_gpu.py --json est.json --lengths 2048
    python benchmarks/estimate_gpu.py --tile 32 --heads-per-program 4   # another setting
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass

import torch

# LLaDA-8B (docs/models.md §1.1).
LLADA = dict(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=12288, vocab=126464)
#: MDLMPE pairs at d_h 128 (the odd f of F = 64): the trip count of the per-pair loops.
NUM_MDLMPE = 32

# H100 SXM (sm_90): 132 SMs, boost clock 1.755 GHz (NVIDIA H100 whitepaper). Per SM per clock, in
# warp-instructions: 4 issue slots (one scheduler per quarter), FP32 128 lanes (4), INT/logic 64
# lanes (2), MUFU (special functions) 16 lanes (0.5), load/store unit 32 lanes (1, and at most
# 128 bytes/clk of L1/shared traffic). Tensor cores: dense BF16 peak 2048 MAC/clk/SM (989 TFLOP/s),
# TF32 half of it; warpgroup MMA (HGMMA) at 75% of peak, warp-level mma.sync (HMMA) at 50%.
H100 = dict(sms=132, clock_hz=1.755e9, issue=4.0, fp32=4.0, alu=2.0, mufu=0.5, lsu=1.0, lsu_bytes=128.0)
TENSOR_MAC_PER_CLK = {"BF16": 2048.0, "F16": 2048.0, "TF32": 1024.0}
TENSOR_EFFICIENCY = {"HGMMA": 0.75, "HMMA": 0.5}
DENSE_BF16_FLOPS = 989e12
#: Model FLOPs utilisation of the non-attention part of the step (projections, SwiGLU, LM head).
MFU = 0.45
#: Flash-attention backward / forward time (5 tile products against 2).
FLASH_BWD_OVER_FWD = 2.5

CLASSES = ("fp32", "alu", "mufu", "tensor", "memory", "spill", "control")
_FP32 = ("FFMA", "FADD", "FMUL", "FMNMX", "HFMA2", "HADD2", "HMUL2", "FSWZADD", "DMUL", "DADD", "DFMA")
_MEMORY = ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "ATOM", "RED", "LDGSTS", "LD", "ST", "UBLKCP")
_CONTROL = ("WARPGROUP", "BRA", "BAR", "BSSY", "BSYNC", "EXIT", "NOP", "WARPSYNC", "DEPBAR", "YIELD")
_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")


@dataclass
class LoopCost:
    """Instructions of one warp in one iteration of a kernel's main loop, by class, and its SM cycles;
    ``resident``: programs of the kernel one SM holds at once (registers, shared memory, warps)."""

    kernel: str
    counts: dict[str, int]
    tensor_macs: float
    tensor_cycles: float
    lsu_bytes: float
    cycles: float
    bound: str
    resident: int = 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def parse_sass(text: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction of the first kernel in ``cuobjdump -sass``."""
    return [(int(m.group(1), 16), m.group(3), m.group(4)) for m in map(_LINE.match, text.splitlines()) if m]


def _backward_branches(instrs: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """(target, branch) address spans of every backward branch: the loops, widest first."""
    spans = []
    for addr, op, args in instrs:
        if op.startswith("BRA"):
            target = re.search(r"0x([0-9a-f]+)", args)
            if target and int(target.group(1), 16) < addr:
                spans.append((int(target.group(1), 16), addr))
    return sorted(spans, key=lambda s: s[1] - s[0], reverse=True)


def main_loop(instrs: list[tuple[int, str, str]], trips: int = 1) -> list[tuple[int, str, str]]:
    """The instructions one iteration of the widest loop (the key / row loop) executes: its body,
    with the body of each loop nested directly inside it (the per-pair loops, ``trips`` iterations
    each) counted ``trips`` times. Loops nested deeper are counted once per enclosing iteration."""
    loops = _backward_branches(instrs)
    if not loops:
        raise RuntimeError("no backward branch in the SASS: no loop to cost")
    outer = loops[0]
    inner: list[tuple[int, int]] = []
    for span in loops[1:]:
        inside = outer[0] <= span[0] and span[1] <= outer[1]
        if inside and not any(o[0] <= span[0] and span[1] <= o[1] for o in inner):
            inner.append(span)
    if inner and trips == 1:
        raise RuntimeError(f"{len(inner)} loop(s) nested in the main loop: give their trip count")
    body = [i for i in instrs if outer[0] <= i[0] <= outer[1]]
    for span in inner:
        body += [i for i in instrs if span[0] <= i[0] <= span[1]] * (trips - 1)
    return body


def classify(op: str) -> str:
    base = op.split(".")[0]
    if base in ("LDL", "STL"):
        return "spill"
    if base in ("HMMA", "HGMMA", "IMMA"):
        return "tensor"
    if base == "MUFU":
        return "mufu"
    if base in _FP32:
        return "fp32"
    if base in _MEMORY:
        return "memory"
    if base in _CONTROL:
        return "control"
    return "alu"


def _mma_macs(op: str) -> tuple[float, float]:
    """(MACs per warp, SM cycles) of one HMMA / HGMMA instruction from its shape and input type."""
    kind = op.split(".")[0]
    dtype = next((t for t in TENSOR_MAC_PER_CLK if f".{t}" in op), "BF16")
    shape = re.search(r"\.(\d+)x(\d+)x(\d+)", op)
    if kind == "HGMMA" and shape:
        m, n, k = map(int, shape.groups())
        macs = m * n * k / 4  # one warpgroup instruction issued by each of its 4 warps
    else:
        digits = re.search(r"\.(16)(8)(\d+)", op)
        macs = 16 * 8 * int(digits.group(3)) if digits else 16 * 8 * 16
    if kind not in TENSOR_EFFICIENCY:
        return macs, 0.0
    return macs, macs / (TENSOR_MAC_PER_CLK[dtype] * TENSOR_EFFICIENCY[kind])


def _access_bytes(op: str) -> float:
    """Bytes one warp moves with one load/store (32 lanes x width; ldmatrix .4 moves 512, plain 128)."""
    if op.startswith(("LDSM", "STSM")):
        last = op.rsplit(".", 1)[1]
        return 128.0 * int(last) if last.isdigit() else 128.0
    width = re.search(r"\.(128|64|32|U16|S16|16|U8|S8)\b", op)
    size = {"128": 16, "64": 8, "32": 4, "U16": 2, "S16": 2, "16": 2, "U8": 1, "S8": 1}
    return 32.0 * (size[width.group(1)] if width else 4)


def loop_cost(kernel: str, sass_text: str, trips: int = 1) -> LoopCost:
    """Cost of one warp's main-loop iteration (nested per-pair loops ``trips`` times): counts per
    class and SM cycles (busiest pipe)."""
    body = main_loop(parse_sass(sass_text), trips)
    counts = Counter(classify(op) for _, op, _ in body)
    macs = cycles = lsu_bytes = 0.0
    for _, op, _ in body:
        if classify(op) == "tensor":
            m, c = _mma_macs(op)
            macs, cycles = macs + m, cycles + c
        elif classify(op) in ("memory", "spill"):
            lsu_bytes += _access_bytes(op)
    pipes = {
        "issue": sum(counts.values()) / H100["issue"],
        "fp32": counts["fp32"] / H100["fp32"],
        "alu": counts["alu"] / H100["alu"],
        "mufu": counts["mufu"] / H100["mufu"],
        "tensor": cycles,
        "lsu": max((counts["memory"] + counts["spill"]) / H100["lsu"], lsu_bytes / H100["lsu_bytes"]),
    }
    bound = max(pipes, key=pipes.get)
    return LoopCost(kernel, {c: counts[c] for c in CLASSES}, macs, cycles, lsu_bytes, pipes[bound], bound)


def resident_programs(registers: int, shared: int, warps: int) -> int:
    """Programs one H100 SM holds at once: 64 K registers, 228 KB of shared memory, 64 warps."""
    by_registers = 65536 // max(1, registers * 32 * warps)
    by_shared = (228 * 1024) // shared if shared else 64
    return max(1, min(64 // warps, by_registers, by_shared))


def kernel_seconds(cost: LoopCost, warps: int, programs: int, iterations: int) -> float:
    """Time of a whole launch: every warp of every program runs ``iterations`` loop bodies, the
    programs in waves of ``resident`` per SM (a last partial wave costs a whole one: an SM with
    fewer programs has fewer warps to hide latency)."""
    waves = math.ceil(programs / (H100["sms"] * cost.resident))
    return cost.cycles * warps * cost.resident * waves * iterations / H100["clock_hz"]


# --------------------------------------------------------------------------------------------------
# The baseline: a plain flash-attention forward (RoPE is applied to q, k before it), compiled alike.
FLASH_BM, FLASH_BN, FLASH_WARPS, FLASH_STAGES = 128, 64, 8, 3


def _flash_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def flash_fwd_kernel(q, k, v, o, L, scale, DH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """Online-softmax attention of one [BM] row tile of one head over all keys (bidirectional)."""
        pid = tl.program_id(0)
        base = tl.program_id(1) * L * DH
        rows = pid * BM + tl.arange(0, BM)
        d = tl.arange(0, DH)
        qt = tl.load(q + base + rows[:, None] * DH + d[None, :])
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, DH), tl.float32)
        for start in range(0, L, BN):
            cols = start + tl.arange(0, BN)
            kt = tl.load(k + base + cols[None, :] * DH + d[:, None])
            vt = tl.load(v + base + cols[:, None] * DH + d[None, :])
            s = tl.dot(qt, kt) * scale
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            corr = tl.exp(m_i - m_new)
            l_i = l_i * corr + tl.sum(p, axis=1)
            acc = acc * corr[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        tl.store(o + base + rows[:, None] * DH + d[None, :], (acc / l_i[:, None]).to(o.dtype.element_ty))

    return flash_fwd_kernel


def flash_cost(head_dim: int, dtype: torch.dtype) -> LoopCost:
    from mdlmpe_ds.attention.triton.aot import compile_function, resource_usage, sass

    options = dict(num_warps=FLASH_WARPS, num_stages=FLASH_STAGES, maxnreg=255)
    meta = dict(DH=head_dim, BM=FLASH_BM, BN=FLASH_BN)
    compiled = compile_function(_flash_kernel(), meta, dtype, 90, options)
    cost = loop_cost("rope_flash_fwd", sass(compiled.asm["cubin"]))
    registers = resource_usage(compiled.asm["cubin"])["REG"]
    cost.resident = resident_programs(registers, int(compiled.metadata.shared), FLASH_WARPS)
    return cost


# --------------------------------------------------------------------------------------------------
def mdlmpe_costs(head_dim: int, dtype: torch.dtype, config=None) -> tuple[dict[str, LoopCost], object, dict]:
    from mdlmpe_ds.attention.triton.aot import compile_cubin, resource_usage, sass
    from mdlmpe_ds.attention.triton.launch import KERNELS, PHASE_KERNELS, kernel_options, launch_config

    config = config or launch_config(head_dim, dtype, 90)
    costs, resources = {}, {}
    for kernel in KERNELS:
        compiled = compile_cubin(kernel, head_dim, dtype, 90, config, num_heads=LLADA["heads"])
        usage = resource_usage(compiled.asm["cubin"])
        resources[kernel] = dict(
            shared=int(compiled.metadata.shared), registers=usage["REG"], spill=usage["STACK"]
        )
        trips = 1 if kernel in PHASE_KERNELS else NUM_MDLMPE
        costs[kernel] = loop_cost(kernel, sass(compiled.asm["cubin"]), trips)
        warps = kernel_options(kernel, config)["num_warps"]
        costs[kernel].resident = resident_programs(usage["REG"], resources[kernel]["shared"], warps)
    return costs, config, resources


def rest_of_step_seconds(length: int) -> float:
    """Projections, SwiGLU and LM head of one LLaDA-8B sequence, fwd + bwd (6 FLOPs per weight per
    token), at ``MFU`` of the dense BF16 peak."""
    m = LLADA
    per_layer = 4 * m["hidden"] ** 2 + 3 * m["hidden"] * m["ffn"]
    weights = m["layers"] * per_layer + m["hidden"] * m["vocab"]
    return 6 * weights * length / (DENSE_BF16_FLOPS * MFU)


#: Times each kernel runs per layer (fwd + bwd): the backward recomputes alpha, beta.
RUNS_PER_LAYER = {"phase_forward": 2, "forward": 1, "backward": 1, "phase_backward": 1}
#: HBM traffic of each kernel run in [NM, LP, LP] fp32 pair planes (batch 1), assuming the head
#: groups that run together share a tile's planes in L2 (read from HBM once): phase_forward
#: writes alpha, beta; forward reads them; backward reads them and adds into ddelta (its zeros
#: read, the sums written back); phase_backward reads ddelta. Zeroing ddelta writes one plane.
PAIR_PLANES = {"phase_forward": 2, "forward": 2, "backward": 4, "phase_backward": 1, "zero_ddelta": 1}
HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3


def phase_programs(length: int, config) -> tuple[int, int]:
    """(programs with work, tiles in all) of one phase-kernel launch over a whole sequence: row tile
    t covers key tiles t .. T - 1 (symmetry), split into key spans (``triton.launch.phase_key_span``)."""
    from mdlmpe_ds.attention.triton.launch import padded_length, pair_padding, phase_key_span

    padded = padded_length(length, pair_padding(config))
    tiles_per_row = padded // config.phase_tile
    span = phase_key_span(padded, config) // config.phase_tile
    programs = sum(math.ceil((tiles_per_row - t) / span) for t in range(tiles_per_row))
    return programs, tiles_per_row * (tiles_per_row + 1) // 2


def estimate(costs, config, flash: LoopCost, length: int, groups: int) -> dict[str, float]:
    """Per-layer seconds of each MDLMPE kernel and of flash RoPE (fwd + bwd), and the step ratio.
    Head kernels: one program per (tile, group of ``groups`` heads), looping over tiles; phase
    kernels: one program per pair-tile row, looping over pair tiles (batch 1). Each kernel takes
    the longer of its SASS-estimated time and its pair-buffer HBM traffic at HBM_BYTES_PER_S."""
    from mdlmpe_ds.attention.triton.launch import PHASE_KERNELS, kernel_options, padded_length, pair_padding

    heads, layers = LLADA["heads"], LLADA["layers"]
    plane = NUM_MDLMPE * padded_length(length, pair_padding(config)) ** 2 * 4  # bytes of one pair plane set
    layer, hbm = {}, {}
    for k, c in costs.items():
        warps = kernel_options(k, config)["num_warps"]
        if k in PHASE_KERNELS:  # the upper half of the tile plane, in key spans (triton.backend)
            programs, tiles = phase_programs(length, config)
            compute = kernel_seconds(c, warps, programs, tiles / programs)
        else:
            tiles = math.ceil(length / config.tile)
            compute = kernel_seconds(c, warps, tiles * heads // groups, tiles)
        hbm[k] = PAIR_PLANES[k] * plane * RUNS_PER_LAYER[k]
        layer[k] = RUNS_PER_LAYER[k] * max(compute, PAIR_PLANES[k] * plane / HBM_BYTES_PER_S)
    hbm["zero_ddelta"] = PAIR_PLANES["zero_ddelta"] * plane
    layer["zero_ddelta"] = hbm["zero_ddelta"] / HBM_BYTES_PER_S
    flash_fwd = kernel_seconds(flash, FLASH_WARPS, heads * math.ceil(length / FLASH_BM), length // FLASH_BN)
    rope_layer = flash_fwd * (1 + FLASH_BWD_OVER_FWD)
    rest = rest_of_step_seconds(length)
    mdlmpe_layer = sum(layer.values())
    return dict(
        length=length,
        **{f"{k}_ms": 1e3 * t for k, t in layer.items()},
        pair_hbm_gb=sum(hbm.values()) / 1e9,
        mdlmpe_layer_ms=1e3 * mdlmpe_layer,
        rope_layer_ms=1e3 * rope_layer,
        layer_ratio=mdlmpe_layer / rope_layer,
        rest_of_step_ms=1e3 * rest,
        rope_step_ms=1e3 * (rest + layers * rope_layer),
        mdlmpe_step_ms=1e3 * (rest + layers * mdlmpe_layer),
        step_ratio=(rest + layers * mdlmpe_layer) / (rest + layers * rope_layer),
    )


def assumptions(config, dtype: torch.dtype) -> list[str]:
    return [
        "ESTIMATE from SASS instruction counts, not a measurement (no GPU).",
        f"H100 SXM: {H100['sms']} SMs at {H100['clock_hz'] / 1e9:.3f} GHz; per SM per clock (warp-instr): "
        f"issue {H100['issue']}, fp32 {H100['fp32']}, int/logic {H100['alu']}, MUFU {H100['mufu']}, "
        f"load/store {H100['lsu']} (<= {H100['lsu_bytes']:.0f} B/clk).",
        f"tensor cores: {TENSOR_MAC_PER_CLK} MAC/clk/SM dense peak; efficiency {TENSOR_EFFICIENCY}.",
        "one loop iteration costs its busiest pipe (perfect overlap of pipes, no latency stalls, "
        "loads hit L2/L1; every lane's bytes count against the load/store bandwidth, even where lanes "
        "share an address); the same optimism for the baseline and the kernels.",
        "programs run in waves of the number one SM holds (registers, shared memory, 64 warps); a last "
        "partial wave costs a whole one.",
        f"pair buffers: each kernel takes max(compute, its HBM traffic at {HBM_BYTES_PER_S / 1e12:.2f} TB/s) "
        f"in [|M|, L, L] fp32 planes {PAIR_PLANES} per run, runs per layer {RUNS_PER_LAYER}; the head "
        "groups running together share a tile's planes in L2; whole sequence per launch (symmetric "
        "phase kernels).",
        "instructions outside the main loop (prologue/epilogue), the glue in torch (pair components, "
        "gradient sums) and the atomics' L2 contention are not counted.",
        f"LLaDA-8B: {LLADA}; batch 1; all heads with MDLMPE; {dtype}; MDLMPE launch settings {config}.",
        f"RoPE baseline: Triton flash forward BM={FLASH_BM} BN={FLASH_BN} {FLASH_WARPS} warps "
        f"{FLASH_STAGES} stages, costed alike; backward = {FLASH_BWD_OVER_FWD} x forward.",
        f"rest of step: 6 FLOPs x weights x tokens (projections, SwiGLU, LM head) at MFU {MFU} of "
        f"{DENSE_BF16_FLOPS / 1e12:.0f} TFLOP/s; norms, embeddings, optimizer left out (same both sides).",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--heads-per-program", type=int, default=None, help="override the launch setting")
    p.add_argument("--pair-chunk", type=int, default=None, help="override the launch setting")
    p.add_argument("--num-warps", type=int, default=None, help="override the launch setting")
    p.add_argument("--tile", type=int, default=None, help="override the launch setting")
    p.add_argument("--phase-tile", type=int, default=None, help="override the launch setting")
    p.add_argument("--phase-warps", type=int, default=None, help="override the launch setting")
    p.add_argument("--json", default=None, help="also write the counts and estimates here")
    args = p.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("estimate_gpu: triton is not installed; nothing to compile", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    from mdlmpe_ds.attention.triton.launch import launch_config

    config = launch_config(LLADA["head_dim"], dtype, 90)
    overrides = dict(
        heads_per_program=args.heads_per_program,
        pair_chunk=args.pair_chunk,
        num_warps=args.num_warps,
        tile=args.tile,
        phase_tile=args.phase_tile,
        phase_warps=args.phase_warps,
    )
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    costs, config, resources = mdlmpe_costs(LLADA["head_dim"], dtype, config)
    flash = flash_cost(LLADA["head_dim"], dtype)
    from mdlmpe_ds.attention.triton.launch import heads_per_program

    groups = heads_per_program(LLADA["heads"], config.heads_per_program)
    print("Assumptions:")
    for line in assumptions(config, dtype):
        print(f"  - {line}")
    print("\nSASS per warp per main-loop iteration (sm_90):")
    header = "  ".join(f"{c:>7}" for c in CLASSES)
    print(f"  {'kernel':<15} {header}    total  bound   cycles  regs  spill  shared")
    for c in [*costs.values(), flash]:
        res = resources.get(c.kernel, {})
        row = "  ".join(f"{c.counts[k]:>7}" for k in CLASSES)
        extra = f"{res.get('registers', ''):>5} {res.get('spill', ''):>6} {res.get('shared', ''):>7}"
        print(f"  {c.kernel:<15} {row}  {c.total:>7}  {c.bound:<6} {c.cycles:>7.0f} {extra}")
    from mdlmpe_ds.attention.triton.launch import PHASE_KERNELS, kernel_options

    # Warp-instructions per (head, i, j) and layer. The phase kernels' are shared by all heads and
    # cover half the (i, j) plane (symmetry; the large-L limit), each run RUNS_PER_LAYER times.
    per_pair = 0.0
    for k, c in costs.items():
        warps = kernel_options(k, config)["num_warps"]
        if k in PHASE_KERNELS:
            per_pair += c.total * warps * RUNS_PER_LAYER[k] / (2 * config.phase_tile**2 * LLADA["heads"])
        else:
            per_pair += c.total * warps / (groups * config.tile**2)
    print(f"\n  MDLMPE fwd+bwd warp-instructions per (head, i, j): {per_pair:.1f}")
    rows = [estimate(costs, config, flash, length, groups) for length in args.lengths]
    print("\nESTIMATED time per layer (fwd + bwd) and per LLaDA-8B step, batch 1:")
    for r in rows:
        kernels = ", ".join(f"{k} {r[f'{k}_ms']:.2f}" for k in [*costs, "zero_ddelta"])
        print(
            f"  L={r['length']:>5}: MDLMPE layer {r['mdlmpe_layer_ms']:8.2f} ms ({kernels}; pair buffers "
            f"{r['pair_hbm_gb']:.1f} GB of HBM traffic), RoPE flash "
            f"layer {r['rope_layer_ms']:.3f} ms (x{r['layer_ratio']:.1f}); rest of step "
            f"{r['rest_of_step_ms']:.0f} ms; step RoPE {r['rope_step_ms']:.0f} ms, MDLMPE "
            f"{r['mdlmpe_step_ms']:.0f} ms: ESTIMATED step ratio {r['step_ratio']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                dict(
                    assumptions=assumptions(config, dtype),
                    costs={c.kernel: asdict(c) for c in [*costs.values(), flash]},
                    resources=resources,
                    estimates=rows,
                ),
                fh,
                indent=1,
                default=str,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
