"""Design (b) as Triton can write it: the pair products on tensor cores, probed without a GPU.

The cost model's design (b) (``designs.pair_bias_tc``) puts the rank-2 pair products
C = q_m . k_m and S = q_m x k_m on tensor cores and estimates 1.87x at L = 2048, the only design
the model puts under the cost issue's 2x target. It *assumes* its kernels' resources (8 warps, no
spills, 2 barriers per iteration, 6 -> 2 FP32 operations per (head, i, j, pair)). The project
builds no compiled extension (docs/method.md, "No compiled extension"), so Triton's block
language is the only way to write it. This probe writes (b)'s forward and query-side cores in
that language and reads what the sm_90 compiler makes of them:

- ``tc_pair_forward``: a program owns a (TILE_M, TILE_N) tile; alpha, beta of PAIRS pairs are
  loaded once (standing in for the phase MLP, which is the same in every design) and kept through
  the head loop, as (b) needs; per head, q and k are loaded once for all pairs, and per pair C and
  S are tile products (``tl.dot``, bf16) with the other pairs' K slots masked out of q.
- ``tc_pair_backward_q``: the same tile's query side: dq's sums over keys as tile products, and
  the d delta sums over heads held through the head loop.
- ``interpreter_errors``: both against fp64 references in the Triton interpreter (a subprocess),
  so the probes are checked to compute the right thing before their machine code is read.
- ``probe_rows``: compiled for sm_90 at several pair counts (|M| = 32 at LLaDA-8B): registers,
  spill, and the head loop's instructions per (head, i, j, pair) per warp, beside the shipped
  kernels' (``half_pairs.probe_loops``' figures, recorded in ``SHIPPED``); ``chunked_estimate``:
  a whole forward pass in the chunk that fits (an ESTIMATE).

What it shows (docs/gpu.md, "Design (b) in Triton"): alpha, beta of all 32 pairs do not fit in
registers at an mma-sized tile; a forward chunk of 8 pairs does and saves about 10% of the fp16
forward; the query side spills at every size tried and saves about a quarter of its head loop
before the costs of chunking.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[2]
#: (kernel, pairs, tile_m, tile_n, warps) compiled by ``probe_rows``: mma-sized tiles.
SETTINGS = (
    ("forward", 4, 16, 32, 2),
    ("forward", 8, 16, 32, 2),
    ("forward", 16, 16, 32, 2),
    ("forward", 32, 16, 32, 2),
    ("query side", 2, 16, 32, 2),
    ("query side", 4, 16, 32, 2),
    ("query side", 4, 16, 16, 1),
)
#: The shipped pair_forward's head loop at the launcher's sm_90 settings (16 x 8 tile, 8 warps, all
#: 32 pairs), fp32 and fp16 pair arithmetic: instructions per head and warp (docs/gpu.md's table,
#: tests/unit/test_half_pairs.py checks them against a fresh compile), elements per head and warp.
SHIPPED = {"fp32": 176, "fp16": 117}
#: The shipped pair_backward_q's head loop likewise (the same tile and warps, all 32 pairs).
SHIPPED_QUERY_SIDE = {"fp32": 461, "fp16": 420}
SHIPPED_ELEMENTS = 16 * 8 // 8 * 32
#: The shipped pair_forward's whole pass per warp (docs/gpu.md's rework table): the head loop run
#: 32 times plus the phase MLP's front end (ratio, angle, MLP, alpha, beta) once per tile.
SHIPPED_PASS = 7560
HEADS = 32


@triton.jit
def _tile_pairs(alpha, beta, rows, cols, L, PAIRS: tl.constexpr):
    """alpha, beta [BM, BN] of each pair of the tile, as fp16 tiles (tuples of PAIRS)."""
    alphas = ()
    betas = ()
    for m in tl.static_range(PAIRS):
        off = m * L * L + rows[:, None] * L + cols[None, :]
        alphas = alphas + (tl.load(alpha + off).to(tl.float16),)  # noqa: RUF005
        betas = betas + (tl.load(beta + off).to(tl.float16),)  # noqa: RUF005
    return alphas, betas


@triton.jit
def _key_slots(kp, h, keys, kk, used, L, PAIRS: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """Head h's keys in the K slots of a tile product: (k1, k2) and (-k2, k1) per pair, [KQ, BN]
    (the forward's right operand) or [BN, KQ] (KEYS_FIRST: dq's right operand); fp32."""
    if KEYS_FIRST:
        at = kp + (h * L + keys[:, None]) * (2 * PAIRS)
        slot, ok = kk[None, :], used[None, :]
    else:
        at = kp + (h * L + keys[None, :]) * (2 * PAIRS)
        slot, ok = kk[:, None], used[:, None]
    k = tl.load(at + slot, mask=ok, other=0.0)
    k_j = tl.load(at + (slot ^ 1), mask=ok, other=0.0)  # (k2, k1)
    return k, tl.where(slot % 2 == 0, -k_j, k_j)  # (k1, k2), (-k2, k1)


@triton.jit
def tc_pair_forward(
    alpha, beta, qp, kp, bias, L, HQ,
    PAIRS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KQ: tl.constexpr, OP_DT: tl.constexpr,
):  # fmt: skip
    """bias[h, i, j] = sum_m alpha C + beta S over PAIRS pairs, for every head h of the (BM, BN)
    tile. alpha, beta: [PAIRS, L, L] fp32 (kept as fp16 tiles through the head loop); qp, kp:
    [HQ, L, 2 PAIRS] fp32 pair components (slot 2m + c: component c of pair m); bias [HQ, L, L].

    Per head, q [BM, KQ], k and (J k) [KQ, BN] are loaded and converted once for all pairs (K
    slots past 2 PAIRS are zero); per pair, the slots of the other pairs are masked out of q, and
    C = q1 k1 + q2 k2 and S = q2 k1 - q1 k2 are two tile products: KQ MACs per (i, j) where 2
    count (the smallest bf16 mma K is 16, the best case at 8 pairs)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    kk = tl.arange(0, KQ)
    used = kk < 2 * PAIRS
    alphas, betas = _tile_pairs(alpha, beta, rows, cols, L, PAIRS)
    for h in range(HQ):
        q = tl.load(qp + (h * L + rows[:, None]) * (2 * PAIRS) + kk[None, :], mask=used[None, :], other=0.0)
        k, k_j = _key_slots(kp, h, cols, kk, used, L, PAIRS, False)  # [KQ, BN]
        q, k, k_j = q.to(OP_DT), k.to(OP_DT), k_j.to(OP_DT)
        e = tl.zeros((BM, BN), tl.float32)
        for m in tl.static_range(PAIRS):
            q_m = q * (kk // 2 == m).to(OP_DT)[None, :]  # pair m's two slots only
            c = tl.dot(q_m, k)
            s = tl.dot(q_m, k_j)
            e += alphas[m].to(tl.float32) * c + betas[m].to(tl.float32) * s
        tl.store(bias + (h * L + rows[:, None]) * L + cols[None, :], e.to(bias.dtype.element_ty))


@triton.jit
def tc_pair_backward_q(
    alpha, beta, qp, kp, dbias, dq, ddelta, L, HQ,
    PAIRS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KQ: tl.constexpr, OP_DT: tl.constexpr,
):  # fmt: skip
    """The query side of (b) for one (BM, BN) tile: per head, dq of the tile's rows (the sums over
    keys as tile products: a = dE alpha and b = dE beta times the masked k and (-k2, k1) [BN, KQ],
    added to ``dq`` [HQ, L, 2 PAIRS]) and, summed over the heads through the head loop, X = dE C
    and Y = dE S per pair (C, S as in the forward), then d delta = -beta X + (1 + alpha) Y into
    ``ddelta`` [PAIRS, L, L]. dE = dbias [HQ, L, L] fp32. The shipped pair_backward_q does the same
    per (head, i, j, pair) on CUDA cores, its sums over keys by warp shuffles."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    kk = tl.arange(0, KQ)
    used = kk < 2 * PAIRS
    alphas, betas = _tile_pairs(alpha, beta, rows, cols, L, PAIRS)
    xs = ()
    ys = ()
    for _m in tl.static_range(PAIRS):
        xs = xs + (tl.zeros((BM, BN), tl.float32),)  # noqa: RUF005
        ys = ys + (tl.zeros((BM, BN), tl.float32),)  # noqa: RUF005
    for h in range(HQ):
        ds = tl.load(dbias + (h * L + rows[:, None]) * L + cols[None, :])
        q = tl.load(qp + (h * L + rows[:, None]) * (2 * PAIRS) + kk[None, :], mask=used[None, :], other=0.0)
        k, k_j = _key_slots(kp, h, cols, kk, used, L, PAIRS, False)  # [KQ, BN]: C and S
        kr, kr_j = _key_slots(kp, h, cols, kk, used, L, PAIRS, True)  # [BN, KQ]: dq's sums
        q, k, k_j, kr, kr_j = q.to(OP_DT), k.to(OP_DT), k_j.to(OP_DT), kr.to(OP_DT), kr_j.to(OP_DT)
        dq_tile = tl.zeros((BM, KQ), tl.float32)
        new_x = ()
        new_y = ()
        for m in tl.static_range(PAIRS):
            sel = (kk // 2 == m).to(OP_DT)
            q_m = q * sel[None, :]
            new_x = new_x + (xs[m] + ds * tl.dot(q_m, k),)  # noqa: RUF005
            new_y = new_y + (ys[m] + ds * tl.dot(q_m, k_j),)  # noqa: RUF005
            a = (ds * alphas[m].to(tl.float32)).to(OP_DT)
            b = (ds * betas[m].to(tl.float32)).to(OP_DT)
            # dq1 = sum_j a k1 - b k2, dq2 = sum_j a k2 + b k1 (pair m's two slots)
            dq_tile += tl.dot(a, kr * sel[None, :]) + tl.dot(b, kr_j * sel[None, :])
        xs = new_x
        ys = new_y
        dq_at = dq + (h * L + rows[:, None]) * (2 * PAIRS) + kk[None, :]
        tl.atomic_add(dq_at, dq_tile, mask=used[None, :], sem="relaxed")
    for m in tl.static_range(PAIRS):
        d = -betas[m].to(tl.float32) * xs[m] + (1.0 + alphas[m].to(tl.float32)) * ys[m]
        tl.store(ddelta + m * L * L + rows[:, None] * L + cols[None, :], d)


def reference(alpha, beta, qp, kp):
    """E [HQ, L, L] of ``tc_pair_forward``'s inputs in torch fp64: sum over pairs of alpha C +
    beta S, C = q1 k1 + q2 k2, S = q2 k1 - q1 k2 (triton.kernels' convention)."""
    import torch

    a, b, q, k = (x.double() for x in (alpha, beta, qp, kp))
    c = torch.einsum("hipc,hjpc->hijp", q, k)
    s = torch.einsum("hip,hjp->hijp", q[..., 1], k[..., 0]) - torch.einsum(
        "hip,hjp->hijp", q[..., 0], k[..., 1]
    )
    return (a.permute(1, 2, 0)[None] * c + b.permute(1, 2, 0)[None] * s).sum(-1)


def reference_backward_q(alpha, beta, qp, kp, dbias):
    """(dq [HQ, L, PAIRS, 2], d delta [PAIRS, L, L]) of ``tc_pair_backward_q``'s inputs in fp64:
    dE/dq1 = alpha k1 - beta k2, dE/dq2 = alpha k2 + beta k1 summed over keys with dE = dbias;
    d delta = sum over heads of dE (-beta C + (1 + alpha) S) (pair_bias' formulas)."""
    import torch

    a, b = alpha.double().permute(1, 2, 0), beta.double().permute(1, 2, 0)  # [L, L, PAIRS]
    q, k, ds = qp.double(), kp.double(), dbias.double()

    def keys(w, comp):
        return torch.einsum("hij,ijp,hjp->hip", ds, w, k[..., comp])

    dq = torch.stack([keys(a, 0) - keys(b, 1), keys(a, 1) + keys(b, 0)], -1)
    c = torch.einsum("hipc,hjpc->hijp", q, k)
    s = torch.einsum("hip,hjp->hijp", q[..., 1], k[..., 0]) - torch.einsum(
        "hip,hjp->hijp", q[..., 0], k[..., 1]
    )
    return dq, (ds[..., None] * (-b * c + (1 + a) * s)).sum(0).permute(2, 0, 1)


_CHECK = """
import sys, torch
sys.path.insert(0, {bench!r})
from gpu_cost import tc_probe
torch.manual_seed(0)
heads, length, pairs, tile = 2, 32, 3, 16
alpha = (torch.rand(pairs, length, length) - 0.5) * 0.06
beta = (torch.rand(pairs, length, length) - 0.5) * 0.5
qp, kp = torch.randn(heads, length, pairs, 2), torch.randn(heads, length, pairs, 2)
flat = dict(qp=qp.reshape(heads, length, 2 * pairs), kp=kp.reshape(heads, length, 2 * pairs))
bias = torch.full((heads, length, length), float("nan"))  # poisoned: every element must be written
grid = (length // tile, length // tile)
tc_probe.tc_pair_forward[grid](alpha, beta, flat["qp"], flat["kp"], bias, length, heads, PAIRS=pairs,
                               BM=tile, BN=tile, KQ=16, OP_DT=tc_probe.tl.float32)
want = tc_probe.reference(alpha, beta, qp, kp)
errors = [float((bias.double() - want).abs().max() / want.abs().max())]
dbias = torch.randn(heads, length, length)
dq = torch.zeros(heads, length, 2 * pairs)
ddelta = torch.full((pairs, length, length), float("nan"))  # poisoned
tc_probe.tc_pair_backward_q[grid](alpha, beta, flat["qp"], flat["kp"], dbias, dq, ddelta, length, heads,
                                  PAIRS=pairs, BM=tile, BN=tile, KQ=16, OP_DT=tc_probe.tl.float32)
want_dq, want_dd = tc_probe.reference_backward_q(alpha, beta, qp, kp, dbias)
for got, want in ((dq.reshape(want_dq.shape), want_dq), (ddelta, want_dd)):
    errors.append(float((got.double() - want).abs().max() / want.abs().max()))
print(" ".join(map(str, errors)))
"""


def interpreter_errors() -> dict[str, float]:
    """Max relative errors of the probe kernels (fp32 operands, interpreted) against ``reference``
    and ``reference_backward_q`` on poisoned outputs, at 2 heads, L = 32, 3 pairs, 16 x 16 tiles:
    the forward's bias, the query side's dq and d delta."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    code = _CHECK.format(bench=str(REPO / "benchmarks"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"tc_probe interpreter check failed:\n{out.stderr[-3000:]}")
    values = [float(x) for x in out.stdout.strip().splitlines()[-1].split()]
    return dict(zip(("forward bias", "query side dq", "query side d delta"), values, strict=True))


#: The probe kernels: (function, its pointer arguments (bf16 where named), shipped instructions
#: per head and warp of the same job, fp32 / fp16, from docs/gpu.md's half-pairs table).
KERNELS = {
    "forward": (
        tc_pair_forward,
        {"alpha": "fp32", "beta": "fp32", "qp": "fp32", "kp": "fp32", "bias": "bf16"},
    ),
    "query side": (
        tc_pair_backward_q,
        {n: "fp32" for n in ("alpha", "beta", "qp", "kp", "dbias", "dq", "ddelta")},
    ),
}


def compile_probe(kernel: str, pairs: int, tile_m: int, tile_n: int, warps: int) -> dict:
    """Probe ``kernel`` ("forward", "query side") compiled for sm_90 (bf16 operands, pointers
    16-byte aligned, integers divisible by 16 as at LLaDA-8B's sizes): registers, spill bytes per
    thread, and its head loop (``sass.body_summary``) with the instructions per (head, i, j, pair)
    of one warp."""
    from triton.backends.compiler import GPUTarget

    from gpu_cost import sass
    from mdlmpe_ds.attention.triton import aot

    fn, pointers = KERNELS[kernel]
    signature = {n: f"*{t}" for n, t in pointers.items()}
    signature.update(L="i32", HQ="i32")
    meta = dict(PAIRS=pairs, BM=tile_m, BN=tile_n, KQ=max(16, 2 * pairs), OP_DT=tl.bfloat16)
    signature.update({k: "constexpr" for k in meta})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers) + 2)}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=meta, attrs=attrs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1)
    )
    cubin = compiled.asm["cubin"]
    usage = aot.resource_usage(cubin)
    loops = sass.innermost_loops(sass.parse_sass(aot.sass(cubin)))
    head_loop = sass.body_summary(max(loops, key=len))
    elements = tile_m * tile_n // warps * pairs  # (i, j, pair) of one warp per head
    return dict(
        kernel=kernel,
        pairs=pairs,
        k_slots=meta["KQ"],
        tile=f"{tile_m} x {tile_n}",
        warps=warps,
        registers=usage["REG"],
        spill_bytes=usage["STACK"],
        head_loop=head_loop,
        per_element=head_loop["instructions"] / elements,
        barriers_per_pair=head_loop["barriers"] / pairs,
    )


def probe_rows(settings=SETTINGS) -> list[dict]:
    return [compile_probe(*s) for s in settings]


def chunked_estimate(rows: list[dict]) -> dict[str, float]:
    """ESTIMATE, warp-instructions per (head, i, j, pair) of a whole forward pass: (b) in the
    best-fitting chunk (no spill, fewest per element) with alpha, beta of all pairs computed once
    per tile and written to a scratch that each (head, chunk) reads back (16-byte loads, assumed
    to hit L1), against the shipped kernel's fp32 and fp16 builds. The front end is the shipped
    one's (the same phase MLP), shared by the heads; time is assumed to scale with instructions."""
    front = (SHIPPED_PASS - HEADS * SHIPPED["fp32"]) / (SHIPPED_ELEMENTS * HEADS)
    fits = [r for r in rows if r["kernel"] == "forward" and r["spill_bytes"] == 0]
    best = min(fits, key=lambda r: r["per_element"])
    per_thread = int(best["tile"].split(" x ")[0]) * int(best["tile"].split(" x ")[1]) // (best["warps"] * 32)
    reload = (
        per_thread * best["pairs"] * 2 * 2 / 16 / (per_thread * 32 * best["pairs"])
    )  # LDG.128 per element
    return {
        "front end": front,
        f"(b), chunks of {best['pairs']} pairs": best["per_element"] + reload + front,
        "shipped, fp32": SHIPPED["fp32"] / SHIPPED_ELEMENTS + front,
        "shipped, fp16": SHIPPED["fp16"] / SHIPPED_ELEMENTS + front,
    }


def table(rows: list[dict]) -> str:
    """docs/gpu.md's table of ``probe_rows``, with the shipped pair_forward's figures below."""
    lines = [
        "| build (sm_90) | pairs held through the head loop (K slots) | registers | spill B per thread "
        "| head loop per warp: instructions / barriers / shared / global loads / spill accesses "
        "| instructions per (head, i, j, pair) and warp |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        h = r["head_loop"]
        lines.append(
            f"| (b) {r['kernel']}, {r['tile']}, {r['warps']} warp{'s' if r['warps'] > 1 else ''} | "
            f"{r['pairs']} ({r['k_slots']}) | "
            f"{r['registers']} | {r['spill_bytes']:,} | {h['instructions']} / {h['barriers']} / "
            f"{h['shared']} / {h['global_loads']} / {h['spill']} | {r['per_element']:.2f} |"
        )
    for kernel, shipped in (("pair_forward", SHIPPED), ("pair_backward_q", SHIPPED_QUERY_SIDE)):
        for name, count in shipped.items():
            lines.append(
                f"| shipped {kernel}, {name} pair arithmetic, 16 x 8, 8 warps | 32 | | | {count} | "
                f"{count / SHIPPED_ELEMENTS:.2f} |"
            )
    return "\n".join(lines)


def main() -> int:
    print("interpreter check against the references (relative errors):", interpreter_errors())
    rows = probe_rows()
    print(table(rows))
    print("ESTIMATE, a whole forward pass per (head, i, j, pair), warp-instructions:")
    print({k: round(v, 3) for k, v in chunked_estimate(rows).items()})
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.exit(main())
