"""What backward recomputes instead of keeping: a run-time memory choice, never part of the model.

Checkpointing changes how much memory a training step holds and how long it takes, not the numbers
it computes. Like ``AttentionImpl`` it is passed when the model is built
(``DiffusionLM(config, recompute=Recompute(...))``), kept out of ``ModelConfig``, its checkpoints
and exported models, and a run may resume with another choice. The run configuration spells it
``model.gradient_checkpointing`` and ``model.recompute_mdlmpe_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recompute:
    """``layers``: checkpoint every transformer layer (keep its input, recompute it in backward).

    ``mdlmpe_attention``: with ``layers``, recompute the MDLMPE attention with the layer too. By
    default an MDLMPE attention that manages its own memory (every backend but the reference
    recomputes its pair tensors per block or tile) stays out of the recomputed segment: its rotated
    q, k, v and its output are kept (~2 (Hq + Hkv) d_h values per token and layer) and backward does
    not run the attention forward a second time (the costliest part of the layer: 3 region-1 passes
    per block become 2). True trades that memory back for the extra forward.
    """

    layers: bool = False
    mdlmpe_attention: bool = False

    def validate(self) -> Recompute:
        for key in ("layers", "mdlmpe_attention"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"recompute: {key}={getattr(self, key)!r} must be true or false")
        return self

    def attention_outside_checkpoint(self, position_encoding: str, keeps_pair_tensors: bool) -> bool:
        """Whether layer checkpointing keeps the attention out of its recomputed segment: only for
        MDLMPE attention whose memory is already O(C L) or O(L), i.e. whose implementation does not
        keep its pair tensors (``AttentionImpl.keeps_pair_tensors``), unless asked to recompute it."""
        return (
            self.layers
            and position_encoding == "mdlmpe"
            and not keeps_pair_tensors
            and not self.mdlmpe_attention
        )
