"""Launch settings of the fused Triton MDLMPE kernels: one function of (d_h, dtype, GPU), shared by
the launcher (``triton.backend``), the ahead-of-time resource check (``triton.aot``, run by
tests/unit/test_triton_resources.py on the CPU) and ``benchmarks/bench_attention_gpu.py``.

Why a table and not Triton's autotuner: the limits that matter are hard ones. Shared memory over
the per-block maximum of the GPU makes the launch fail (Triton raises OutOfResources), and a
kernel at the 255-register cap spills to local memory. Both are properties of the compiled cubin,
which ``triton.compile`` produces for any target on a CPU-only machine, so every entry below is
checked in CI for sm_80 (A100) and sm_90 (H100) at d_h 64 and 128, bf16 and fp32.

No pure-Python dependency on triton here: importing this module never picks the interpreter.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

#: Largest |tau_max| for which the kernels use polynomial sin / cos (kernels.POLY_TAU_MAX; repeated
#: here so that this module never imports triton; a test checks they agree).
POLY_TAU_MAX = 0.5

#: Largest shared memory one block may request, in bytes (CUDA's opt-in per-block maximum, the
#: limit Triton checks at launch): A100 163 KiB, H100 227 KiB.
SHARED_MEMORY_LIMIT = {80: 166_912, 90: 232_448}
#: Capabilities whose launch settings are compiled and checked in CI (tests/unit/test_triton_resources.py).
CHECKED_CAPABILITIES = (80, 90)
#: Head sizes and dtypes checked there (fp16 shares bf16's settings: same element size).
CHECKED_HEAD_DIMS = (64, 128)
CHECKED_DTYPES = (torch.bfloat16, torch.float32)
#: The kernels and the name of each one's output / upstream-gradient pointers in the model dtype.
KERNELS = ("phase_forward", "forward", "backward", "phase_backward")
#: The head-independent kernels (pair tiles of ``phase_tile``, no head axis); the others are per head.
PHASE_KERNELS = ("phase_forward", "phase_backward")
_warned: set[int] = set()


@dataclass(frozen=True)
class LaunchConfig:
    """Static launch parameters of the four kernels (``triton.kernels``).

    ``tile``: row and key tile edge (BM = BN) of the per-head kernels (forward, backward);
    ``heads_per_program``: query heads sharing one alpha/beta tile load there (G, rounded down to
    a power-of-2 divisor of Hq at launch); ``num_warps``, ``num_stages``: Triton's for those
    kernels (stages = software-pipelining depth of the key loop); ``max_registers``: the PTX
    ``.maxnreg`` bound (Triton's ``maxnreg``) per thread, all kernels. The head-independent phase
    kernels have their own ``phase_tile`` and ``phase_warps`` (their [tile^2, F] MLP input lives in
    registers) and ``pair_chunk``: MDLMPE pairs per chunk of the MLP's output layer (>= 16 on a GPU,
    a tile product).
    """

    tile: int
    heads_per_program: int
    pair_chunk: int
    num_warps: int
    num_stages: int
    max_registers: int
    phase_tile: int = 16
    phase_warps: int = 8


def launch_config(head_dim: int, dtype: torch.dtype, capability: int) -> LaunchConfig:
    """The launch settings for head size ``head_dim``, q/k/v ``dtype`` and compute capability
    ``capability`` (e.g. 90 for sm_90), chosen from ahead-of-time compiles (table in the report of
    tests/unit/test_triton_resources.py) and, on sm_90, from GPU measurements.

    - 16-bit inputs on sm_90: tile 64, one head per program, 8 warps. **Measured** on one H100
      (``benchmarks/sweep_launch_gpu.py``, LLaDA-8B layer, L = 2048, 2026-11-28; 15 settings):
      the backward 19.5 ms against 33.2 ms at the previous tile 64 / 2 heads / 4 warps (the cost
      model had ranked that one first), the layer fwd + bwd 32.3 ms against 46.3. It compiles
      without spills (forward 185, backward 250 registers; 64 / 96 KiB of shared memory). What
      the sweep found slower: 2 heads per program (8 warps 22.5 ms, 4 warps 33.2), tile 32
      (23.5-48.8), a register cap of 168 or 128 (25.2-34.5: spills), 2 pipelining stages (the same).
    - 16-bit inputs on sm_80 (A100, 163 KB): tile 32, G = 2, 4 warps (88 KB; not measured on a GPU).
    - fp32 inputs (tests, debugging): tile 16, G = 2, within both GPUs' shared memory.
    - 1 pipelining stage: the kernels are bound by the pair arithmetic on CUDA cores, not by the
      k / v loads a deeper pipeline would prefetch into shared memory.
    - phase kernels: 16 x 16 pair tiles (their [tile^2, F] MLP input lives in registers), 8 warps,
      the MLP's output layer in chunks of 16 pairs (a tile product needs >= 16), PHASE_KEY_SPAN key
      positions per program (the last span of a row shorter when it does not divide LP).
    - floating-point fusion on in every kernel (``FP_FUSION``, passed by ``kernel_options``).
    """
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"triton launch config: dtype {dtype} is not bf16, fp16 or fp32")
    if head_dim > 128:
        raise ValueError(
            f"triton launch config: d_h={head_dim} has no checked launch settings (d_h <= 128 only); "
            "use attention backend 'blocked'"
        )
    if capability not in CHECKED_CAPABILITIES and capability not in _warned:
        _warned.add(capability)
        log.warning(
            "triton launch config: sm_%d is not among the checked targets %s; using the sm_80 settings "
            "(Triton raises OutOfResources at launch if they do not fit)",
            capability,
            CHECKED_CAPABILITIES,
        )
    if dtype == torch.float32:
        tile, heads, warps = 16, 2, 4
    else:
        tile, heads, warps = (64, 1, 8) if capability >= 90 else (32, 2, 4)
    return LaunchConfig(
        tile=tile, heads_per_program=heads, pair_chunk=16, num_warps=warps, num_stages=1, max_registers=255
    )


#: Key positions one phase-kernel program covers (a multiple of every phase tile).
PHASE_KEY_SPAN = 256


def padded_length(length: int, step: int) -> int:
    """L rounded up to a multiple of ``step``: the pair buffers' and pair components' length LP."""
    return -(-length // step) * step


def pair_padding(config: LaunchConfig) -> int:
    """The step LP is a multiple of: every tile of both kinds of kernel (powers of 2) divides it,
    so the kernels' pair loops need no masks."""
    return max(config.tile, config.phase_tile)


