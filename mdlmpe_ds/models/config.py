"""The backbone configuration: one dataclass for both families (docs/models.md §8, §1).

LLaDA and Dream share one transformer; what differs between them is small and is derived from
``family`` here (biases, logit shift, RoPE precision, embedding padding row) instead of being
forked into two model files.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mdlmpe_ds.compat import MODEL_RUNTIME_KEYS, read_stored_model_config
from mdlmpe_ds.pe.config import FOLLOW_MODEL, MDLMPEConfig

log = logging.getLogger(__name__)

FAMILIES = ("llada", "dream")
POSITION_ENCODINGS = ("rope", "mdlmpe", "alibi", "absolute")


@dataclass
class ModelConfig:
    """Sizes, special ids and the position encoding of one bidirectional diffusion transformer.

    ``max_seq_len`` is the run's L_ref: the length of the learned table for ``absolute`` and the
    reference length that fixes MDLMPE's window (docs/method.md "Window"); ``mdlmpe.max_seq_len`` is kept
    equal to it (``validate`` refuses a mismatch instead of picking one silently).
    """

    family: str = "llada"
    vocab_size: int = 126464
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    intermediate_size: int = 12288
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    mask_token_id: int = 126336
    eos_token_id: int = 126081
    pad_token_id: int = 126081
    position_encoding: str = "rope"
    mdlmpe: MDLMPEConfig = field(default_factory=lambda: MDLMPEConfig(max_seq_len=FOLLOW_MODEL))
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if isinstance(self.mdlmpe, dict):
            self.mdlmpe = MDLMPEConfig.from_dict({"max_seq_len": self.max_seq_len, **self.mdlmpe})
        elif self.mdlmpe.max_seq_len == FOLLOW_MODEL:  # "not given": follow the model
            self.mdlmpe.max_seq_len = self.max_seq_len

    # --- what the family decides (docs/models.md §8) ---
    @property
    def qkv_bias(self) -> bool:
        """Dream (Qwen2 layout) has q/k/v biases; LLaDA has no bias anywhere."""
        return self.family == "dream"

    @property
    def shift_logits(self) -> bool:
        """Dream keeps Qwen2.5's next-token alignment: raw logit i-1 predicts token i."""
        return self.family == "dream"

    @property
    def rope_fp32(self) -> bool:
        """LLaDA rotates q, k in fp32 (``rope_full_precision``); Dream multiplies in the activation dtype."""
        return self.family == "llada"

    @property
    def embedding_padding_idx(self) -> int | None:
        """Dream's ``embed_tokens`` has padding_idx = pad id (that row gets no gradient); LLaDA none."""
        return self.pad_token_id if self.family == "dream" else None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def uses_rotary(self) -> bool:
        return self.position_encoding in ("rope", "mdlmpe")

    def validate(self) -> ModelConfig:
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"model config: {key}={getattr(self, key)!r} {why}")

        if self.family not in FAMILIES:
            raise bad("family", f"must be one of {FAMILIES}")
        if self.position_encoding not in POSITION_ENCODINGS:
            raise bad("position_encoding", f"must be one of {POSITION_ENCODINGS}")
        for key in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_seq_len",
        ):
            if getattr(self, key) < 1:
                raise bad(key, "must be >= 1")
        if self.hidden_size % self.num_heads:
            raise bad("hidden_size", f"must be divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise bad("num_heads", f"must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.uses_rotary and self.head_dim % 2:
            raise bad("hidden_size", f"gives an odd head_dim={self.head_dim}; rotary needs it even")
        if self.position_encoding == "mdlmpe" and self.head_dim < 4:
            raise bad("hidden_size", f"gives head_dim={self.head_dim}; MDLMPE needs head_dim >= 4")
        for key in ("mask_token_id", "eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, key) < self.vocab_size:
                raise bad(key, f"must be a token id in [0, vocab_size={self.vocab_size})")
        if not 0 < self.rms_norm_eps < 1:
            raise bad("rms_norm_eps", "must be in (0, 1)")
        if self.rope_theta <= 0:
            raise bad("rope_theta", "must be > 0")
        if self.init_std <= 0:
            raise bad("init_std", "must be > 0")
        if not isinstance(self.mdlmpe, MDLMPEConfig):
            raise bad("mdlmpe", "must be an MDLMPEConfig")
        if self.mdlmpe.max_seq_len != self.max_seq_len:
            raise ValueError(
                f"model config: mdlmpe.max_seq_len={self.mdlmpe.max_seq_len} != "
                f"max_seq_len={self.max_seq_len}; "
                "MDLMPE's L_ref is the model's max_seq_len (docs/method.md 'Window'), set both"
            )
        self.mdlmpe.validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mdlmpe"] = self.mdlmpe.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], stored: bool = False) -> ModelConfig:
        """A validated config from ``data``. ``stored``: ``data`` was written by a checkpoint or an
        export, which may still hold run-time keys (checkpointing switches; attention-implementation
        keys in its MDLMPE block): they are dropped (``drop_stored_runtime_keys``); in a new config
        they are an error saying where they moved."""
        data = drop_stored_runtime_keys(data) if stored else dict(data)
        check_model_keys(data, "model config")
        if isinstance(data.get("mdlmpe"), dict):
            data["mdlmpe"] = MDLMPEConfig.from_dict(data["mdlmpe"])
        return cls(**data).validate()


def check_model_keys(keys: Iterable[str], where: str) -> None:
    """Raise for a key that is not a ModelConfig field: a run-time key says where it moved, any
    other lists the known keys. ``where`` names the source in the message."""
    keys = set(keys)
    for key in sorted(keys & set(MODEL_RUNTIME_KEYS)):  # older configs' keys (compat.py)
        run_key, field_name = MODEL_RUNTIME_KEYS[key]
        raise ValueError(
            f"{where}: {key!r} is not a model key any more: checkpointing is a run-time choice, set "
            f"--{run_key} in the run config, or build DiffusionLM(config, "
            f"recompute=Recompute({field_name}=...))"
        )
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(keys - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known keys are {sorted(known)}")


def drop_stored_runtime_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A stored model config (a checkpoint's or an export's) without the run-time keys older
    versions wrote into it (compat.read_stored_model_config). The model is the same without them;
    what was dropped is logged at debug level."""
    out, dropped = read_stored_model_config(data)
    if dropped:
        log.debug(f"stored model config: dropped the run-time keys {dropped}")
    return out
