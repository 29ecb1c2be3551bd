"""Ahead-of-time compiles of the fused MDLMPE kernels for a GPU target, without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", capability, 32))`` builds the real cubin
on a CPU-only machine (triton ships ptxas and cuobjdump). From it: the shared memory the launch
will request (``metadata.shared``; Triton raises OutOfResources at launch above the device's
per-block maximum, ``triton.launch.SHARED_MEMORY_LIMIT``), and from ``cuobjdump -res-usage`` the
registers per thread and the spill stack (bytes of local memory per thread).

The compile uses exactly what the launcher passes (``triton.launch.launch_config`` and
``kernel_constexprs``; pointers 16-byte aligned, as torch allocations are), at LLaDA-like dims:
query heads = KV heads, phase MLP hidden width max(16, F / 2). Used by
tests/unit/test_triton_resources.py and ``benchmarks/bench_attention_gpu.py --compile-only``.
Importing this module imports triton (compiler mode unless TRITON_INTERPRET=1 is set).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from mdlmpe_ds.attention.triton.launch import (
    PAIR_KERNELS,
    PHASE_KERNELS,
    SHARED_MEMORY_LIMIT,
    LaunchConfig,
    PairLaunchConfig,
    kernel_constexprs,
    kernel_options,
    launch_config,
    pair_constexprs,
    pair_kernel_options,
    pair_kernel_settings,
    pair_launch_config,
)
from mdlmpe_ds.pe.phase import mdlmpe_pairs

_INTS = {"L", "LP", "R0", "RB", "KSPAN", "SYM", "HQ", "HKV", "F", "HID", "NM", "SPLIT_TILES"}
_FLOATS = {"tau_max", "clip_kappa", "scale"}
_DIVISIBLE_INTS = {"L", "LP", "R0", "RB", "KSPAN", "HQ", "HKV", "F", "HID", "NM"}
# Pointers in the model dtype (q, k, v and the output or its gradient); every other one is fp32
# (the pair kernels' qpair, kpair included: pair_backend.pair_components).
_MODEL_DTYPE_POINTERS = {"q", "k", "v", "o", "do_ptr", "bias", "dbias"}
_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class KernelResources:
    """What one compiled kernel needs per block / thread on its target."""

    kernel: str
    capability: int
    head_dim: int
    dtype: str
    config: LaunchConfig | PairLaunchConfig
    shared_bytes: int
    shared_limit: int
    registers: int
    spill_bytes: int
    compile_s: float
    #: Memory-fence instructions in the machine code (``fence_instructions``): each one stalls the
    #: warp until its earlier memory operations are visible GPU-wide.
    fences: int = 0

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= self.shared_limit

    def row(self) -> dict[str, object]:
        out = asdict(self)
        out["config"] = asdict(self.config)
        out["fits"] = self.fits
        return out

    def line(self) -> str:
        c = self.config
        cap = c.max_registers
        if self.kernel in PAIR_KERNELS:
            own = pair_kernel_settings(c, self.kernel)
            shape = f"tile={own.tile_m}x{own.tile_n} chunk={c.pair_chunk} warps={own.num_warps}"
            cap = own.max_registers
        elif self.kernel in PHASE_KERNELS:
            shape = f"tile={c.phase_tile} chunk={c.pair_chunk} warps={c.phase_warps}"
        else:
            shape = f"tile={c.tile} G={c.heads_per_program} warps={c.num_warps} stages={c.num_stages}"
        return (
            f"{self.kernel:<14} sm_{self.capability} d_h={self.head_dim:<4} {self.dtype:<5} "
            f"{shape} maxnreg={cap}: "
            f"shared {self.shared_bytes:>7,} B of {self.shared_limit:,} "
            f"({'fits' if self.fits else 'OVER'}), {self.registers} registers, "
            f"{self.spill_bytes} B spill/thread, {self.fences} fences ({self.compile_s:.0f} s)"
        )


def _kernel_fn(name: str):
    from mdlmpe_ds.attention.triton import kernels as kern

    return {
        "phase_forward": kern.phase_fwd_kernel,
        "forward": kern.mdlmpe_fwd_kernel,
        "backward": kern.mdlmpe_bwd_kernel,
        "phase_backward": kern.phase_bwd_kernel,
    }[name]


def _pair_kernel_fn(name: str):
    from mdlmpe_ds.attention.triton import pair_bias

    return {
        "pair_forward": pair_bias.pair_bias_fwd_kernel,
        "pair_backward_q": pair_bias.pair_bias_bwd_q_kernel,
        "pair_backward_k": pair_bias.pair_bias_bwd_k_kernel,
    }[name]


def cuobjdump_path() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``cuobjdump -res-usage`` of a cubin: {"REG": registers/thread, "STACK": spill bytes/thread, ...}."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        out = subprocess.run(
            [cuobjdump_path(), "-res-usage", fh.name], capture_output=True, text=True, check=True
        ).stdout
    line = next((ln for ln in out.splitlines() if "REG:" in ln), None)
    if line is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line:\n{out}")
    return {k: int(v) for k, v in (item.split(":", 1) for item in line.split() if ":" in item) if v.isdigit()}


def compile_cubin(
    kernel: str,
    head_dim: int,
    dtype: torch.dtype,
    capability: int,
    config: LaunchConfig | PairLaunchConfig | None = None,
    num_heads: int = 32,
    constexprs: dict | None = None,
    pointers: dict | None = None,
):
    """Triton's compiled kernel (``.asm["cubin"]``, ``.metadata.shared``) of ``kernel`` ("forward",
    "backward") for sm_``capability``, with the launch settings the launcher would use
    (``config`` overrides them, for sweeps), at ``num_heads`` query = KV heads. ``constexprs``
    override the launcher's, ``pointers`` retype pointer arguments (``compile_function``): a probe
    of a pair kernel (benchmarks/gpu_cost/half_pairs.py)."""

    num_pairs = head_dim // 2
    if kernel in PAIR_KERNELS:
        pair_config = config or pair_launch_config(head_dim, dtype, capability)
        meta = pair_constexprs(
            num_heads=num_heads,
            num_kv=num_heads,
            head_dim=head_dim,
            hidden=max(16, num_pairs // 2),
            num_mdlmpe=len(mdlmpe_pairs(num_pairs)),
            dtype=dtype,
            config=pair_config,
            interpreting=False,
            kernel=kernel,
        )
        options = pair_kernel_options(pair_config, kernel)
        return compile_function(
            _pair_kernel_fn(kernel), {**meta, **(constexprs or {})}, dtype, capability, options, pointers
        )
    config = config or launch_config(head_dim, dtype, capability)
    meta = kernel_constexprs(
        num_heads=num_heads,
        num_kv=num_heads,
        head_dim=head_dim,
        hidden=max(16, num_pairs // 2),
        num_mdlmpe=len(mdlmpe_pairs(num_pairs)),
        dtype=dtype,
        config=config,
        interpreting=False,
    )[kernel]
    meta = {**meta, **(constexprs or {})}
    return compile_function(
        _kernel_fn(kernel), meta, dtype, capability, kernel_options(kernel, config), pointers
    )


def compile_function(
    fn, meta: dict, dtype: torch.dtype, capability: int, options: dict[str, int], pointers: dict | None = None
):
    """AOT-compile the @triton.jit ``fn`` with constexprs ``meta`` and Triton ``options``
    (num_warps, num_stages, maxnreg) for sm_``capability``. Other arguments: the names in ``_INTS``
    are i32, ``_FLOATS`` fp32, pointers in ``_MODEL_DTYPE_POINTERS`` in ``dtype``, every other
    pointer fp32. Pointers are 16-byte aligned (torch allocations are), and the integers of
    ``_DIVISIBLE_INTS`` multiples of 16: Triton marks every integer argument divisible by 16 at
    launch (``BaseBackend.get_int_specialization``), which at LLaDA-like dims covers the length
    (1024, 2048, ...), the head counts (32), F (64), the MLP width (32) and |M| (32); the
    vectorised loads and the address arithmetic of the compiled code depend on it (the pair
    forward of 2026-11-28 compiled to 96 registers without the head counts and widths marked, 106
    with them). ``pointers``: {argument: Triton element type} for pointers typed otherwise (a probe
    kernel's fp16 pair components, benchmarks/gpu_cost/half_pairs.py)."""
    import triton
    from triton.backends.compiler import GPUTarget

    model_dtype = _TRITON_DTYPES[dtype]
    # constexprs the launcher leaves at their defaults (a launch takes them from the signature)
    defaults = {
        p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty
    }
    meta = {**defaults, **meta}
    signature = {}
    for name in fn.arg_names:
        if name in meta:
            signature[name] = "constexpr"
        elif name in _INTS:
            signature[name] = "i32"
        elif name in _FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = f"*{model_dtype if name in _MODEL_DTYPE_POINTERS else 'fp32'}"
        if pointers and name in pointers:
            signature[name] = f"*{pointers[name]}"
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if signature[n][0] == "*" or n in _DIVISIBLE_INTS
    }
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=meta, attrs=aligned)
    return triton.compile(
        source,
        target=GPUTarget("cuda", capability, 32),
        options=options,
    )


