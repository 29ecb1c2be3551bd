"""torchrun worker: launch/sft.py's ``main`` with test faults injected (mdlmpe_ds/training/faults.py).

Usage: ``sft_with_faults.py FAULTS_JSON <launch/sft.py arguments>``, where FAULTS_JSON holds
``Faults`` fields, e.g. ``{"nan_updates": [1, 3], "kill_in_save": 8, "probe_logits": "p.pt"}``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from mdlmpe_ds.runs import launching
from mdlmpe_ds.training.faults import Faults

SFT = Path(__file__).resolve().parents[2] / "launch" / "sft.py"


def faults_from(text: str) -> Faults:
    fields = json.loads(text)
    if "nan_updates" in fields:
        fields["nan_updates"] = frozenset(int(u) for u in fields["nan_updates"])
    if fields.get("probe_logits") is not None:
        fields["probe_logits"] = Path(fields["probe_logits"])
    return Faults(**fields)


def main() -> int:
    faults = faults_from(sys.argv[1])
    spec = importlib.util.spec_from_file_location("launch_sft", SFT)
    sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sft)
    return sft.main(sys.argv[2:], faults=faults)


if __name__ == "__main__":
    launching.exit_process(main())
