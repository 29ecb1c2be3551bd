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
KERNELS = ("forward", "backward")
_warned: set[int] = set()


@dataclass(frozen=True)
class LaunchConfig:
    """Static launch parameters of the two kernels (forward, backward).

    ``tile``: row and key tile edge (BM = BN); ``heads_per_program``: query heads sharing one
    alpha/beta tile (G, rounded down to a power-of-2 divisor of Hq at launch); ``pair_chunk``:
    MDLMPE pairs per alpha/beta chunk (the live pair tiles are [tile, tile, pair_chunk]);
    ``num_warps``, ``num_stages``: Triton's (stages = software-pipelining depth of the key loop);
    ``max_registers``: the PTX ``.maxnreg`` bound (Triton's ``maxnreg``) per thread;
    ``pair_split``: 1 or 2 sub-chunks per pair chunk for the per-head [G, tile, tile, sub] work
    (2 halves its registers; the chunk itself stays >= 16 wide for the MLP's tile product).
    """

    tile: int
    heads_per_program: int
    pair_chunk: int
    num_warps: int
    num_stages: int
    max_registers: int
    pair_split: int = 2


def launch_config(head_dim: int, dtype: torch.dtype, capability: int) -> LaunchConfig:
    """The launch settings for head size ``head_dim``, q/k/v ``dtype`` and compute capability
    ``capability`` (e.g. 90 for sm_90), chosen from ahead-of-time compiles (table in the report of
    tests/unit/test_triton_resources.py; before/after numbers in the module docstring of
    triton.backend).

    - tile 16 everywhere: the correction's [G, tile, tile, pairs] head tiles and the
      [tile * tile, F] MLP input live in registers and grow as tile^2 (a 32-tile was over every
      GPU's shared memory at d_h 128 with the earlier three-kernel design).
    - 8 warps: the register file is 64 K x 32 bit per SM, so 8 warps is the widest split that still
      gives each thread the 255-register maximum (stated: left to itself ptxas may pick 128).
    - 1 pipelining stage: the kernels are bound by the pair arithmetic on CUDA cores, not by the
      k / v loads a deeper pipeline would prefetch into shared memory.
    - 4 heads per program, pairs in chunks of 16 split into even / odd halves: the head-independent
      work (angle, phase MLP, alpha, beta) is shared by the G heads, so more heads per program
      cost less per head, until spills dominate. sm_90, d_h 128, bf16, ESTIMATED step ratio at
      L = 2048 (benchmarks/estimate_gpu.py): G = 1: 12.1x, 2: 7.4x, 4: 5.8x; G = 8 needs 238 KB of
      shared memory in the backward (over the limit). fp32 at d_h > 64 uses G = 1: with 2 the
      backward needs 197 KB of shared memory, over the A100's 163 KB.
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
    heads = 1 if dtype == torch.float32 and head_dim > 64 else 4
    return LaunchConfig(
        tile=16, heads_per_program=heads, pair_chunk=16, num_warps=8, num_stages=1, max_registers=255
    )


def device_capability(device: torch.device) -> int:
    """Compute capability of a CUDA device as an integer (sm_90 -> 90)."""
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def pow2(n: int, floor: int) -> int:
    """Smallest power of 2 >= max(n, floor)."""
    return max(floor, 1 << max(0, (n - 1).bit_length()))


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
    tile: int,
    heads: int,
    chunk: int,
    interpreting: bool,
    tau_max: float = 0.25,
    split: int = 2,
) -> dict[str, object]:
    """The kernels' tl.constexpr arguments for one call (the same for both kernels).

    Every padded extent is a power of 2, at least 16 on a GPU (tile products need every dimension
    >= 16); the interpreter has no such floor. PREC: TF32 tile products for 16-bit inputs, IEEE for
    fp32; UPCAST: bf16 tile operands upcast in the interpreter (its bf16 dot is wrong in triton 3.9);
    POLY: alpha, beta by polynomials (|tau_max| within their checked range, kernels.POLY_TAU_MAX).
    """
    floor = 1 if interpreting else 16
    mc = min(pow2(num_mdlmpe, floor), chunk)
    return dict(
        REP=num_heads // num_kv,
        G=heads_per_program(num_heads, heads),
        DH=head_dim,
        DP=pow2(head_dim, floor),
        FP=pow2(head_dim // 2, floor),
        HP=pow2(hidden, floor),
        MC=mc,
        NC=math.ceil(num_mdlmpe / mc),
        SPLIT=2 if split == 2 and mc % 2 == 0 else 1,
        BM=tile,
        BN=tile,
        PREC="ieee" if dtype == torch.float32 else "tf32",
        UPCAST=interpreting,
        POLY=abs(tau_max) <= POLY_TAU_MAX,
    )