def sass(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin: the machine code, one instruction per line."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        return subprocess.run(
            [cuobjdump_path(), "-sass", fh.name], capture_output=True, text=True, check=True
        ).stdout


# "        /*11be0*/    @!P0 MEMBAR.ALL.GPU ;    /* 0x... */": address, optional predicate, opcode.
_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")


def fence_instructions(sass_text: str) -> list[str]:
    """The GPU-wide memory fences of ``cuobjdump -sass`` output, one string each (opcode and
    operands): MEMBAR at GPU or system scope (what an acquire / release atomic puts around itself)
    and the ERRBAR / CGAERRBAR that come with it on sm_90. Each one stalls the warp until its
    earlier global memory operations are visible GPU-wide. Not counted: block-scope MEMBAR.ALL.CTA
    and FENCE.VIEW.ASYNC, which order shared memory for the sm_90 tensor-core (wgmma) operands,
    block barriers (BAR) and the relaxed reductions (RED)."""
    found = []
    for line in sass_text.splitlines():
        match = _SASS_LINE.match(line)
        if not match:
            continue
        opcode, operands = match.group(1), match.group(2)
        wide = opcode == "MEMBAR" and (".GPU" in operands or ".SYS" in operands)
        if wide or opcode in ("ERRBAR", "CGAERRBAR"):
            found.append((opcode + operands).strip())
    return found


