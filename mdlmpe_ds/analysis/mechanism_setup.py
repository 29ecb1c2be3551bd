"""What every mechanism figure (analysis/mechanism.py) shares: one encoder geometry with the window and
sigma of ``MDLMPEConfig``, the result record a figure returns and its JSON form, the token-level
availability ratio r = A / D, and the checks of a figure's target and pair.

Apart from the figures because it is their common vocabulary: the command line and the plots read
``Geometry`` and ``MechanismResult`` without any figure's maths.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mdlmpe_ds.pe.availability import gaussian_taps, sine_basis, token_summaries
from mdlmpe_ds.pe.config import MDLMPEConfig

TOPOLOGIES = ("local", "uniform", "edge-clustered", "periodic")
# Largest matrix written into a figure's JSON (the L x L Jacobian at L = 512); larger ones are omitted.
JSON_MAX_MATRIX = 512 * 512


@dataclass(frozen=True)
class Geometry:
    """One encoder geometry: W and sigma come from ``MDLMPEConfig`` (Eq. (2)), so a
    figure uses exactly the window the trainer would use for L_ref = ``length``."""

    length: int
    window_ratio: float
    rho: float
    theta: float
    head_dim: int
    eps: float = 1e-6
    clip_kappa: float = 1e-4

    def config(self) -> MDLMPEConfig:
        return MDLMPEConfig(
            max_seq_len=self.length,
            window_ratio=self.window_ratio,
            rho=self.rho,
            eps=self.eps,
            clip_kappa=self.clip_kappa,
        ).validate()

    @property
    def window(self) -> int:
        return self.config().window

    @property
    def sigma(self) -> float:
        return self.config().sigma

    @property
    def num_pairs(self) -> int:
        return self.head_dim // 2

    def validate(self) -> Geometry:
        self.config()
        if self.length < 2:
            raise ValueError(f"analysis geometry: length={self.length} must be >= 2")
        if self.head_dim < 4 or self.head_dim % 2:
            raise ValueError(f"analysis geometry: head_dim={self.head_dim} must be even and >= 4")
        if self.theta <= 0:
            raise ValueError(f"analysis geometry: theta={self.theta} must be > 0")
        return self

    def describe(self) -> dict[str, Any]:
        """Settings as written into each figure's JSON (inputs plus the derived W, sigma, F)."""
        return {**asdict(self), "window": self.window, "sigma": self.sigma, "num_pairs": self.num_pairs}


@dataclass
class MechanismResult:
    """What one figure shows: its settings, the arrays it plots, and the paper's claims as numbers."""

    name: str
    settings: dict[str, Any]
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    checks: dict[str, float | bool] = field(default_factory=dict)
    # Arrays left out of the JSON (name -> why), e.g. an L x L matrix at a large L.
    omitted: dict[str, str] = field(default_factory=dict)

    def to_json(self, digits: int = 7) -> dict[str, Any]:
        """A JSON-ready dict; floats rounded to ``digits`` significant digits to keep files small."""

        def plain(x: torch.Tensor) -> Any:
            if not x.is_floating_point():  # bool and integer arrays as they are
                return x.tolist()
            return _round_nested(x.double().tolist(), digits)

        return {
            "figure": self.name,
            "settings": self.settings,
            "checks": {
                k: (v if isinstance(v, bool) else float(f"{v:.{digits}g}")) for k, v in self.checks.items()
            },
            "arrays": {k: plain(v) for k, v in self.arrays.items() if k not in self.omitted},
            "shapes": {k: list(v.shape) for k, v in self.arrays.items()},
            "omitted": self.omitted,
        }


def _round_nested(values: Any, digits: int) -> Any:
    """Round every float to ``digits`` significant digits; NaN and inf become None (valid JSON)."""
    if isinstance(values, list):
        return [_round_nested(v, digits) for v in values]
    if not math.isfinite(values):
        return None
    return float(f"{values:.{digits}g}")


def ones_row(length: int) -> torch.Tensor:
    return torch.ones(1, length, dtype=torch.float32)


def availability_ratio(b: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """r_{i,f} = A_{i,f} / D_{i,f} from the product's banded ``token_summaries`` (all valid). [B, L, F]."""
    a = torch.ones_like(b)
    taps = gaussian_taps(geometry.window, geometry.sigma)
    coordinate = sine_basis(geometry.length, geometry.head_dim, geometry.theta)
    A, D = token_summaries(b, a, coordinate, taps, geometry.eps)
    return A / D


def check_target(geometry: Geometry, target: int | None) -> int:
    target = geometry.length // 2 if target is None else target
    if not 0 <= target < geometry.length:
        raise ValueError(f"analysis: target={target} outside [0, {geometry.length})")
    return target


def check_pair(geometry: Geometry, pair: int) -> int:
    if not 0 <= pair < geometry.num_pairs:
        raise ValueError(
            f"analysis: pair={pair} outside [0, F={geometry.num_pairs}) for head_dim={geometry.head_dim}"
        )
    return pair


__all__ = [
    "JSON_MAX_MATRIX",
    "TOPOLOGIES",
    "Geometry",
    "MechanismResult",
    "availability_ratio",
    "check_pair",
    "check_target",
    "ones_row",
]
