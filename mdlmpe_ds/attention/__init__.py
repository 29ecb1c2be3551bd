"""MDLMPE attention backends, chosen by ``MDLMPEConfig.backend`` and checked at build time.

- ``reference``: materialises the pair tensor; the spec (tests, tiny inputs).
- ``blocked``: query blocks of C rows, O(C L F) extra memory, per-block recomputation; the default.
- ``triton``: fused GPU kernel (needs triton and a CUDA device, or TRITON_INTERPRET=1).

No silent fallback: asking for a backend that cannot run here raises at build time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mdlmpe_ds.attention.common import rope_attention
from mdlmpe_ds.pe.config import ATTENTION_BACKENDS, MDLMPEConfig
from mdlmpe_ds.pe.phase import PhaseParams

AttentionFn = Callable[..., torch.Tensor]


def resolve_backend(name: str) -> AttentionFn:
    """Return the attention function of backend ``name``; raise with the reason if unavailable."""
    if name == "reference":
        from mdlmpe_ds.attention.reference import reference_attention

        return reference_attention
    if name == "blocked":
        from mdlmpe_ds.attention.blocked import blocked_attention

        return blocked_attention
    if name == "triton":
        from mdlmpe_ds.attention.triton_backend import check_triton_available, triton_attention

        check_triton_available()
        return triton_attention
    raise ValueError(f"unknown attention backend {name!r}; choose one of {ATTENTION_BACKENDS}")


def mdlmpe_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    phase: PhaseParams,
    config: MDLMPEConfig,
    *,
    active_kv: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """MDLMPE attention through the configured backend. With no active head it is plain RoPE SDPA."""
    if active_kv is not None and not bool(active_kv.any()):
        return rope_attention(q, k, v, key_valid, scale)
    fn = resolve_backend(config.backend)
    kwargs = {}
    if config.backend == "triton":
        kwargs["block_size"] = config.triton_tile
    if config.backend == "blocked":
        kwargs["block_size"] = config.block_size
        kwargs["checkpoint"] = config.checkpoint_blocks
        kwargs["compile"] = config.compile
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


__all__ = ["mdlmpe_attention", "resolve_backend", "rope_attention"]
