"""The fused Triton MDLMPE attention equals the reference (the spec), forward and backward.

Runs the kernels in Triton's CPU interpreter. triton 3.9 chooses interpreter vs compiler when
``triton.jit`` decorates, so the kernels run in a child process started with TRITON_INTERPRET=1
(another test module may already have imported them in this process). The child runs every case
once and prints the max abs errors as JSON; each test checks one case. Sizes are tiny because the
interpreter executes each program in Python.

Tolerance: everything is fp32 on both sides; the reference materialises the rotated keys, the
kernel accumulates a RoPE product plus a correction, and its arccos is a polynomial (|err| <= 2e-8),
so they differ by fp32 rounding only: 2e-5 absolute on O(1) values. The bf16 case feeds both
paths the same bf16 q, k, v; both compute in fp32 and round the output (and the q, k, v grads)
to bf16, whose half-ulp at magnitude 2-4 is 2^-8 to 2^-7: 3e-2 absolute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mdlmpe_ds.attention import AttentionImpl, mdlmpe_attention, resolve_backend
from mdlmpe_ds.pe.config import MDLMPEConfig
from mdlmpe_ds.pe.phase import PhaseMLP

triton = pytest.importorskip("triton")

TOL = {"float32": 2e-5, "bfloat16": 3e-2}
GRADS = ("out", "dq", "dk", "dv", "dw1", "db1", "dw2", "db2")

# name: batch, query heads, KV heads, length, head_dim, tile, heads per program, active KV heads,
# padded keys per sequence (-1: the whole last sequence is padding), random (else zero-init) fc2,
# dtype of q, k, v, MDLMPE pairs per alpha/beta chunk[, tau_max (default 0.25)]. A chunk of even
# width >= 2 runs the kernels' split path (even / odd pairs apart), width 1 the unsplit one;
# tau_max <= 0.5 takes the polynomial sin / cos, larger the libdevice one.
CASES = {
    # ragged key/row tiles (13 = 8 + 5), one program spanning two GQA groups, key padding.
    "gqa_ragged_padding": (1, 4, 2, 13, 8, 8, 4, "11", 3, True, "float32", 1),
    # head_dim 12: F = 6, |M| = 3 in chunks of 2 (the last one ragged), all padded to powers of two;
    # half the KV heads active.
    "partial_head_mask": (2, 4, 2, 11, 12, 4, 2, "10", 2, True, "float32", 2),
    # zero-initialised fc2: must be plain RoPE; the last sequence is all padding (uniform rows).
    "zero_init_is_rope": (2, 2, 1, 9, 8, 4, 1, "1", -1, False, "float32", 16),
    # bf16 inputs (the GPU training dtype): fp32 inside, bf16 output and input grads.
    "bf16_inputs": (1, 2, 2, 10, 8, 8, 2, "11", 2, True, "bfloat16", 16),
    # tau_max above the polynomial's range: libdevice sin / cos; 4 heads in one program, G > Hkv.
    "large_tau": (1, 4, 1, 7, 8, 4, 4, "1", 0, True, "float32", 2, 1.0),
    # pair buffers over their budget: 2 sequences, each in 3 row blocks of 8 (the last one ends
    # in padding, L = 21 -> LP = 24): alpha/beta/ddelta per block, dK, dV and the MLP gradients
    # added across launches (test_pair_buffers_split_into_row_blocks checks the split).
    "row_blocks": (2, 2, 2, 21, 8, 4, 2, "11", 2, True, "float32", 2),
    # 8 heads in one program (the widest head split of the per-head tiles), GQA 8:2.
    "eight_heads_per_program": (1, 8, 2, 6, 8, 4, 8, "11", 1, True, "float32", 2),
}
#: Per-case budget of the kernels' pair buffers (``pair_buffer_bytes``), in bytes.
PAIR_BUDGET = {"row_blocks": 3 * 4 * 2 * 24 * 8}  # 3 buffers x fp32 x |M| = 2 x LP = 24 x 8 rows
#: Per-case key positions per phase-kernel program (triton.launch.PHASE_KEY_SPAN): several spans
#: per row, with the symmetric half-plane (one launch per sequence) and without it (row blocks).
KEY_SPAN = {"gqa_ragged_padding": 8, "partial_head_mask": 4, "row_blocks": 8}


def _run_case(name: str) -> dict[str, float]:
    """Child side: reference vs kernel on one case; max abs error per output and gradient."""
    from mdlmpe_ds.attention.common import rope_attention
    from mdlmpe_ds.attention.reference import reference_attention
    from mdlmpe_ds.attention.triton import launch
    from mdlmpe_ds.attention.triton.backend import triton_attention

    if name in KEY_SPAN:
        launch.PHASE_KEY_SPAN = KEY_SPAN[name]

    batch, hq, hkv, length, head_dim, tile, per_prog, active, pad, random_fc2, dtype, chunk = CASES[name][:12]
    tau_max = CASES[name][12] if len(CASES[name]) > 12 else 0.25
    gen = torch.Generator().manual_seed(0)
    num_pairs = head_dim // 2
    torch.manual_seed(0)
    mlp = PhaseMLP(num_pairs, max(16, num_pairs // 2))
    if random_fc2:
        with torch.no_grad():
            mlp.fc2.weight.normal_(0.0, 0.5, generator=gen)
            mlp.fc2.bias.normal_(0.0, 0.5, generator=gen)
    dt = getattr(torch, dtype)
    q = torch.randn(batch, hq, length, head_dim, generator=gen).to(dt).requires_grad_()
    k = torch.randn(batch, hkv, length, head_dim, generator=gen).to(dt).requires_grad_()
    v = torch.randn(batch, hkv, length, head_dim, generator=gen).to(dt).requires_grad_()
    D = torch.rand(batch, length, num_pairs, generator=gen) + 0.5
    A = torch.rand(batch, length, num_pairs, generator=gen) * D  # 0 <= A <= D
    key_valid = torch.ones(batch, length, dtype=torch.bool)
    if pad < 0:
        key_valid[-1] = False
    elif pad:
        key_valid[:, length - pad :] = False
    active_kv = torch.tensor([c == "1" for c in active])
    grad_out = torch.randn(batch, hq, length, head_dim, generator=gen)
    kwargs = dict(tau_max=tau_max, clip_kappa=1e-4, active_kv=active_kv, key_valid=key_valid)

    def run(fn, **extra) -> list[torch.Tensor]:
        leaves = (q, k, v, *mlp.parameters())
        for t in leaves:
            t.grad = None
        out = fn(q, k, v, A, D, mlp.params(), **kwargs, **extra)
        (out * grad_out).sum().backward()
        return [out.detach()] + [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in leaves]

    want = run(reference_attention)
    saved: list[int] = []  # numel of every tensor autograd keeps for the backward of the kernel path

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = run(
            triton_attention,
            block_size=tile,
            phase_tile=tile,
            heads_per_program=per_prog,
            pair_chunk=chunk,
            pair_buffer_bytes=PAIR_BUDGET.get(name),
        )
    errors = {n: (w.float() - g.float()).abs().max().item() for n, w, g in zip(GRADS, want, got)}
    errors["scale"] = max(w.float().abs().max().item() for w in want)
    errors["saved_max_numel_over_q"] = max(saved) / q.numel()
    # The run-time choice reaches the same kernel (forward only), with its buffer budget.
    budget = PAIR_BUDGET.get(name, 2**30) / 2**30
    impl = AttentionImpl(backend="triton", tile=tile, pair_buffer_gib=budget)
    via_config = mdlmpe_attention(
        q,
        k,
        v,
        A,
        D,
        mlp.params(),
        MDLMPEConfig(tau_max=tau_max),
        impl,
        active_kv=active_kv,
        key_valid=key_valid,
    )
    errors["dispatch"] = (via_config.detach().float() - want[0].float()).abs().max().item()
    if not random_fc2:
        errors["vs_rope"] = (got[0] - rope_attention(q, k, v, key_valid).detach()).abs().max().item()
    return errors


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, float]]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, *CASES], env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode:
        raise AssertionError(f"interpreter child failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_forward_and_backward(interpreted, name):
    errors, tol = interpreted[name], TOL[CASES[name][10]]
    assert errors["scale"] > 0.1  # the comparison is not between zeros
    bad = {k: v for k, v in errors.items() if k in GRADS and not v <= tol}
    assert not bad, f"{name}: max abs error above {tol}: {bad}"


@pytest.mark.parametrize("name", list(CASES))
def test_config_dispatch_reaches_the_kernel(interpreted, name):
    """``mdlmpe_attention`` with backend 'triton' gives the reference output."""
    assert interpreted[name]["dispatch"] <= TOL[CASES[name][10]]


def test_no_length_squared_buffers_saved(interpreted):
    """Backward keeps O(L) per head (q, k, v, O, row statistics), never an L x L tile (issue 8)."""
    for name, errors in interpreted.items():
        assert errors["saved_max_numel_over_q"] <= 1.0, name


def test_pair_buffers_split_into_row_blocks():
    """Over the budget, the launches cover every (sequence, row block) once, each block's three
    [NM, rows, LP] fp32 buffers within the budget (the ``row_blocks`` case runs this split)."""
    from mdlmpe_ds.attention.triton import backend
    from mdlmpe_ds.attention.triton import plan as triton_plan

    batch, heads, length, head_dim, tile = CASES["row_blocks"][0], 2, 21, 8, 4
    budget = PAIR_BUDGET["row_blocks"]
    q = torch.zeros(batch, heads, length, head_dim)
    config = backend.resolve_launch(q, block_size=tile, phase_tile=tile)
    plan = triton_plan.Plan(q, q, torch.zeros(16, head_dim // 2), config, 0.25, budget)
    blocks = list(plan.blocks(batch))
    assert plan.padded == 24 and len(blocks) == 6
    assert blocks == [(s, s + 1, r0, 8) for s in range(batch) for r0 in (0, 8, 16)]
    for s, e, _, rows in blocks:
        assert 3 * 4 * (e - s) * plan.num_mdlmpe * rows * plan.padded <= budget
    plan = triton_plan.Plan(q, q, torch.zeros(16, head_dim // 2), config, 0.25, 2**30)
    assert list(plan.blocks(batch)) == [(0, batch, 0, 24)]  # within budget: one launch group


def test_pair_buffer_budget_is_a_run_time_choice():
    """``attention.pair_buffer_gib`` is validated, reaches the memory plan, and a smaller one
    plans less transient memory for the Triton kernels (row blocks) than the default."""
    from mdlmpe_ds.models.presets import preset
    from mdlmpe_ds.training.activation_bytes import attention_transient_bytes

    with pytest.raises(ValueError, match="pair_buffer_gib"):
        AttentionImpl(pair_buffer_gib=0).validate()
    assert AttentionImpl.from_dict({"pair_buffer_gib": 1.5}).pair_buffer_bytes == 3 * 2**29
    cfg = preset("llada-8b", position_encoding="mdlmpe", max_seq_len=4096)
    triton = AttentionImpl(backend="triton")
    default = attention_transient_bytes(cfg, 1, 4096, "cuda", triton)
    small = attention_transient_bytes(
        cfg, 1, 4096, "cuda", AttentionImpl(backend="triton", pair_buffer_gib=1)
    )
    assert small <= 2**30 < default <= 6 * 2**30


def test_zero_initialised_phase_is_rope(interpreted):
    """W2 = b2 = 0 gives delta = 0, alpha = beta = 0: plain RoPE attention (F.1 identity)."""
    assert interpreted["zero_init_is_rope"]["vs_rope"] <= TOL["float32"]


def test_build_time_error_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        resolve_backend("triton")


def test_build_time_error_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes ``import triton`` raise ImportError
    with pytest.raises(RuntimeError, match="needs the triton package"):
        resolve_backend("triton")


def test_rejects_learned_coordinate_gradients(monkeypatch):
    """A, D carrying grad (coordinate='mlp') is refused with the way out, not silently detached."""
    from mdlmpe_ds.attention.triton.backend import triton_attention

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # passes the availability check; no kernel runs
    q = k = v = torch.zeros(1, 2, 4, 8)
    A = torch.zeros(1, 4, 4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="blocked"):
        triton_attention(q, k, v, A, A.detach(), PhaseMLP(4, 16).params(), tau_max=0.25, clip_kappa=1e-4)


def test_auto_backend_is_triton_on_cuda_blocked_elsewhere(caplog):
    """'auto' picks by the tensors' device, says so in the log, and leaves explicit names alone."""
    from mdlmpe_ds.attention import _ANNOUNCED, choose_backend

    _ANNOUNCED.clear()
    with caplog.at_level("INFO", logger="mdlmpe_ds.attention"):
        assert choose_backend("auto", torch.device("cuda")) == "triton"
        assert choose_backend("auto", torch.device("cuda", 1)) == "triton"
        assert choose_backend("auto", torch.device("cuda"), learned_coordinate=True) == "blocked"
        assert choose_backend("auto", torch.device("cpu")) == "blocked"
    assert "'auto' -> 'triton'" in caplog.text and "'auto' -> 'blocked' for cpu" in caplog.text
    assert caplog.text.count("'auto' -> 'triton'") == 1  # once per (device type, backend)
    for name in ("reference", "blocked", "triton"):
        assert choose_backend(name, torch.device("cpu")) == name
    assert AttentionImpl().backend == "auto" and AttentionImpl().tile is None