def compile_kernel(
    kernel: str,
    head_dim: int,
    dtype: torch.dtype,
    capability: int,
    config: LaunchConfig | PairLaunchConfig | None = None,
) -> KernelResources:
    """Compile ``kernel`` for sm_``capability`` (see :func:`compile_cubin`) and read its resources."""
    if config is None:
        pair = kernel in PAIR_KERNELS
        config = (pair_launch_config if pair else launch_config)(head_dim, dtype, capability)
    start = time.perf_counter()
    compiled = compile_cubin(kernel, head_dim, dtype, capability, config)
    usage = resource_usage(compiled.asm["cubin"])
    fences = fence_instructions(sass(compiled.asm["cubin"]))
    return KernelResources(
        kernel=kernel,
        capability=capability,
        head_dim=head_dim,
        dtype=_TRITON_DTYPES[dtype],
        config=config,
        shared_bytes=int(compiled.metadata.shared),
        shared_limit=SHARED_MEMORY_LIMIT[capability],
        registers=usage["REG"],
        spill_bytes=usage["STACK"],
        compile_s=time.perf_counter() - start,
        fences=len(fences),
    )


def _worker_init() -> None:
    # A compile needs triton's compiler mode, decided when the kernels module is imported.
    os.environ.pop("TRITON_INTERPRET", None)
    torch.set_num_threads(1)


def _compile_job(job: tuple) -> KernelResources:
    return compile_kernel(*job)


def compile_many(jobs: list[tuple], workers: int = 1) -> list[KernelResources]:
    """``compile_kernel(*job)`` for every job, in ``workers`` fresh (spawned) processes: the kernels
    are compiled, never interpreted, whatever this process has imported. Results in job order.
    Triton's on-disk cache (TRITON_CACHE_DIR, default ~/.triton/cache) makes repeats fast."""
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=max(1, workers), mp_context=context, initializer=_worker_init
    ) as pool:
        return list(pool.map(_compile_job, jobs))
