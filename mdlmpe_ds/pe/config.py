"""Configuration of the MDLMPE position encoding (docs/method.md, paper Appendix A and C).

Kept in its own module (not in ``mdlmpe_ds.config.run``) so the pure-torch encoding can be used and
tested without the trainer's configuration tree; the trainer's ``ModelConfig`` embeds this.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mdlmpe_ds.compat import MDLMPE_MOVED_KEYS

COORDINATES = ("sine", "mlp", "none")
# "per_layer": every attention layer owns a phase MLP; "shared": one phase MLP, owned by the model,
# serves every layer (the paper's "shared" MLP, docs/method.md "Phase MLP: per layer or shared").
PHASE_MLPS = ("per_layer", "shared")
# max_seq_len "not given": L_ref follows the length of the model (ModelConfig) or run (RunConfig).
FOLLOW_MODEL = -1


def _moved_key_error(key: str) -> ValueError:
    where = MDLMPE_MOVED_KEYS[key]
    if where is None:
        return ValueError(
            f"mdlmpe config: {key!r} is gone: the blocked attention always recomputes each block's "
            "pair tensors in backward; remove the key"
        )
    flag = where.split(".", 1)[1]
    return ValueError(
        f"mdlmpe config: {key!r} is not a model key any more: how the attention runs is chosen per "
        f"run; set {where} instead (--{where} on the command line, `attention: {{{flag}: ...}}` in a "
        f"config file, or AttentionImpl({flag}=...) when building DiffusionLM)"
    )


@dataclass
class MDLMPEConfig:
    """Every knob of MDLMPE with the defaults of docs/method.md "Decisions the paper leaves open".

    ``max_seq_len`` is L_ref: the window W = round(window_ratio * L_ref) is fixed by the configured
    maximum length, not by the length of a batch, so padding never changes a feature and inference
    uses the W the model was trained with.
    """

    max_seq_len: int = field(
        default=1024, metadata={"help": "L_ref: the window W = round(window_ratio * L_ref) is fixed by it"}
    )
    window_ratio: float = field(default=3 / 16, metadata={"help": "Gaussian window as a fraction of L_ref"})
    rho: float = field(default=0.25, metadata={"help": "Gaussian width sigma = max(rho * W, 1) (Eq. (2))"})
    # Denominator safeguard of Eq. (22) and of D (Eq. (16)).
    eps: float = field(
        default=1e-6, metadata={"help": "denominator safeguard of Eq. (22) and of D (Eq. (16))"}
    )
    # arccos argument is clipped to [-1 + kappa, 1 - kappa] (Eq. (37), docs/method.md "Pair feature").
    clip_kappa: float = field(
        default=1e-4, metadata={"help": "arccos argument clipped to [-1 + kappa, 1 - kappa] (Eq. (37))"}
    )
    gamma_max: float = field(
        default=0.10,
        metadata={"help": "embedding gate bound: gamma = gamma_max * sigmoid(g) (Eq. (11))"},
    )
    gamma_init: float = field(default=0.01, metadata={"help": "the embedding gate gamma at initialisation"})
    tau_max: float = field(
        default=0.25,
        metadata={"help": "phase residual bound: delta = tau_max * tanh(MLP(s)) (Eq. (25))"},
    )
    # Hidden width H of the phase MLP; None means max(16, F / 2).
    phase_hidden: int | None = field(
        default=None, metadata={"help": "hidden width H of the phase MLP; None: max(16, F / 2)"}
    )
    # --- ablation switches (paper Table 4, Appendix C) ---
    # False: no Gaussian window; each token summarises only its own state (w = identity).
    use_gaussian: bool = field(
        default=True, metadata={"help": "false: no Gaussian window, each token summarises only its own state"}
    )
    # "sine": c = (1 + sin(t w_f)) / 2 (the method); "mlp": a learned non-negative coordinate
    # (Appendix C "MLP instead of basis"); "none": c = 1 for every pair (binary/Gaussian only).
    coordinate: str = field(
        default="sine",
        metadata={"help": "sine: c = (1 + sin(t w_f)) / 2; mlp: a learned coordinate; none: c = 1"},
    )
    use_embedding: bool = field(
        default=True,
        metadata={"help": "false: no gated availability embedding (the embedding path)"},
    )
    # Who owns the phase MLP: each layer ("per_layer") or the model ("shared", one for all layers).
    # Configs stored before this key existed read as "per_layer" (the dataclass default).
    phase_mlp: str = field(
        default="per_layer",
        metadata={"help": "who owns the phase MLP: each layer (per_layer) or the model (shared)"},
    )

    def validate(self) -> MDLMPEConfig:
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"mdlmpe config: {key}={getattr(self, key)!r} {why}")

        if self.max_seq_len < 1:
            raise bad("max_seq_len", "must be >= 1")
        if not self.window_ratio > 0:
            raise bad("window_ratio", "must be > 0")
        if not self.rho > 0:
            raise bad("rho", "must be > 0")
        if not 0 < self.eps < 1e-2:
            raise bad("eps", "must be in (0, 1e-2)")
        if not 0 < self.clip_kappa < 1:
            raise bad("clip_kappa", "must be in (0, 1)")
        if not 0 < self.gamma_init < self.gamma_max:
            raise bad("gamma_init", f"must be in (0, gamma_max={self.gamma_max})")
        if not 0 < self.tau_max <= math.pi:
            raise bad("tau_max", "must be in (0, pi]")
        if self.phase_hidden is not None and self.phase_hidden < 1:
            raise bad("phase_hidden", "must be >= 1 or None")
        if self.coordinate not in COORDINATES:
            raise bad("coordinate", f"must be one of {COORDINATES}")
        if self.phase_mlp not in PHASE_MLPS:
            raise bad("phase_mlp", f"must be one of {PHASE_MLPS}")
        return self

    @property
    def shared_phase(self) -> bool:
        """Whether one phase MLP serves every layer (``phase_mlp="shared"``)."""
        return self.phase_mlp == "shared"

    @property
    def window(self) -> int:
        """W = round(window_ratio * L_ref) (Eq. (2)); 0 when the Gaussian is ablated."""
        if not self.use_gaussian:
            return 0
        return math.floor(self.window_ratio * self.max_seq_len + 0.5)

    @property
    def sigma(self) -> float:
        """sigma = max(rho * W, 1) (Eq. (2))."""
        return max(self.rho * self.window, 1.0)

    def hidden_width(self, num_pairs: int) -> int:
        """H = max(16, F / 2) unless set explicitly (Eq. (25))."""
        return self.phase_hidden if self.phase_hidden is not None else max(16, num_pairs // 2)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def check_keys(cls, keys: Iterable[str]) -> None:
        """Raise for a key that moved (compat.MDLMPE_MOVED_KEYS: saying where it went) or an unknown
        key (listing the known)."""
        keys = list(keys)
        for key in keys:
            if key in MDLMPE_MOVED_KEYS:
                raise _moved_key_error(key)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(keys) - known)
        if unknown:
            raise ValueError(f"mdlmpe config: unknown keys {unknown}; known keys are {sorted(known)}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MDLMPEConfig:
        """A validated config from ``data``; a key that moved is an error that says where it went
        (read stored configs through ``compat.read_stored_mdlmpe`` first)."""
        cls.check_keys(data)
        return cls(**data).validate()
