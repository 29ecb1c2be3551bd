"""The compiled Triton MDLMPE kernel on a CUDA device: bf16 parity with the reference, no NaN at L=4096.

Skipped cleanly without CUDA (the interpreter-mode parity in tests/unit runs everywhere). Every
call uses the backend's own launch settings (triton.launch.launch_config for the device, head
size and dtype), the ones tests/unit/test_triton_resources.py compiles for sm_80 and sm_90; the
config-driven entry point (backend 'auto' on CUDA tensors) is checked to reach the kernel.
Tolerances (relative Frobenius error against the fp32 reference fed the same bf16 inputs): the
kernel computes in fp32 but uses TF32 tile products for 16-bit inputs (10-bit mantissa, ~5e-4
relative per product) and rounds O and dq/dk/dv to bf16 (2^-9 relative): 1e-2 on O and input
grads, 2e-2 on the phase-MLP grads (sums of many TF32 products over L^2 pairs). fp32 inputs take
the IEEE path: 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from mdlmpe_ds.pe.phase import PhaseMLP

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GRADS = ("out", "dq", "dk", "dv", "dw1", "db1", "dw2", "db2")


def _layer(batch, hq, hkv, length, head_dim, dtype, seed=0, zero_fc2=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_pairs = head_dim // 2
    torch.manual_seed(seed)
    mlp = PhaseMLP(num_pairs, max(16, num_pairs // 2), device="cuda")
    if not zero_fc2:
        with torch.no_grad():
            mlp.fc2.weight.normal_(0.0, 0.5, generator=gen)
            mlp.fc2.bias.normal_(0.0, 0.5, generator=gen)

    def leaf(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype).requires_grad_()

    q, k, v = (
        leaf(batch, hq, length, head_dim),
        leaf(batch, hkv, length, head_dim),
        leaf(batch, hkv, length, head_dim),
    )
    D = torch.rand(batch, length, num_pairs, device="cuda", generator=gen) + 0.5
    A = torch.rand(batch, length, num_pairs, device="cuda", generator=gen) * D
    return mlp, q, k, v, A, D


def _grads(fn, mlp, q, k, v, A, D, grad_out, **kwargs):
    leaves = (q, k, v, *mlp.parameters())
    for t in leaves:
        t.grad = None
    out = fn(q, k, v, A, D, mlp.params(), tau_max=0.25, clip_kappa=1e-4, **kwargs)
    out.backward(grad_out.to(out.dtype))
    return [out.detach().float()] + [t.grad.float().clone() for t in leaves]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize(
    "dtype,tol_io,tol_mlp",
    [(torch.bfloat16, 1e-2, 2e-2), (torch.float32, 1e-4, 1e-4)],
)
def test_parity_with_reference(dtype, tol_io, tol_mlp):
    """GQA, ragged tiles (L = 200 with 32-row tiles), key padding and a partial KV-head mask."""
    from mdlmpe_ds.attention.reference import reference_attention
    from mdlmpe_ds.attention.triton.backend import triton_attention

    mlp, q, k, v, A, D = _layer(2, 8, 4, 200, 64, dtype)
    key_valid = torch.ones(2, 200, dtype=torch.bool, device="cuda")
    key_valid[1, 150:] = False
    active_kv = torch.tensor([True, False, True, True], device="cuda")
    grad_out = torch.randn(q.shape, device="cuda")
    kwargs = dict(active_kv=active_kv, key_valid=key_valid)
    want = _grads(reference_attention, mlp, q, k, v, A, D, grad_out, **kwargs)
    got = _grads(triton_attention, mlp, q, k, v, A, D, grad_out, **kwargs)
    errors = {n: _rel(g, w) for n, g, w in zip(GRADS, got, want)}
    bad = {n: e for n, e in errors.items() if e > (tol_io if n in GRADS[:4] else tol_mlp)}
    assert not bad, f"{dtype}: relative errors above tolerance: {bad} (all: {errors})"


def test_auto_backend_on_cuda_is_the_kernel():
    """The default config (backend 'auto') runs the fused kernel on CUDA tensors: same output."""
    from mdlmpe_ds.attention import mdlmpe_attention
    from mdlmpe_ds.attention.impl import AttentionImpl
    from mdlmpe_ds.attention.triton.backend import triton_attention
    from mdlmpe_ds.pe.config import MDLMPEConfig

    mlp, q, k, v, A, D = _layer(1, 4, 2, 96, 128, torch.bfloat16)
    assert AttentionImpl().backend == "auto"
    got = mdlmpe_attention(q, k, v, A, D, mlp.params(), MDLMPEConfig(), AttentionImpl())
    want = triton_attention(q, k, v, A, D, mlp.params(), tau_max=0.25, clip_kappa=1e-4)
    assert torch.equal(got, want)


def test_zero_initialised_phase_is_flash_rope():
    from mdlmpe_ds.attention.common import rope_attention
    from mdlmpe_ds.attention.triton.backend import triton_attention

    mlp, q, k, v, A, D = _layer(1, 4, 4, 256, 128, torch.bfloat16, zero_fc2=True)
    out = triton_attention(q, k, v, A, D, mlp.params(), tau_max=0.25, clip_kappa=1e-4)
    assert _rel(out.float(), rope_attention(q, k, v).float()) < 1e-2


def test_no_nan_at_4096():
    """LLaDA head size at L = 4096, bf16, fwd + bwd: every output and gradient finite."""
    from mdlmpe_ds.attention.triton.backend import triton_attention

    mlp, q, k, v, A, D = _layer(1, 4, 4, 4096, 128, torch.bfloat16, seed=1)
    key_valid = torch.ones(1, 4096, dtype=torch.bool, device="cuda")
    key_valid[:, 4000:] = False
    got = _grads(
        triton_attention,
        mlp,
        q,
        k,
        v,
        A,
        D,
        torch.randn(q.shape, device="cuda"),
        key_valid=key_valid,
    )
    bad = [n for n, t in zip(GRADS, got) if not bool(torch.isfinite(t).all())]
    assert not bad, f"non-finite values in {bad}"
    assert got[5].abs().sum() > 0  # the phase MLP receives a gradient
