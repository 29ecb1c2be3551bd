"""Make a checkpoint directory loadable by ``transformers.AutoModel`` with ``trust_remote_code``.

``install_remote_code(dir, family)`` copies the self-contained ``modeling_mdlmpe.py`` (shipped in
this package) next to the weights and adds ``auto_map`` to ``config.json``; every other key of
config.json (the upstream LLaDA / Dream keys and the ``mdlmpe_ds`` block) is kept, so a RoPE-only
export still loads with the official modeling code as well.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MODELING_FILE = Path(__file__).with_name("modeling_mdlmpe.py")

AUTO_MAP = {
    "llada": {
        "AutoConfig": "modeling_mdlmpe.MDLMPELLaDAConfig",
        "AutoModel": "modeling_mdlmpe.MDLMPELLaDAModel",
        "AutoModelForMaskedLM": "modeling_mdlmpe.MDLMPELLaDAModel",
    },
    "dream": {
        "AutoConfig": "modeling_mdlmpe.MDLMPEDreamConfig",
        "AutoModel": "modeling_mdlmpe.MDLMPEDreamModel",
        "AutoModelForMaskedLM": "modeling_mdlmpe.MDLMPEDreamModel",
    },
}


def install_remote_code(directory: str | Path, family: str) -> Path:
    """Copy the modeling file into ``directory`` and point config.json's ``auto_map`` at it."""
    directory = Path(directory)
    config_file = directory / "config.json"
    if family not in AUTO_MAP:
        raise ValueError(f"unknown model family {family!r}; expected one of {sorted(AUTO_MAP)}")
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: write the checkpoint before installing the remote code")
    shutil.copy2(MODELING_FILE, directory / MODELING_FILE.name)
    with open(config_file, encoding="utf-8") as fh:
        raw = json.load(fh)
    raw["auto_map"] = dict(AUTO_MAP[family])
    with open(config_file, "w", encoding="utf-8") as fh:
        json.dump(raw, fh, indent=2)
    return directory / MODELING_FILE.name