def phase_key_span(padded: int, config: LaunchConfig) -> int:
    """Key positions per phase-kernel program: PHASE_KEY_SPAN, so that batch 1 fills a GPU, within
    [phase_tile, LP]. It need not divide LP: a launch has ceil(LP / span) spans per row tile, the
    last one clamped to LP by the kernels."""
    return max(config.phase_tile, min(padded, PHASE_KEY_SPAN))


def device_capability(device: torch.device) -> int:
    """Compute capability of a CUDA device as an integer (sm_90 -> 90)."""
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def pow2(n: int, floor: int) -> int:
    """Smallest power of 2 >= max(n, floor)."""
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def pair_chunking(num_mdlmpe: int, pair_chunk: int, interpreting: bool) -> tuple[int, int]:
    """(MC, NC): MDLMPE pairs per chunk of the phase MLP's output layer and the number of chunks,
    for every kernel that chunks the pairs (phase, pair-bias). MC is a power of 2, at least 16 on
    a GPU (a tile product) and at most ``pair_chunk``; MC x NC pairs are computed, the ones past
    |M| with zero weights (the pair-bias kernels' padded pair arrays are MC x NC wide)."""
    mc = min(pow2(num_mdlmpe, 1 if interpreting else 16), pair_chunk)
    return mc, math.ceil(num_mdlmpe / mc)


def heads_per_program(num_heads: int, cap: int) -> int:
    """Largest power-of-2 divisor of ``num_heads`` not above ``cap``."""
    g = 1
    while g * 2 <= cap and num_heads % (g * 2) == 0:
        g *= 2
    return g


