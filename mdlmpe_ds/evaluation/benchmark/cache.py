"""What a benchmark result belongs to: the model's identity and the settings it was scored under.

A result is cached per (model, task, settings) as one JSON file and reused when all three match.
Identities are read without loading weights and without the network, so ``--dry-run`` works for
hub names on a machine that has never downloaded them:

- a local directory (export or training run): its resolved path plus the names, sizes and
  modification times of its weight files (a re-export or a new checkpoint is a new model);
- a hub id: before a real run it is resolved to its snapshot (``resolve_hub``), so the snapshot's
  path (it names the commit) identifies it like any local directory; ``--dry-run`` resolves nothing
  and uses the id itself (and the family read from the name: ``LLaDA`` / ``Dream``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mdlmpe_ds.evaluation.loading import is_hf_dir
from mdlmpe_ds.hub.resolve import looks_like_hub_id, resolve
from mdlmpe_ds.training import checkpoint as ckpt

WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.pt", "*.bin", "config.json", "latest")


@dataclass(frozen=True)
class ModelRef:
    """A model named on the command line, identified without loading it."""

    name: str  # the table's column name
    path: str  # as given
    family: str  # llada | dream
    identity: str  # stable text; its hash names the cache directory
    local: bool

    @property
    def cache_dir_name(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name)[:40]
        return f"{slug}-{digest(self.identity)[:12]}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def digest(obj: Any) -> str:
    """sha256 of a JSON-able object in canonical form."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _file_stamp(root: Path) -> list[tuple[str, int, int]]:
    files = sorted({p for pattern in WEIGHT_FILES for p in root.rglob(pattern) if p.is_file()})
    return [(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def family_from_config(config: dict[str, Any], where: str) -> str:
    block = config.get("mdlmpe_ds") or {}
    family = block.get("family") or config.get("family") or str(config.get("model_type", ""))
    family = family.lower()
    for known in ("llada", "dream"):
        if known in family:
            return known
    raise ValueError(f"{where}: cannot tell the model family (llada / dream) from its config; pass --family")


def describe_model(path: str, name: str | None = None, family: str | None = None) -> ModelRef:
    """The model's family and identity, read from disk only (no weights, no network)."""

    p = Path(path)
    display = name or (p.resolve().name if p.exists() else path.replace("/", "__"))
    if p.exists():
        root = p.resolve()
        if is_hf_dir(root):
            fam = family or family_from_config(json.loads((root / "config.json").read_text()), str(root))
        else:
            step_dir = ckpt.resolve_checkpoint(root, log=lambda *_: None)
            saved = ckpt.read_saved_run(step_dir)
            fam = family or family_from_config(saved.model_config, str(step_dir))
            root = step_dir
        identity = json.dumps({"path": str(root), "files": _file_stamp(root)})
        return ModelRef(display, path, fam, identity, local=True)

    if not looks_like_hub_id(path):
        raise FileNotFoundError(f"{path}: no such model directory or run, and not a hub id (org/name)")
    fam = family or _family_from_name(path)
    return ModelRef(display, path, fam, json.dumps({"hub": path}), local=False)


def resolve_hub(path: str, name: str | None = None, family: str | None = None) -> ModelRef:
    """``describe_model`` of a hub id's downloaded snapshot (the same resolution ``load_model``
    makes), keeping the id as the column name; a local path is described as it is."""

    if Path(path).exists() or not looks_like_hub_id(path):
        return describe_model(path, name, family)
    return describe_model(str(resolve(path, what="model")), name or path, family)


def _family_from_name(name: str) -> str:
    lower = name.lower()
    hits = [f for f in ("llada", "dream") if f in lower]
    if len(hits) != 1:
        raise ValueError(f"{name}: cannot tell the family (llada / dream) from the hub name; pass --family")
    return hits[0]


class ResultCache:
    """``<root>/<model>/<task key>-<settings hash>.json``: one (model, task, settings) result."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, model: ModelRef, task_key: str, settings: dict[str, Any]) -> Path:
        return self.root / model.cache_dir_name / f"{task_key}-{digest(settings)[:16]}.json"

    def load(self, model: ModelRef, task_key: str, settings: dict[str, Any]) -> dict[str, Any] | None:
        """The cached result, or None; a file whose stored settings or model differ is not a hit."""
        path = self.path(model, task_key, settings)
        if not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: damaged cache entry ({exc}); delete it to re-run this task") from exc
        if (
            entry.get("settings") != json.loads(json.dumps(settings))
            or entry.get("identity") != model.identity
        ):
            return None
        return entry

    def store(self, model: ModelRef, task_key: str, settings: dict[str, Any], items: list[dict]) -> Path:
        """Write atomically (a temporary file renamed into place): a killed run leaves no half entry."""
        path = self.path(model, task_key, settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"model": model.name, "identity": model.identity, "settings": settings, "items": items}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entry, indent=1, default=str) + "\n")
        tmp.replace(path)
        return path
