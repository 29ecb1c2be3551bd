"""The compiled Triton backends on a CUDA device against the reference, at the lengths and shapes a
user hits, under poisoned allocations: the GPU half of tests/unit/test_attention_shapes.py.

The interpreter tests prove the kernels' index arithmetic on tiny shapes; this one runs the real
sm_90 / sm_80 machine code at LLaDA's head size (d_h = 128) with the launcher's own settings, on
lengths around every tile and span boundary (255, 256, 257, 272, 511, 513, 1025, ...) up to 2049.
Every uninitialised torch allocation on the device is NaN (torch's
``fill_uninitialized_memory``), so an element that no kernel wrote fails the comparison.

Both Triton backends run: ``triton`` (the fused kernels, the default on CUDA) and ``triton-pair``
(the pair-bias kernels and SDPA with a bias), the latter also with its fp16 pair arithmetic
(``triton-pair-half``: ``PairLaunchConfig.half_pairs``; bf16 cases). Each case compares the output
and the gradients of q, k, v and the phase MLP's four tensors, as a max abs error relative to the
largest value of the same reference tensor (tolerances: fp32 1e-3, the compiled kernels'
summation order over up to 2049 keys; bf16 3e-2, as on the CPU). Skipped cleanly without CUDA.
"""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_attention_shapes import OUTPUTS, Case, _inputs, attention_runner, poisoned_allocations

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: Relative tolerance (max abs error / the reference tensor's largest value) per dtype.
REL_TOL = {"float32": 1e-3, "bfloat16": 3e-2}
#: The most B * Hq * L^2 a case may have: the reference holds several [B, Hq, L, L, d_h / 2] fp32
#: tensors (about 1 GiB each at this bound).
REFERENCE_WORK = 16_000_000
#: Around the fused kernels' tiles (64 / 32) and the phase kernels' key span (256), 2^k +- 1.
GPU_LENGTHS = (1, 17, 63, 65, 255, 256, 257, 272, 300, 511, 513, 1000, 1025, 1100, 2047, 2049)


def gpu_cases(seed: int = 0) -> list[Case]:
    """One case per length of GPU_LENGTHS, settings drawn with ``random.Random(seed)``: batch 1-3
    with ragged padding (a padding-only sequence among them), GQA 1:1 / 2:1 / 4:1, all or half the KV
    heads active (one short case with none: plain SDPA), bf16 or fp32 (every third case fp32), row
    blocks (a small pair-buffer budget) on half the cases past 512; d_h = 128 and the launcher's
    settings for the device."""
    rng = random.Random(seed)
    cases = []
    for i, length in enumerate(GPU_LENGTHS):
        batch = rng.randint(1, 3)
        hkv = 2 if i % 4 == 1 else rng.choice((1, 2))
        hq = hkv * rng.choice((1, 2, 4))
        active = ("00" if i == 1 else "10") if i % 4 == 1 else "1" * hkv
        while batch * hq * length**2 > REFERENCE_WORK and batch * hq > 1:  # the reference's memory
            batch, hq = (batch, hq // 2) if hq > hkv else (max(1, batch - 1), hq)
            if hq < hkv:
                hkv = hq
        pads = tuple(rng.choice((0, 0, rng.randint(0, length), -1)) for _ in range(batch))
        if all(p == -1 for p in pads):
            pads = (0, *pads[1:])
        cases.append(
            Case(
                length,
                pads=pads,
                hq=hq,
                hkv=hkv,
                active=active,
                dtype="float32" if i % 3 == 2 else "bfloat16",
                budget_rows=64 if length > 512 and i % 2 == 0 else None,
                head_dim=128,
                seed=seed * 1000 + i,
            )
        )
    return cases


CASES = gpu_cases()


def _on_cuda(case: Case):
    q, k, v, A, D, key_valid, active, mlp, grad_out = _inputs(case)
    leaf = lambda t: t.detach().cuda().requires_grad_()  # noqa: E731
    return (
        leaf(q),
        leaf(k),
        leaf(v),
        A.cuda(),
        D.cuda(),
        key_valid.cuda(),
        active.cuda(),
        mlp.cuda(),
        grad_out.cuda(),
    )


def _budget_bytes(case: Case, q: torch.Tensor) -> int | None:
    """The pair-buffer budget that makes row blocks of ``case.budget_rows`` rows under the launch
    settings the backend resolves for ``q`` (None: the default budget, the whole plane)."""
    if case.budget_rows is None:
        return None
    from mdlmpe_ds.attention.triton.backend import resolve_launch
    from mdlmpe_ds.attention.triton.launch import padded_length, pair_padding
    from mdlmpe_ds.pe.phase import mdlmpe_pairs

    padded = padded_length(case.length, pair_padding(resolve_launch(q)))
    return 3 * 4 * len(mdlmpe_pairs(case.head_dim // 2)) * padded * case.budget_rows


def gpu_errors(case: Case, backend: str) -> dict[str, float]:
    """Per output and gradient: max abs error of ``backend`` against the reference, divided by the
    reference tensor's largest value (1 where that is 0), under poisoned allocations."""
    from mdlmpe_ds.attention.reference import reference_attention
    from mdlmpe_ds.attention.triton.backend import triton_attention
    from mdlmpe_ds.attention.triton.pair_backend import pair_bias_attention

    inputs = _on_cuda(case)
    run = attention_runner(inputs)
    with poisoned_allocations():
        want = run(reference_attention)
        if backend == "triton":
            got = run(triton_attention, pair_buffer_bytes=_budget_bytes(case, inputs[0]))
        elif backend == "triton-pair":
            got = run(pair_bias_attention)
        else:  # "triton-pair-half": PairLaunchConfig.half_pairs, the fp16 pair arithmetic
            from mdlmpe_ds.attention.triton.launch import HALF_PAIR_KERNELS
            from mdlmpe_ds.attention.triton.pair_backend import resolve_pair_launch

            launch = replace(resolve_pair_launch(inputs[0]), half_pairs=HALF_PAIR_KERNELS)
            got = run(pair_bias_attention, launch=launch)
    errors = {}
    for name, w, g in zip(OUTPUTS, want, got):
        scale = w.float().abs().max().item() or 1.0
        errors[name] = (w.float() - g.float()).abs().max().item() / scale
    return errors


def _check(case: Case, backend: str, errors: dict[str, float]) -> None:
    tol = REL_TOL[case.dtype]
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, (
        f"{backend} {case.name}: relative max error above {tol} (NaN: an unwritten element was read): {bad}"
    )


@pytest.mark.parametrize("backend", ["triton", "triton-pair", "triton-pair-half"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compiled_backend_matches_reference(case, backend):
    if backend == "triton-pair-half" and case.dtype == "float32":
        pytest.skip("half_pairs applies to 16-bit inputs (fp32 runs the fp32 kernels)")
    errors = gpu_errors(case, backend)
    print(f"{backend} {case.name}: " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    _check(case, backend, errors)


def test_cases_cross_every_boundary():
    """The sweep reaches what it claims: lengths on both sides of 256 and of a 64-row tile, past
    2048, fp32 and bf16, GQA, partial head sets, row blocks and a padding-only sequence."""
    lengths = {c.length for c in CASES}
    assert {255, 256, 257, 272, 2047, 2049} <= lengths
    assert {c.dtype for c in CASES} == {"float32", "bfloat16"}
    assert any(c.hq > c.hkv for c in CASES) and any("0" in c.active for c in CASES)
    assert any(c.budget_rows for c in CASES) and any(-1 in c.pads for c in CASES)
    assert replace(CASES[0], seed=1).name != CASES[0].name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("path", ["rope", "triton-pair"])
def test_padding_only_rows_are_the_uniform_average(path, dtype):
    """A sequence whose keys are all padding: each of its rows is mean_j V_j (the convention of
    attention/common.py) through the fused SDPA kernels a CUDA device picks for a biased call
    (memory-efficient), not zeros or NaN; the other sequence is untouched by it."""
    from mdlmpe_ds.attention.common import rope_attention
    from mdlmpe_ds.attention.triton.pair_backend import pair_bias_attention

    if path == "triton-pair" and dtype == torch.float16:
        pytest.skip("the pair kernels take bf16 or fp32")
    case = Case(300, pads=(0, -1), hq=4, hkv=2, dtype="float32", head_dim=128)
    q, k, v, A, D, key_valid, _, mlp, _ = _on_cuda(case)
    q, k, v = (t.detach().to(dtype) for t in (q, k, v))
    if path == "rope":
        out = rope_attention(q, k, v, key_valid=key_valid)
    else:
        out = pair_bias_attention(
            q, k, v, A, D, mlp.params(), tau_max=0.25, clip_kappa=1e-4, key_valid=key_valid
        )
    uniform = v[1].float().mean(dim=1, keepdim=True).repeat_interleave(2, dim=0)  # [Hq, 1, d_h]
    assert bool(torch.isfinite(out).all())
    err = (out[1].float() - uniform).abs().max().item()
    assert err < 2e-2, f"{path} {dtype}: padding-only rows differ from mean_j V_j by {err}"
