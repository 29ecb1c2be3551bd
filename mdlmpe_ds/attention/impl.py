"""How MDLMPE attention is computed on this run: a run-time choice, never part of the model.

Every implementation gives the spec's numbers (attention/reference.py), so the choice lives in the
run configuration (its ``attention`` section) and is passed when the model is built
(``DiffusionLM(config, impl=AttentionImpl(...))``); it is not stored in the model's config, its
checkpoints or an exported model, and a run may resume with another one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

# "auto": the fused Triton kernel on CUDA tensors, the blocked path elsewhere (the CPU), chosen per
# call from the tensors' device and logged (attention.choose_backend).
# "dense": the pair phases of a layer formed once and the correction added as a bias, with plain
# autograd (attention/dense.py): O(L^2 |M|) memory per head, for short rows (studies, tests).
# "triton-pair": the pair-bias kernels and SDPA with an additive bias
# (attention/triton/pair_backend.py), by name only.
ATTENTION_BACKENDS = ("auto", "reference", "dense", "blocked", "triton", "triton-pair")


@dataclass
class AttentionImpl:
    """Backend and its tuning. ``query_block``: query rows per block of the blocked path (an upper
    bound in eager mode on the CPU, see blocked.eager_block_rows). ``tile``: the fused Triton
    kernel's query / key tile, a power of 2 no larger than 64 (on a GPU at least 16); None: the
    tile that fits the GPU for the head size and dtype. ``compile``: run the blocked path's pieces
    through torch.compile (same numbers; one graph per distinct shape). ``pair_buffer_gib``: the
    most one launch of the Triton kernels holds in its transient alpha / beta / dE/d delta buffers
    (3 |M| L^2 fp32 per sequence); a sequence over it runs in row blocks (same numbers)."""

    backend: str = field(
        default="auto",
        metadata={
            "help": f"MDLMPE attention, one of {ATTENTION_BACKENDS}; auto: triton on CUDA, else blocked"
        },
    )
    query_block: int = field(
        default=128, metadata={"help": "query rows per block of the blocked MDLMPE attention"}
    )
    tile: int | None = field(
        default=None, metadata={"help": "Triton kernel tile (a power of 2, <= 64); None: chosen per GPU"}
    )
    compile: bool = field(
        default=False,
        metadata={"help": "run the blocked MDLMPE attention through torch.compile (same numbers)"},
    )
    pair_buffer_gib: float = field(
        default=6.0, metadata={"help": "most GiB of the Triton kernels' transient pair buffers per launch"}
    )

    def validate(self) -> AttentionImpl:
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"attention: {key}={getattr(self, key)!r} {why}")

        if self.backend not in ATTENTION_BACKENDS:
            raise bad("backend", f"must be one of {ATTENTION_BACKENDS}")
        if self.query_block < 1:
            raise bad("query_block", "must be >= 1")
        tile = self.tile
        if tile is not None and not (1 <= tile <= 64 and tile & (tile - 1) == 0):
            raise bad("tile", "must be None (per GPU) or a power of 2 no larger than 64")
        if not self.pair_buffer_gib > 0:
            raise bad("pair_buffer_gib", "must be > 0")
        return self

    @property
    def pair_buffer_bytes(self) -> int:
        return int(self.pair_buffer_gib * 2**30)

    @property
    def keeps_pair_tensors(self) -> bool:
        """Whether the attention keeps O(L^2) tensors for backward: the reference and dense paths
        (their pair tensors) and triton-pair (SDPA keeps the [B, Hq, L, L] bias); the other backends
        recompute them per block or tile, so layer checkpointing may leave them out of its
        recomputed segment."""
        return self.backend in ("reference", "dense", "triton-pair")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionImpl:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"attention: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**data).validate()
