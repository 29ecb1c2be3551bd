"""ESTIMATED GPU cost of MDLMPE attention: a per-kernel model a kernel engineer can check.

Modules, one job each:

- ``assumptions``: every machine figure and modelling choice, each with its source and a low /
  central / high value, and the scenarios (optimistic, central, pessimistic) built from them;
- ``kernel_model``: the time of one kernel launch from its resources (registers, spills, shared
  memory, warps, stages, barriers) and its work (pipes, L2 / HBM bytes, atomics);
- ``sass``: instruction counts of a compiled kernel's main loop (``cuobjdump -sass``), the inputs
  of the issue / FP32 / tensor-core pipes where a kernel exists;
- ``designs``: the MDLMPE attention designs (today's four kernels, pair + bias, pair + bias on
  tensor cores, the no-rewrite tune-up) as kernel lists, and their extra memory;
- ``step``: the RoPE baselines and the rest of the LLaDA-8B step with its recompute;
- ``calibrate``: the same model on our own FlashAttention-2-style forward, held against the
  published timings of the Triton tutorial kernel.

Nothing here ran on a GPU: every figure it prints is an ESTIMATE.
"""