def kernel_constexprs(
    *,
    num_heads: int,
    num_kv: int,
    head_dim: int,
    hidden: int,
    num_mdlmpe: int,
    dtype: torch.dtype,
    config: LaunchConfig,
    interpreting: bool,
    tau_max: float = 0.25,
) -> dict[str, dict[str, object]]:
    """Each kernel's tl.constexpr arguments for one call, keyed by kernel name (``KERNELS``).

    Every padded extent is a power of 2, at least 16 on a GPU (tile products need every dimension
    >= 16); the interpreter has no such floor. PREC: TF32 tile products for 16-bit inputs, IEEE for
    fp32; UPCAST: bf16 tile operands upcast in the interpreter (its bf16 dot is wrong in triton 3.9);
    POLY: alpha, beta by polynomials (|tau_max| within their checked range, kernels.POLY_TAU_MAX).
    """
    floor = 1 if interpreting else 16
    mc, nc = pair_chunking(num_mdlmpe, config.pair_chunk, interpreting)
    prec = "ieee" if dtype == torch.float32 else "tf32"
    phase = dict(
        FP=pow2(head_dim // 2, floor),
        HP=pow2(hidden, floor),
        MC=mc,
        NC=nc,
        BM=config.phase_tile,
        BN=config.phase_tile,
        PREC=prec,
        POLY=abs(tau_max) <= POLY_TAU_MAX,
    )
    head = dict(
        REP=num_heads // num_kv,
        G=heads_per_program(num_heads, config.heads_per_program),
        DH=head_dim,
        DP=pow2(head_dim, floor),
        BM=config.tile,
        BN=config.tile,
        PREC=prec,
        UPCAST=interpreting,
    )
    return {name: phase if name in PHASE_KERNELS else head for name in KERNELS}


#: Floating-point contraction (a * b + c fused into one FMA) in every kernel, set explicitly: the
#: numbers and the error bounds of the tests were checked with it on, and Triton 3.10 changes the
#: default to off (triton 3.9 warns when TRITON_DEFAULT_FP_FUSION is unset).
FP_FUSION = True


def kernel_options(kernel: str, config: LaunchConfig) -> dict[str, object]:
    """Triton's launch / compile options of ``kernel``: warps, pipelining stages, register cap and
    floating-point fusion (``FP_FUSION``), the same for a launch and an ahead-of-time compile."""
    warps = config.phase_warps if kernel in PHASE_KERNELS else config.num_warps
    stages = 1 if kernel in PHASE_KERNELS else config.num_stages
    return dict(num_warps=warps, num_stages=stages, maxnreg=config.max_registers, enable_fp_fusion=FP_FUSION)


# ------------------------------------------------------------------ the pair-bias kernels (triton-pair)
#: The kernels of the ``triton-pair`` backend (``triton.pair_bias``): the bias forward, and the
#: backward's query side (with the phase MLP) and key side.
PAIR_KERNELS = ("pair_forward", "pair_backward_q", "pair_backward_k")
#: The pair kernels whose per-head pair arithmetic gains from fp16 (``PairLaunchConfig.half_pairs``;
#: sm_90 machine code, docs/gpu.md "the pair arithmetic in fp16"): the forward (117 instructions per
#: head against 176) and the query side (420 against 461). The key side issues more in fp16.
HALF_PAIR_KERNELS = ("pair_forward", "pair_backward_q")


@dataclass(frozen=True)
class PairLaunchConfig:
    """Static launch parameters of the pair-bias kernels. Each kernel has its own tile, warps and
    register cap (``pair_kernel_settings``): the forward and the query-side backward take
    ``tile_m`` x ``tile_n``, ``num_warps``, ``max_registers``; the key-side backward
    ``key_tile_m`` x ``key_tile_n``, ``key_num_warps``, ``key_max_registers``. A kernel's
    (i, j) tile is its work per program or loop step (its [tile_m tile_n, F] MLP input and
    [tile_m, tile_n, pair_chunk] alpha, beta live in registers): the forward's grid is
    (L / tile_m, L / tile_n, B), the query side's (L / tile_m, key splits, B) over key tiles of
    tile_n, the key side's (L / key_tile_n, row splits, B) over row tiles of key_tile_m.
    ``pair_chunk``: MDLMPE pairs per chunk of the MLP's output layer (>= 16 on a GPU: a tile
    product). ``key_splits`` / ``row_splits``: how many parts the query side's key loop / the key
    side's row loop is cut into; 0 (the default) lets ``pair_backward_splits`` choose per call, a
    positive value is taken as given (tests, sweeps). The defaults are the sm_90 choice
    (``pair_launch_config``)."""

    tile_m: int = 16
    tile_n: int = 8
    pair_chunk: int = 16
    num_warps: int = 8
    max_registers: int = 255
    key_splits: int = 0
    row_splits: int = 0
    key_tile_m: int = 32
    key_tile_n: int = 8
    key_num_warps: int = 8
    #: 128 lets two 8-warp key-side CTAs share an SM's 64 K registers (measured: 7.4 ms at
    #: L = 2048 against 16.5 ms uncapped at 16 x 8, ``pair_launch_config``).
    key_max_registers: int = 128
    #: The kernels (of PAIR_KERNELS) whose per-head pair arithmetic runs in fp16, packed two to a
    #: register, every sum in fp32 (``pair_bias``'s PAIR_DT; e.g. HALF_PAIR_KERNELS). Not a default:
    #: its speed is unmeasured. A call with fp32 inputs, or whose q, k are too large for fp16's
    #: range (``pair_backend.half_pairs_fit``), runs in fp32; the backward shifts dBias by a power
    #: of two first.
    half_pairs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [k for k in self.half_pairs if k not in PAIR_KERNELS]
        if unknown or len(set(self.half_pairs)) != len(self.half_pairs):
            raise ValueError(
                f"PairLaunchConfig.half_pairs={self.half_pairs!r}: expected distinct names of {PAIR_KERNELS}"
            )

    @classmethod
    def uniform(cls, tile_m: int, tile_n: int, num_warps: int = 8, max_registers: int = 255, **rest):
        """One tile, warp count and register cap for all three kernels (tests, sweeps); ``rest``:
        the other fields (``key_max_registers`` defaults to ``max_registers`` here)."""
        rest.setdefault("key_max_registers", max_registers)
        return cls(
            tile_m=tile_m, tile_n=tile_n, num_warps=num_warps, max_registers=max_registers,
            key_tile_m=tile_m, key_tile_n=tile_n, key_num_warps=num_warps, **rest,
        )  # fmt: skip


@dataclass(frozen=True)
class PairKernelSettings:
    """One pair kernel's tile (rows x keys), warps and register cap."""

    tile_m: int
    tile_n: int
    num_warps: int
    max_registers: int


def pair_kernel_settings(config: PairLaunchConfig, kernel: str) -> PairKernelSettings:
    """The tile, warps and register cap ``kernel`` runs with under ``config``."""
    if kernel not in PAIR_KERNELS:
        raise ValueError(f"pair kernel {kernel!r}: expected one of {PAIR_KERNELS}")
    if kernel == "pair_backward_k":
        c = config
        return PairKernelSettings(c.key_tile_m, c.key_tile_n, c.key_num_warps, c.key_max_registers)
    return PairKernelSettings(config.tile_m, config.tile_n, config.num_warps, config.max_registers)


def pair_launch_config(head_dim: int, dtype: torch.dtype, capability: int) -> PairLaunchConfig:
    """The pair-bias kernels' launch settings for ``head_dim``, ``dtype`` and sm_``capability``
    (the same everywhere so far), each kernel's chosen by **measurement** on one H100
    (``benchmarks/sweep_launch_gpu.py``: 18 settings, LLaDA-8B layer, L = 2048, 2026-11-28):

    - forward and query-side backward: 16 x 8 tiles, 8 warps (forward 4.6 ms, query side 17.6 ms;
      at the previous 8 x 16 / 8 warps 6.4 and 18.4). The query side as measured held the phase
      MLP's hidden layer and its gradient through the head loop and spilled at every tile that
      fits (280 B per thread at 16 x 8 compiled as launched, ``aot._DIVISIBLE_INTS``; the sweep's
      compiles, without the head counts marked, gave 328 B at 16 x 8 and 224 B at 8 x 16); a cap
      of 128 registers (16 warps) made it 1.2-2.5x slower. Today's query side (heads outer, the
      hidden layer recomputed after the head loop, ``pair_bias``) spills 256 B; not yet timed.
    - key-side backward: 32 x 8 tiles (a program owns 8 keys and loops over row tiles of 32),
      8 warps under 128 registers, so two CTAs share an SM: 7.4 ms, against 13.6 at the previous
      8 x 16 and 9.9 at 16 x 8 (16.5 uncapped there). It spilled 168 B per thread (216 B in the
      sweep's compile); today's (alpha, beta of both pair chunks live through its head loop)
      spills 160 B, not yet timed.
    - pairs in chunks of 16 (the smallest tile product), one pipelining stage.
    - The layer (the three kernels and SDPA's biased attention, fwd + bwd): 33.8 ms, against 42.0
      at the sweep's 8 x 16 / 8 warps for all three (``make gpu-check``'s benchmark; the records
      in benchmarks/gpu_cost/).
    On sm_80 (not measured on a GPU) the same settings are used.
    """
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"triton pair launch config: dtype {dtype} is not bf16, fp16 or fp32")
    if head_dim > 128:
        raise ValueError(f"triton pair launch config: d_h={head_dim} has no checked launch settings (<= 128)")
    return PairLaunchConfig()


