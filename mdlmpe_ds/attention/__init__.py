"""MDLMPE attention backends, chosen by the run's :class:`AttentionImpl` and checked when resolved.

- ``auto`` (the default): ``triton`` for CUDA tensors, ``blocked`` for any other device (the CPU);
  the choice is made per call from the tensors' device (:func:`choose_backend`) and logged once
  per (device type, backend).
- ``reference``: materialises the pair tensor; the spec (tests, tiny inputs).
- ``dense``: the pair phases once per call, the correction as an additive bias, plain autograd;
  O(L^2 |M|) memory per head: short rows (the studies, tests) on any device (attention/dense.py).
- ``blocked``: query blocks of C rows, O(C L F) extra memory, per-block recomputation (eager or
  compiled as ``compile`` says); the CPU path (attention/blocked.py, maths in blocked_math.py).
- ``triton``: fused GPU kernel (needs triton and CUDA tensors, or TRITON_INTERPRET=1 in tests).
- ``triton-pair``: the correction E as an additive bias from head-looped pair kernels, then SDPA
  (attention/triton/pair_backend.py); same needs as ``triton``; chosen by name only.

No silent fallback: a backend that cannot run here raises with the reason (``auto`` on a GPU
without triton too), it is never swapped for another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from mdlmpe_ds.attention.common import check_active_kv, rope_attention
from mdlmpe_ds.attention.impl import ATTENTION_BACKENDS, AttentionImpl
from mdlmpe_ds.pe.config import MDLMPEConfig
from mdlmpe_ds.pe.phase import PhaseParams

AttentionFn = Callable[..., torch.Tensor]

log = logging.getLogger(__name__)
_ANNOUNCED: set[tuple[str, str]] = set()


def auto_backend(device_type: str, learned_coordinate: bool = False) -> tuple[str, str]:
    """(backend, why) that ``auto`` runs on tensors of ``device_type``: ``triton`` on CUDA
    (``blocked`` when the coordinate is learned, ``coordinate='mlp'``: the fused kernel has no
    gradient for A, D) and ``blocked`` on every other device. The one rule: the run's choice per
    call (:func:`choose_backend`) and the memory plan's (:func:`planned_backend`) both read it."""
    if device_type != "cuda":
        return "blocked", f"{device_type} tensors (the eager / compiled PyTorch path)"
    if learned_coordinate:
        return "blocked", "CUDA tensors, but A, D need gradients (coordinate='mlp')"
    return "triton", "CUDA tensors (fused kernel)"


def choose_backend(name: str, device: torch.device | str, learned_coordinate: bool = False) -> str:
    """The backend that runs configured backend ``name`` on tensors on ``device``.

    Explicit names are returned as they are; ``auto`` as :func:`auto_backend` decides. The choice
    is logged once per (device type, backend)."""
    if name != "auto":
        return name
    kind = torch.device(device).type
    chosen, why = auto_backend(kind, learned_coordinate)
    if (kind, chosen) not in _ANNOUNCED:
        _ANNOUNCED.add((kind, chosen))
        log.info("mdlmpe attention backend 'auto' -> %r for %s", chosen, why)
    return chosen


def planned_backend(name: str, device: torch.device | str, config: MDLMPEConfig) -> str:
    """The backend a model with MDLMPE ``config`` will run for configured ``name`` on ``device``,
    before any tensor exists (the memory plan): A, D carry gradients exactly when the coordinate
    is learned (``coordinate='mlp'``, pe/encoder.py). Not logged."""
    if name != "auto":
        return name
    return auto_backend(torch.device(device).type, config.coordinate == "mlp")[0]


def resolve_backend(name: str) -> AttentionFn:
    """Return the attention function of backend ``name``; raise with the reason if unavailable."""
    if name == "reference":
        from mdlmpe_ds.attention.reference import reference_attention

        return reference_attention
    if name == "dense":
        from mdlmpe_ds.attention.dense import dense_attention

        return dense_attention
    if name == "blocked":
        from mdlmpe_ds.attention.blocked import blocked_attention

        return blocked_attention
    if name == "triton":
        from mdlmpe_ds.attention.triton.backend import check_triton_available, triton_attention

        check_triton_available()
        return triton_attention
    if name == "triton-pair":
        from mdlmpe_ds.attention.triton.backend import check_triton_available
        from mdlmpe_ds.attention.triton.pair_backend import pair_bias_attention

        check_triton_available()
        return pair_bias_attention
    if name == "auto":
        raise ValueError("attention backend 'auto' depends on the tensors' device: use choose_backend first")
    raise ValueError(f"unknown attention backend {name!r}; choose one of {ATTENTION_BACKENDS}")


def mdlmpe_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    phase: PhaseParams,
    config: MDLMPEConfig,
    impl: AttentionImpl,
    *,
    active_kv: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """MDLMPE attention (the maths of ``config``) through the backend of ``impl``. With no active
    head it is plain RoPE SDPA."""
    check_active_kv("mdlmpe attention", active_kv, k.shape[1])
    if active_kv is not None and not bool(active_kv.any()):
        return rope_attention(q, k, v, key_valid, scale)
    backend = choose_backend(impl.backend, q.device, A.requires_grad or D.requires_grad)
    fn = resolve_backend(backend)
    kwargs = {}
    if backend == "triton":
        kwargs["block_size"] = impl.tile
        kwargs["pair_buffer_bytes"] = impl.pair_buffer_bytes
    if backend == "blocked":
        kwargs["block_size"] = impl.query_block
        kwargs["compile"] = impl.compile
    return fn(
        q,
        k,
        v,
        A,
        D,
        phase,
        tau_max=config.tau_max,
        clip_kappa=config.clip_kappa,
        active_kv=active_kv,
        key_valid=key_valid,
        scale=scale,
        **kwargs,
    )


__all__ = ["AttentionImpl", "choose_backend", "mdlmpe_attention", "resolve_backend", "rope_attention"]