def test_auto_on_cpu_runs_the_blocked_path(monkeypatch):
    from mdlmpe_ds.attention import blocked

    calls = []
    real = blocked.blocked_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(blocked, "blocked_attention", spy)
    q = k = v = torch.randn(1, 2, 6, 8)
    D = torch.rand(1, 6, 4) + 0.5
    mdlmpe_attention(q, k, v, D / 2, D, PhaseMLP(4, 16).params(), MDLMPEConfig(), AttentionImpl())
    assert len(calls) == 1 and calls[0]["block_size"] == 128 and not calls[0]["compile"]


def test_explicit_triton_on_cpu_tensors_is_an_error(monkeypatch):
    """Asked for by name, the kernel refuses CPU tensors (outside the interpreter) instead of failing
    deep inside a launch."""
    from mdlmpe_ds.attention.triton.backend import triton_attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, CPU tensors
    q = k = v = torch.zeros(1, 2, 4, 8)
    D = torch.ones(1, 4, 4)
    with pytest.raises(ValueError, match="got cpu tensors"):
        triton_attention(q, k, v, D, D, PhaseMLP(4, 16).params(), tau_max=0.25, clip_kappa=1e-4)


if __name__ == "__main__":
    print(json.dumps({name: _run_case(name) for name in sys.argv[1:]}))
