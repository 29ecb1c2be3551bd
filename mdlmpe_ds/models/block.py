"""One transformer block: attention with the configured position encoding, the SwiGLU MLP, pre-norm.

Apart from the model (transformer.py) because a block is the unit that other code runs on its own:
the memory plan measures one block, layer checkpointing recomputes one block (or its two halves
around an attention that keeps its own memory small), and the per-forward ``LayerContext`` that
every block reads is built once by the model. What the block computes is documented in
transformer.py's module docstring (docs/models.md §8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mdlmpe_ds.attention import AttentionImpl, mdlmpe_attention, rope_attention
from mdlmpe_ds.attention.common import alibi_attention
from mdlmpe_ds.models.config import ModelConfig
from mdlmpe_ds.models.layers import NormalLinear, RMSNorm
from mdlmpe_ds.pe.phase import PhaseMLP
from mdlmpe_ds.pe.rope import apply_rotary
from mdlmpe_ds.seeding import init_stream


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); LLaDA's ``ff_proj`` is the gate, ``up_proj`` the linear branch."""

    def __init__(self, config: ModelConfig, device=None) -> None:
        super().__init__()
        d, m, std = config.hidden_size, config.intermediate_size, config.init_std
        self.gate_proj = NormalLinear(d, m, False, std, device)
        self.up_proj = NormalLinear(d, m, False, std, device)
        self.down_proj = NormalLinear(m, d, False, std, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LayerContext:
    """What every layer of one forward shares, computed once: rotary cos/sin [L, F] (per row
    [B, 1, L, F] when positions are given), key validity [B, L] (None = all valid), the MDLMPE
    features, and the ALiBi bias [B|1, H, L, L]."""

    __slots__ = ("alibi", "cos", "features", "key_valid", "sin")

    def __init__(self, cos=None, sin=None, key_valid=None, features=None, alibi=None) -> None:
        self.cos, self.sin, self.key_valid, self.features, self.alibi = cos, sin, key_valid, features, alibi


class Attention(nn.Module):
    """Bidirectional multi-head / grouped-query attention with the configured position encoding.

    MDLMPE: with ``phase_mlp="per_layer"`` the layer owns its phase MLP (``self.phase``); with
    ``"shared"`` it owns none (``self.phase`` is None) and reads ``shared_phase``, the model's, held
    outside the module tree (a tuple) so that its parameters are registered, saved and counted once,
    under the model. ``phase_mlp`` is the one this layer uses, either way.
    """

    def __init__(
        self,
        config: ModelConfig,
        device=None,
        impl: AttentionImpl | None = None,
        layer_index: int = 0,
        shared_phase: PhaseMLP | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        self.impl = impl if impl is not None else AttentionImpl()
        d, hd, std = config.hidden_size, config.head_dim, config.init_std
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.q_proj = NormalLinear(d, config.num_heads * hd, config.qkv_bias, std, device)
        self.k_proj = NormalLinear(d, config.num_kv_heads * hd, config.qkv_bias, std, device)
        self.v_proj = NormalLinear(d, config.num_kv_heads * hd, config.qkv_bias, std, device)
        self.o_proj = NormalLinear(config.num_heads * hd, d, False, std, device)
        self.phase: PhaseMLP | None = None
        self._shared_phase: tuple[PhaseMLP, ...] = ()
        mdlmpe = config.position_encoding == "mdlmpe"
        if mdlmpe and config.mdlmpe.shared_phase:
            if shared_phase is None:
                raise ValueError(
                    "phase_mlp='shared': pass the model's PhaseMLP as shared_phase when building a layer"
                )
            self._shared_phase = (shared_phase,)
        elif mdlmpe:
            num_pairs = hd // 2
            with init_stream("phase_mlp", layer_index):  # the backbone's draws stay those of RoPE
                self.phase = PhaseMLP(num_pairs, config.mdlmpe.hidden_width(num_pairs), device=device)
        # Per-KV-head MDLMPE switch (docs/method.md "Heads"); not a checkpoint tensor.
        self.register_buffer(
            "active_kv", torch.ones(config.num_kv_heads, dtype=torch.bool, device=device), persistent=False
        )
        self._all_active = True

    @property
    def phase_mlp(self) -> PhaseMLP | None:
        """The phase MLP this layer's MDLMPE attention uses: its own, or the model's shared one."""
        return self.phase if self.phase is not None else next(iter(self._shared_phase), None)

    def set_active_kv_heads(self, mask: torch.Tensor) -> None:
        if mask.shape != (self.num_kv_heads,) or mask.dtype != torch.bool:
            raise ValueError(
                f"active KV head mask must be bool [{self.num_kv_heads}], got {mask.dtype} "
                f"{tuple(mask.shape)}"
            )
        self.active_kv.copy_(mask.to(self.active_kv.device))
        self._all_active = bool(mask.all())

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        return self.output(self.core(*self.project(x, ctx), ctx))

    def project(self, x: torch.Tensor, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, Hq, L, d_h]; k, v [B, Hkv, L, d_h], q and k rotated when the encoding is rotary."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.config.uses_rotary:
            fp32 = self.config.rope_fp32
            q, k = apply_rotary(q, ctx.cos, ctx.sin, fp32), apply_rotary(k, ctx.cos, ctx.sin, fp32)
        return q, k, v

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """Attention with the configured encoding on projected q, k, v.           out [B, Hq, L, d_h]"""
        encoding = self.config.position_encoding
        if encoding == "mdlmpe":
            out = mdlmpe_attention(
                q,
                k,
                v,
                ctx.features.A,
                ctx.features.D,
                self.phase_mlp.params(),
                self.config.mdlmpe,
                self.impl,
                active_kv=None if self._all_active else self.active_kv,
                key_valid=ctx.key_valid,
            )
        elif encoding == "alibi":
            out = alibi_attention(q, k, v, ctx.alibi)
        else:  # rope, absolute: plain bidirectional SDPA (absolute positions were added to the input)
            out = rope_attention(q, k, v, ctx.key_valid)
        return out

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Heads merged and projected: [B, Hq, L, d_h] -> [B, L, d]."""
        batch, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


class Block(nn.Module):
    """Pre-norm transformer block (LLaDA ``LLaDALlamaBlock`` / Qwen2 decoder layer, without the mask)."""

    def __init__(
        self,
        config: ModelConfig,
        device=None,
        impl: AttentionImpl | None = None,
        layer_index: int = 0,
        shared_phase: PhaseMLP | None = None,
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.attn = Attention(config, device, impl, layer_index, shared_phase)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.mlp = SwiGLU(config, device)

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), ctx)
        return h + self.mlp(self.mlp_norm(h))

    def checkpointed(self, x: torch.Tensor, ctx: LayerContext, around_attention: bool) -> torch.Tensor:
        """``forward`` under activation checkpointing: the whole block as one recomputed segment, or
        (``around_attention``) two segments, before and after an attention that keeps its own
        memory small, so backward does not run the attention forward again."""
        if not around_attention:
            return checkpoint(self, x, ctx, use_reentrant=False)
        q, k, v = checkpoint(self._project, x, ctx, use_reentrant=False)
        out = self.attn.core(q, k, v, ctx)
        return checkpoint(self._finish, x, out, use_reentrant=False)

    def _project(self, x: torch.Tensor, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.attn.project(self.attn_norm(x), ctx)

    def _finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        h = x + self.attn.output(out)
        return h + self.mlp(self.mlp_norm(h))


__all__ = ["Attention", "Block", "LayerContext", "SwiGLU"]
