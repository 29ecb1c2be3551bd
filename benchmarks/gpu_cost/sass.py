"""Instruction counts of a compiled kernel's main loop, from its sm_90 SASS (``cuobjdump -sass``).

The main loop is the widest backward branch; loops nested directly in it (the per-pair loops of the
MDLMPE kernels) are counted ``trips`` times. Instructions are put in classes whose per-SM issue
rates the cost model knows (FP32, INT/logic, MUFU, tensor, memory, spill, control). Block-wide
barriers (BAR.SYNC) are counted separately: each one puts a wait on the CTA's critical path. The
instructions outside the loop (prologue, epilogue) are counted too: a short loop pays them per
program.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

CLASSES = ("fp32", "alu", "mufu", "tensor", "memory", "spill", "control")
_FP32 = ("FFMA", "FADD", "FMUL", "FMNMX", "HFMA2", "HADD2", "HMUL2", "FSWZADD", "DMUL", "DADD", "DFMA")
_MEMORY = ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "ATOM", "RED", "LDGSTS", "LD", "ST", "UBLKCP")
_CONTROL = ("WARPGROUP", "BRA", "BAR", "BSSY", "BSYNC", "EXIT", "NOP", "WARPSYNC", "DEPBAR", "YIELD")
_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
#: Dense tensor MACs per SM per clock by input type (NVIDIA H100 whitepaper); TF32 half of BF16.
TENSOR_MAC_PER_CLK = {"BF16": 2048.0, "F16": 2048.0, "TF32": 1024.0}


@dataclass
class LoopCounts:
    """Warp-instructions of one warp in one main-loop iteration, by class; tensor MACs (per warp,
    with the kind of MMA: "HGMMA" warpgroup or "HMMA" warp-level) and bytes through the load/store
    unit; ``barriers``: BAR.SYNC per iteration; ``outside``: instructions outside the loop."""

    counts: dict[str, int]
    tensor_macs: dict[str, float] = field(default_factory=dict)
    lsu_bytes: float = 0.0
    spill_bytes: float = 0.0
    barriers: int = 0
    outside: int = 0

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


def _innermost(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The loop spans with no other loop inside them."""
    return [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]


def is_barrier(op: str) -> bool:
    """A block-wide barrier (BAR.SYNC): a wait on the CTA's slowest warp."""
    return op.startswith("BAR.SYNC") or op == "BAR"


def innermost_loops(instrs: list[tuple[int, str, str]]) -> list[list[tuple[int, str, str]]]:
    """The bodies of the loops that contain no other loop, in address order: the per-head loops of
    the pair-bias kernels (one per kernel, the pair-chunk loop unrolled inside it)."""
    return [[i for i in instrs if a <= i[0] <= b] for a, b in sorted(_innermost(_backward_branches(instrs)))]


def executed_per_pass(instrs: list[tuple[int, str, str]], trips: int) -> int:
    """Warp-instructions one warp issues per pass of the widest loop (one looped tile of a backward
    pair kernel; the whole program if the kernel has no such loop, as the pair forward), with every
    innermost loop inside it (the per-head loops) run ``trips`` times."""
    spans = _backward_branches(instrs)
    inner = _innermost(spans)
    outer = [s for s in spans if s not in inner]
    if outer:
        start, end = max(outer, key=lambda s: s[1] - s[0])
        instrs = [i for i in instrs if start <= i[0] <= end]
    looped = sum(1 for i in instrs if any(a <= i[0] <= b for a, b in inner))
    return len(instrs) - looped + trips * looped


def body_summary(body: list[tuple[int, str, str]]) -> dict[str, int]:
    """One loop body's warp-instructions: all of them, FP32, block barriers, shared-memory loads and
    stores (layout conversions through shared memory), warp shuffles (cross-lane sums), global
    loads and local-memory (spill) accesses."""
    ops = [op for _, op, _ in body]
    return {
        "instructions": len(ops),
        "fp32": sum(classify(op) == "fp32" for op in ops),
        "barriers": sum(map(is_barrier, ops)),
        "shared": sum(op.startswith(("LDS", "STS")) for op in ops),
        "shuffles": sum(op.startswith("SHFL") for op in ops),
        "global_loads": sum(op.startswith("LDG") for op in ops),
        "spill": sum(classify(op) == "spill" for op in ops),
    }


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


def mma_macs(op: str) -> tuple[str, str, float]:
    """(kind, input type, MACs per warp) of one HMMA / HGMMA instruction from its shape."""
    kind = op.split(".")[0]
    dtype = next((t for t in TENSOR_MAC_PER_CLK if f".{t}" in op), "BF16")
    shape = re.search(r"\.(\d+)x(\d+)x(\d+)", op)
    if kind == "HGMMA" and shape:
        m, n, k = map(int, shape.groups())
        return kind, dtype, m * n * k / 4  # one warpgroup instruction issued by each of its 4 warps
    digits = re.search(r"\.(16)(8)(\d+)", op)
    return kind, dtype, 16 * 8 * int(digits.group(3)) if digits else 16 * 8 * 16


def access_bytes(op: str) -> float:
    """Bytes one warp moves with one load/store (32 lanes x width; ldmatrix .4 moves 512, plain 128)."""
    if op.startswith(("LDSM", "STSM")):
        last = op.rsplit(".", 1)[1]
        return 128.0 * int(last) if last.isdigit() else 128.0
    width = re.search(r"\.(128|64|32|U16|S16|16|U8|S8)\b", op)
    size = {"128": 16, "64": 8, "32": 4, "U16": 2, "S16": 2, "16": 2, "U8": 1, "S8": 1}
    return 32.0 * (size[width.group(1)] if width else 4)


def loop_counts(sass_text: str, trips: int = 1) -> LoopCounts:
    """Counts of one warp's main-loop iteration (nested per-pair loops ``trips`` times)."""
    instrs = parse_sass(sass_text)
    body = main_loop(instrs, trips)
    counts = Counter(classify(op) for _, op, _ in body)
    out = LoopCounts({c: counts[c] for c in CLASSES})
    for _, op, _ in body:
        cls = classify(op)
        if cls == "tensor":
            kind, dtype, macs = mma_macs(op)
            # TF32 runs at half the BF16 rate: count it as twice the BF16-equivalent MACs.
            scale = TENSOR_MAC_PER_CLK["BF16"] / TENSOR_MAC_PER_CLK[dtype]
            out.tensor_macs[kind] = out.tensor_macs.get(kind, 0.0) + macs * scale
        elif cls in ("memory", "spill"):
            out.lsu_bytes += access_bytes(op)
            if cls == "spill":
                out.spill_bytes += access_bytes(op)
        if is_barrier(op):
            out.barriers += 1
    start, end = _backward_branches(instrs)[0]
    out.outside = sum(1 for a, _, _ in instrs if not start <= a <= end)
    return out
