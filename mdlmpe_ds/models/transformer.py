"""One bidirectional diffusion transformer for LLaDA and Dream (docs/models.md §8, §2).

Pre-norm blocks ``h = x + o(Attn(norm(x)))``, ``y = h + down(silu(gate(norm(h))) * up(norm(h)))``,
a final RMSNorm and an (optionally tied) LM head; attention is never causal. What differs between
the families comes from ``ModelConfig`` properties: q/k/v biases (Dream), the logit shift (Dream),
fp32 RoPE (LLaDA), the embedding padding row (Dream), and GQA via ``num_kv_heads``.

How MDLMPE attention is computed (backend, block sizes, compile) is an :class:`AttentionImpl`
passed at build, not part of ``ModelConfig``: every implementation computes the same function.
What backward recomputes (layer checkpointing) is a :class:`Recompute` passed at build the same way.

The block (attention, SwiGLU, pre-norm) is in block.py, the input embedding in embedding.py; this
module assembles them and holds what concerns the whole model: the forward, the MDLMPE controls
and the ZeRO-3 declarations.

Module names here are the project's own (``embed.tokens``, ``layers.N.attn.q_proj``, ...);
``mdlmpe_ds.models.names`` maps them to the exact upstream checkpoint names.

ZeRO-3 notes (the model itself never imports DeepSpeed):
- every parameter is initialised inside the constructor of the module that owns it, so building
  under ``deepspeed.zero.Init`` (which partitions each module right after its own ``__init__``)
  keeps the intended initial values;
- a few parameters are read outside their owner's ``forward`` (the MDLMPE phase MLP is consumed as
  raw weights by the attention kernels, the embedding path reads W_p, b_p and g);
  ``zero3_external_parameters`` lists them with the module that reads them, for the engine to
  register with ``deepspeed.zero.register_external_parameter``. With ``phase_mlp="shared"`` the one
  phase MLP (``shared_phase``, owned by the model) is read by every layer's attention: it is listed
  once per layer, so each layer gathers it for its own forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from mdlmpe_ds.attention import AttentionImpl
from mdlmpe_ds.models.block import Block, LayerContext
from mdlmpe_ds.models.config import ModelConfig
from mdlmpe_ds.models.embedding import InputEmbedding
from mdlmpe_ds.models.layers import NormalLinear, RMSNorm
from mdlmpe_ds.models.recompute import Recompute
from mdlmpe_ds.models.scored_head import (
    DEFAULT_CHUNK,
    ScoredCE,
    scored_cross_entropy,
    scored_source_columns,
)
from mdlmpe_ds.pe.alibi import alibi_bias
from mdlmpe_ds.pe.phase import PhaseMLP
from mdlmpe_ds.pe.rope import rotary_angles
from mdlmpe_ds.seeding import init_stream


class DiffusionLM(nn.Module):
    """LLaDA / Dream masked diffusion LM (module docstring: layout, family differences, ZeRO-3 notes).

    ``impl``: how the MDLMPE attention runs (default ``AttentionImpl()``: backend ``auto``); see
    :meth:`set_attention_impl` to change it on a built model. ``recompute``: what training backward
    recomputes instead of keeping (default ``Recompute()``: nothing); ``self.recompute`` may be
    replaced at any time (same numbers)."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str | None = None,
        impl: AttentionImpl | None = None,
        recompute: Recompute | None = None,
    ) -> None:
        super().__init__()
        self.config = config.validate()
        self.impl = (impl if impl is not None else AttentionImpl()).validate()
        self.recompute = (recompute if recompute is not None else Recompute()).validate()
        self.embed = InputEmbedding(config, device)
        # phase_mlp="shared": one phase MLP for every layer, from a stream of its own (the backbone
        # and the encoder draw what they draw for RoPE and for per-layer MLPs alike).
        self.shared_phase = build_shared_phase(config, device)
        self.layers = nn.ModuleList(
            Block(config, device, self.impl, i, self.shared_phase) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.lm_head = NormalLinear(config.hidden_size, config.vocab_size, False, config.init_std, device)
        self.tie_weights()

    def set_attention_impl(self, impl: AttentionImpl) -> None:
        """Run the MDLMPE attention of every layer through ``impl`` from now on (same numbers)."""
        self.impl = impl.validate()
        for layer in self.layers:
            layer.attn.impl = self.impl

    def tie_weights(self) -> None:
        """With tied embeddings, one Parameter object serves the input table and the LM head (also
        under ZeRO-3, where lm_head's forward gathers it). Re-run after ``to_empty``, which unties."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed.tokens.weight

    # --- forward ---
    def forward(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor | None = None,
        raw: bool = False,
        positions: torch.Tensor | None = None,
        scored: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        head_chunk: int | None = None,
        head_chunks: int | None = None,
    ) -> torch.Tensor | ScoredCE:
        """Logits [B, L, V] in the parameter dtype, aligned so that logit i predicts token i.

        ``valid`` [B, L] bool marks positions attention may see (False: padding, or future blocks in
        blocked block diffusion); for MDLMPE it is also a_t. Dream's raw logits are next-token
        aligned and are re-aligned here with ``cat(l[:, :1], l[:, :-1])`` unless ``raw=True``.

        ``positions`` [B, L] long (default: 0..L-1 in every row) are the token positions t of RoPE
        and of the MDLMPE basis c_t, e.g. 0 at the first real token of a left-padded row (Dream
        forms position ids as cumsum(attention_mask) - 1), so the real tokens get the logits of the
        unpadded row. ALiBi needs none (its bias depends on i - j only); the absolute table rejects
        them.

        Training path: with ``scored`` [B, L] bool and ``targets`` [B, L] long, no logits are
        returned but ``ScoredCE``: the fp32 cross-entropy of the aligned logit against the target at
        each scored position, the head run on ``head_chunk`` rows at a time (default
        ``scored_head.DEFAULT_CHUNK``; a training run passes its own, head_chunks.py); under ZeRO-3
        pass ``head_chunks`` (``head_chunks.group_chunk_count``), the chunk count every rank must run alike,
        so no [B, L, V] tensor exists. Same values as CE of the full logits at those positions.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
        if (scored is None) != (targets is None):
            raise ValueError("pass scored and targets together (the scored-positions loss path) or neither")
        if scored is not None and (scored.shape != input_ids.shape or targets.shape != input_ids.shape):
            shapes = f"scored {tuple(scored.shape)}, targets {tuple(targets.shape)}"
            raise ValueError(
                f"scored and targets must have the shape of input_ids {tuple(input_ids.shape)}: {shapes}"
            )
        if valid is not None:
            if valid.shape != input_ids.shape:
                raise ValueError(
                    f"valid {tuple(valid.shape)} must have the shape of input_ids {tuple(input_ids.shape)}"
                )
            valid = valid.bool()
        length, cfg = input_ids.shape[1], self.config
        if positions is not None:
            positions = self._check_positions(positions, input_ids)
        x, features = self.embed(input_ids, valid, positions)
        key_valid = None if valid is None or bool(valid.all()) else valid
        ctx = LayerContext(key_valid=key_valid, features=features)
        if cfg.uses_rotary and positions is None:
            ctx.cos, ctx.sin = rotary_angles(length, cfg.head_dim, cfg.rope_theta, input_ids.device)  # [L, F]
        elif cfg.uses_rotary:
            cos, sin = rotary_angles(int(positions.max()) + 1, cfg.head_dim, cfg.rope_theta, input_ids.device)
            ctx.cos, ctx.sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [B, 1, L, F]
        if cfg.position_encoding == "alibi":
            ctx.alibi = alibi_bias(length, cfg.num_heads, key_valid, input_ids.device)  # [B|1, H, L, L]
        around_attention = self.recompute.attention_outside_checkpoint(
            cfg.position_encoding, self.impl.keeps_pair_tensors
        )
        for layer in self.layers:
            if self.recompute.layers and self.training and torch.is_grad_enabled():
                x = layer.checkpointed(x, ctx, around_attention)
            else:
                x = layer(x, ctx)
        if scored is not None:
            rows, cols = scored.bool().nonzero(as_tuple=True)  # [M], [M], row-major
            hidden = x[rows, scored_source_columns(cols, cfg.shift_logits and not raw)]  # [M, d]
            head_recompute = self.training and torch.is_grad_enabled()
            ce = scored_cross_entropy(
                self.lm_head,
                self.norm(hidden),
                targets[rows, cols],
                head_chunk or DEFAULT_CHUNK,
                head_recompute,
                head_chunks,
            )
            return ScoredCE(ce, rows, cols)  # ce [M] fp32
        logits = self.lm_head(self.norm(x))  # [B, L, V]
        if cfg.shift_logits and not raw:
            logits = torch.cat((logits[:, :1], logits[:, :-1]), dim=1)
        return logits

    def _check_positions(self, positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if self.config.position_encoding == "absolute":
            raise ValueError("the absolute position table takes no per-row positions; pass positions=None")
        if positions.shape != input_ids.shape:
            shapes = f"{tuple(positions.shape)} vs input_ids {tuple(input_ids.shape)}"
            raise ValueError(f"positions must have the shape of input_ids: {shapes}")
        if positions.dtype.is_floating_point or bool((positions < 0).any()):
            raise ValueError("positions must be non-negative integers")
        return positions.long()

    # --- MDLMPE controls ---
    def set_active_kv_heads(self, mask: torch.Tensor) -> None:
        """Which KV heads use the MDLMPE phase residual, in every layer (docs/method.md "Heads"). [Hkv]
        bool."""
        for layer in self.layers:
            layer.attn.set_active_kv_heads(mask)

    def phase_mlps(self) -> list[PhaseMLP]:
        """The phase MLP of each layer, in layer order (the same module N times when shared); [] for
        other encodings."""
        return [layer.attn.phase_mlp for layer in self.layers if layer.attn.phase_mlp is not None]

    def mdlmpe_parameter_names(self) -> list[str]:
        """Names (as in ``named_parameters``) of the MDLMPE-only parameters: W_p, b_p, g, phase MLPs."""
        return [name for name, _ in self.named_parameters() if _is_mdlmpe_name(name)]

    def num_backbone_parameters(self) -> int:
        """Parameters of the backbone (everything but MDLMPE), counted once even when tied.

        Uses ``ds_numel`` when present so the count is the full one under ZeRO-3 partitioning.
        """
        return sum(_numel(p) for name, p in self.named_parameters() if not _is_mdlmpe_name(name))

    def num_mdlmpe_parameters(self) -> int:
        return sum(_numel(p) for name, p in self.named_parameters() if _is_mdlmpe_name(name))

    def zero3_external_parameters(self) -> list[tuple[nn.Module, nn.Parameter]]:
        """(module, parameter) pairs where ``module.forward`` reads a parameter it does not own.

        The attention kernels consume the phase MLP as raw weights (``PhaseMLP.params()``) and the
        embedding path reads W_p, b_p and g directly, so ZeRO-3's per-module gathering would not
        fetch them. A shared phase MLP is read by every layer: its parameters are paired with each
        layer's attention. The engine registers each pair with
        ``deepspeed.zero.register_external_parameter`` before ``deepspeed.initialize``; this module
        never imports DeepSpeed.
        """
        pairs: list[tuple[nn.Module, nn.Parameter]] = []
        if self.embed.mdlmpe is not None:
            pairs += [(self.embed, p) for p in self.embed.mdlmpe.parameters()]
        for layer in self.layers:
            if layer.attn.phase_mlp is not None:
                pairs += [(layer.attn, p) for p in layer.attn.phase_mlp.parameters()]
        return pairs

    def zero3_leaf_modules(self) -> list[nn.Module]:
        """The modules whose ``forward`` reads MDLMPE parameters of a child (the readers in
        ``zero3_external_parameters``). Register those parameters as external to these modules;
        do not flag them with ``set_z3_leaf_modules``: with DeepSpeed 0.19.8 that gathered them for
        the forward but not for the backward here (size-0 weight in autograd)."""
        readers: list[nn.Module] = []
        for module, _ in self.zero3_external_parameters():
            if not any(module is seen for seen in readers):
                readers.append(module)
        return readers

    @torch.no_grad()
    def reset_mdlmpe_parameters(self, gathered: Callable[..., AbstractContextManager] | None = None) -> None:
        """Initialise the MDLMPE parameters as in docs/method.md "Initialisation" (W2 = b2 = 0, b_p = 0, gamma
        = gamma_init).

        Needed after building under ``deepspeed.zero.Init``: ``PhaseMLP`` and ``MDLMPEEncoder`` set
        W2 = b2 = 0 and W_p, b_p from their own constructor, after ZeRO-3 has already partitioned
        the child ``nn.Linear`` layers, so those writes are lost. Pass
        ``gathered=deepspeed.zero.GatheredParameters``; rank 0's values are kept. Also used when a
        checkpoint lacks the MDLMPE keys.
        """
        params = dict(self.named_parameters())
        names = self.mdlmpe_parameter_names()
        context = gathered([params[n] for n in names], modifier_rank=0) if gathered else nullcontext()
        with context:
            if self.embed.mdlmpe is not None:
                with init_stream("mdlmpe_encoder"):  # the stream construction drew from
                    self.embed.mdlmpe.reset_parameters()
                    if self.embed.mdlmpe.coordinate is not None:  # ablation "MLP instead of the basis"
                        for module in self.embed.mdlmpe.coordinate.modules():
                            if isinstance(module, nn.Linear):
                                module.reset_parameters()
            for layer in self.layers:
                if layer.attn.phase is not None:
                    with init_stream("phase_mlp", layer.attn.layer_index):
                        layer.attn.phase.reset_parameters()
            if self.shared_phase is not None:
                with init_stream("shared_phase_mlp"):
                    self.shared_phase.reset_parameters()


def build_shared_phase(config: ModelConfig, device=None) -> PhaseMLP | None:
    """The model's one phase MLP when ``mdlmpe.phase_mlp == "shared"`` (else None), initialised as
    a layer's (W1, b1 default, W2 = b2 = 0) from the stream ``shared_phase_mlp``: its own tag, so
    the backbone stays that of RoPE for one seed, and the shared MLP is not layer 0's MLP of a
    per-layer model either."""
    if config.position_encoding != "mdlmpe" or not config.mdlmpe.shared_phase:
        return None
    num_pairs = config.head_dim // 2
    with init_stream("shared_phase_mlp"):
        return PhaseMLP(num_pairs, config.mdlmpe.hidden_width(num_pairs), device=device)


def _is_mdlmpe_name(name: str) -> bool:
    return name.startswith(("embed.mdlmpe.", "shared_phase.")) or ".attn.phase." in name


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


__all__ = ["DiffusionLM", "build_shared_phase"]
