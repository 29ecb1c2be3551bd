"""The LoRA spec: ``--lora r=16,alpha=32,dropout=0.05,targets=q,k,v,o,gate,up,down`` or a ``model.lora``
mapping, parsed and checked with errors naming the key. Kept apart from ``adapters.py`` (injection,
checkpoints, export) so the run config can validate a spec without importing the training side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

ADAPTER = "default"  # peft's adapter name inside the training model
#: Short target names -> the module path inside a transformer block (same for both families here).
TARGETS = {
    "q": "attn.q_proj",
    "k": "attn.k_proj",
    "v": "attn.v_proj",
    "o": "attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
#: Other accepted spellings of a target: the project's / Dream's module names and LLaDA's upstream ones.
TARGET_ALIASES = {
    **{path.split(".")[-1]: short for short, path in TARGETS.items()},  # q_proj, ..., down_proj
    "attn_out": "o",  # LLaDA
    "ff_proj": "gate",  # LLaDA
    "ff_out": "down",  # LLaDA
}
KEYS = ("r", "alpha", "dropout", "targets")
BASE_FILE = "lora_base.safetensors"  # the initial frozen base of a from-scratch (preset) run
CHECKPOINT_FILE = "lora.json"  # in each checkpoint: the spec and the trainable parameter names
MDLMPE_FILE = "mdlmpe.safetensors"  # next to the adapter in an --adapter-only export


@dataclass(frozen=True)
class LoraSpec:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = tuple(TARGETS)

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def text(self) -> str:
        """The canonical ``--lora`` string (what the run config stores)."""
        return f"r={self.r},alpha={self.alpha:g},dropout={self.dropout:g},targets={','.join(self.targets)}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "targets": list(self.targets)}


# ---------------------------------------------------------------------------- parsing
def _target(name: str, where: str) -> str:
    short = name if name in TARGETS else TARGET_ALIASES.get(name)
    if short is None:
        valid = ", ".join([*TARGETS, *sorted(TARGET_ALIASES)])
        raise ValueError(f"{where}: unknown LoRA target {name!r}; valid targets are {valid} (or 'all')")
    return short


def from_mapping(values: Mapping[str, Any], where: str = "--lora") -> LoraSpec:
    """A spec from {r, alpha, dropout, targets} (a config-file section); unknown keys are errors."""
    unknown = [k for k in values if k not in KEYS]
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; valid keys are {', '.join(KEYS)}")
    spec = LoraSpec()
    try:
        r = int(values.get("r", spec.r))
        alpha = float(values.get("alpha", spec.alpha))
        dropout = float(values.get("dropout", spec.dropout))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: bad number ({err})") from err
    raw = values.get("targets", list(spec.targets))
    names = raw.split(",") if isinstance(raw, str) else list(raw)
    names = [n.strip() for n in names if n.strip()]
    if names == ["all"]:
        names = list(TARGETS)
    chosen = {_target(n, where) for n in names}
    if r < 1:
        raise ValueError(f"{where}: r={r} must be >= 1")
    if not alpha > 0:
        raise ValueError(f"{where}: alpha={alpha} must be > 0")
    if not 0 <= dropout < 1:
        raise ValueError(f"{where}: dropout={dropout} must be in [0, 1)")
    if not chosen:
        raise ValueError(f"{where}: targets is empty")
    return LoraSpec(r, alpha, dropout, tuple(t for t in TARGETS if t in chosen))


def parse(text: str, where: str = "--lora") -> LoraSpec:
    """``r=16,alpha=32,dropout=0.05,targets=q,k,v,o`` -> LoraSpec. Values after ``targets=`` run up
    to the next ``key=``; omitted keys keep their defaults (r 16, alpha 32, dropout 0.05, all seven)."""
    values: dict[str, Any] = {}
    key = None
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if "=" in item:
            key, value = (s.strip() for s in item.split("=", 1))
            if key not in KEYS:
                raise ValueError(
                    f"{where}: unknown key {key!r} in {text!r}; valid keys are {', '.join(KEYS)}"
                )
            if key in values:
                raise ValueError(f"{where}: key {key!r} given twice in {text!r}")
            values[key] = [value] if key == "targets" else value
        elif key == "targets":
            values["targets"].append(item)
        else:
            raise ValueError(f"{where}: {item!r} in {text!r} is not key=value (keys: {', '.join(KEYS)})")
    return from_mapping(values, where)
