"""The kernels' polynomial alpha = cos(delta) - 1 and beta = sin(delta) meet their stated error bound.

``kernels._small_sincos`` replaces libdevice sin/cos when |tau_max| <= POLY_TAU_MAX (|delta| <=
tau_max by construction: delta = tau_max tanh(.)). It runs here in Triton's interpreter, in a
child process (triton picks interpreter vs compiler when it decorates), on 2^20 + 1 fp32 points
spread over [-POLY_TAU_MAX, POLY_TAU_MAX], against float64 sin / cos. Allowed: the stated
truncation bound plus fp32 rounding of the Horner steps (a few ulp of values below 0.5: 6e-8 for
sin, 2e-8 for cos - 1, whose values stay below 0.123), and 1e-6 relative error on cos - 1, which
has no cancellation near 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHILD = r"""
import json, torch, triton, triton.language as tl
from mdlmpe_ds.attention.triton import kernels, launch

@triton.jit
def poly_kernel(x_ptr, a_ptr, b_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
    alpha, beta = kernels._small_sincos(x)
    tl.store(a_ptr + offs, alpha, mask=offs < N)
    tl.store(b_ptr + offs, beta, mask=offs < N)

n = 2**20 + 1
x = torch.linspace(-kernels.POLY_TAU_MAX, kernels.POLY_TAU_MAX, n, dtype=torch.float32)
alpha, beta = torch.empty_like(x), torch.empty_like(x)
block = 2**16
poly_kernel[(triton.cdiv(n, block),)](x, alpha, beta, n, BLOCK=block)
xd = x.double()
want_a, want_b = torch.cos(xd) - 1.0, torch.sin(xd)
err_a = (alpha.double() - want_a).abs()
small = want_a.abs() > 1e-30
print(json.dumps(dict(
    sin=(beta.double() - want_b).abs().max().item(),
    cos=err_a.max().item(),
    cos_rel=(err_a[small] / want_a.abs()[small]).max().item(),
    zero=[alpha[n // 2].item(), beta[n // 2].item()],
    same_range=launch.POLY_TAU_MAX == kernels.POLY_TAU_MAX,
    sin_bound=kernels.POLY_SIN_BOUND, cos_bound=kernels.POLY_COS_BOUND,
)))
"""


@pytest.fixture(scope="module")
def errors() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise AssertionError(f"interpreter child failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_stated_bounds_are_the_first_omitted_terms(errors):
    assert errors["sin_bound"] == pytest.approx(0.5**9 / 362880) and errors["sin_bound"] < 6e-9
    assert errors["cos_bound"] == pytest.approx(0.5**10 / 3628800) and errors["cos_bound"] < 3e-10
    assert errors["same_range"]


def test_polynomial_sin_cos_within_bound(errors):
    assert errors["sin"] <= errors["sin_bound"] + 6e-8, errors
    assert errors["cos"] <= errors["cos_bound"] + 2e-8, errors
    assert errors["cos_rel"] <= 1e-6, errors
    assert errors["zero"] == [0.0, 0.0]  # delta = 0 (zero-initialised phase MLP): exactly RoPE