def pair_padded_length(config: PairLaunchConfig, length: int) -> int:
    """LP: L rounded up to a multiple of every tile edge of the three pair kernels, the rows of the
    padded pair-component arrays (``pair_backend.pair_components``): every tile a kernel loads
    lies inside them, so their loads need no mask."""
    step = max(config.tile_m, config.tile_n, config.key_tile_m, config.key_tile_n)
    return padded_length(length, step)


def pair_constexprs(
    *,
    num_heads: int,
    num_kv: int,
    head_dim: int,
    hidden: int,
    num_mdlmpe: int,
    dtype: torch.dtype,
    config: PairLaunchConfig,
    interpreting: bool,
    kernel: str,
    tau_max: float = 0.25,
) -> dict[str, object]:
    """The tl.constexpr arguments of pair-bias kernel ``kernel``: the phase kernels' padding rules
    (``kernel_constexprs``), the kernel's own tile (``pair_kernel_settings``), and REP = Hq / Hkv."""
    tile = pair_kernel_settings(config, kernel)
    floor = 1 if interpreting else 16
    mc, nc = pair_chunking(num_mdlmpe, config.pair_chunk, interpreting)
    return dict(
        REP=num_heads // num_kv,
        FP=pow2(head_dim // 2, floor),
        HP=pow2(hidden, floor),
        MC=mc,
        NC=nc,
        BM=tile.tile_m,
        BN=tile.tile_n,
        PREC="ieee" if dtype == torch.float32 else "tf32",
        POLY=abs(tau_max) <= POLY_TAU_MAX,
    )


#: Waves of programs (multiples of the GPU's SM count) the split backward kernels aim for.
PAIR_WAVES = 4
#: Bound on each backward kernel's fp32 partial pair gradients, as a fraction of the bias and its
#: gradient (2 Hq L^2 elements of the attention's dtype per sequence) that the backend keeps anyway.
PAIR_SLOT_FRACTION = 1 / 8
#: SM count used where there is no CUDA device (the interpreter): an H100 SXM's.
DEFAULT_SM_COUNT = 132


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; ``DEFAULT_SM_COUNT`` elsewhere."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_loop(tiles: int, splits: int) -> tuple[int, int]:
    """Cut a loop over ``tiles`` tiles into at most ``splits`` parts of equal length (the last one
    shorter when they do not divide): (parts, tiles per part), no part empty."""
    per = -(-tiles // max(1, min(splits, tiles)))
    return -(-tiles // per), per


def pair_backward_splits(
    config: PairLaunchConfig,
    *,
    length: int,
    batch: int,
    num_heads: int,
    num_kv: int,
    padded_pairs: int,
    bias_itemsize: int,
    sms: int,
) -> dict[str, tuple[int, int]]:
    """How the backward kernels' serial loops are cut: {"q": (key splits, key tiles per split),
    "k": (row splits, row tiles per split)} (``split_loop``).

    Why: without splits the query side has L / tile_m x B programs, each over all L / tile_n key
    tiles, and the key side L / key_tile_n x B programs (256 at L = 2048, batch 1: two per SM of
    an H100) each over all row tiles; a program's loop is a long dependent chain (load, phase MLP,
    pair arithmetic) whose latency few warps per SM cannot hide, and a grid of one or two waves
    leaves SMs idle at its end. Rule: the smallest split count giving ``PAIR_WAVES`` waves
    (programs >= 4 x SMs, so the grid is cut into programs short enough that the last wave is a
    small part of the time, and as many CTAs as fit beside one another on an SM have work),
    capped so that each kernel's fp32 partial pair gradients, splits x B x H x LP x 2 NMP x 4 bytes
    (H = Hq for the query side, Hkv for the key side; LP = ``pair_padded_length`` rows and
    NMP = ``padded_pairs`` pairs, the size ``pair_components`` gives them: a d_h 32 model's 8 pairs
    are 16 on a GPU), stay within ``PAIR_SLOT_FRACTION`` of the bias and its gradient
    (B x 2 Hq L^2 x itemsize bytes). For LLaDA-8B (Hq = Hkv = 32,
    |M| = 32, bf16) one split's slots are 64 / L of the bias memory, so at most L / 512 splits:
    at the sm_90 settings L = 1024 gets 2 / 2 (query / key side), 2048 gets 4 / 3, 4096 gets
    3 / 2 (query side: 96 MiB of slots, 2 GiB of bias and gradient). The partials are summed in
    torch in split order: a deterministic backward. ``config.key_splits`` / ``row_splits`` > 0 are
    taken as given.

    What splits alone cannot do: raise the warps resident per SM. That is set by registers: the
    query side uses 255 registers per thread, so one 8-warp CTA fits an SM's 64 K registers; more
    waves then keep every SM busy to the end but hide no more latency. The key side runs under
    ``PairLaunchConfig.key_max_registers`` = 128, so two of its CTAs share an SM (measured faster,
    ``pair_launch_config``); the query side spills over 1 KB per thread there.
    """
    bias_bytes = batch * 2 * num_heads * length**2 * bias_itemsize
    out = {}
    c = config
    for side, programs, loop, heads, forced in (
        ("q", -(-length // c.tile_m), -(-length // c.tile_n), num_heads, c.key_splits),
        ("k", -(-length // c.key_tile_n), -(-length // c.key_tile_m), num_kv, c.row_splits),
    ):
        splits = forced
        if splits <= 0:
            slot_bytes = batch * heads * pair_padded_length(c, length) * 2 * padded_pairs * 4
            splits = -(-PAIR_WAVES * sms // (programs * batch))
            splits = min(splits, max(1, int(PAIR_SLOT_FRACTION * bias_bytes // slot_bytes)))
        out[side] = split_loop(loop, splits)
    return out


def pair_kernel_options(config: PairLaunchConfig, kernel: str) -> dict[str, object]:
    """Triton's launch / compile options of pair-bias kernel ``kernel``: its own warps and register
    cap (``pair_kernel_settings``), one pipelining stage (no loads worth prefetching into shared
    memory, the work is the pair arithmetic)."""
    own = pair_kernel_settings(config, kernel)
    return dict(num_warps=own.num_warps, num_stages=1, maxnreg=own.max_registers, enable_fp_fusion=FP_FUSION)
