"""--log_every says what it does: it thins only the MDLMPE statistics (gamma, |delta|), which gather
the MDLMPE weights on every rank; TensorBoard and metrics.jsonl get every other metric every update."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from mdlmpe_ds.config.run import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def _help(cls, name: str) -> str:
    return next(f.metadata["help"] for f in fields(cls) if f.name == name)


def test_log_every_help_names_what_it_thins():
    """The help said "log metrics every N updates" while loss, lr and the rest were written every
    update (only callbacks.MDLMPEStats reads the key)."""
    text = _help(TrainConfig, "log_every")
    assert "MDLMPE statistics" in text and "every update" in text
    assert "log metrics every N updates" not in text


def test_only_the_mdlmpe_statistics_read_log_every():
    """If another part of the loop starts reading log_every, the help above must say so."""
    readers = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "mdlmpe_ds").rglob("*.py")
        if re.search(r"(?<![\w\"'.])[A-Za-z_][\w.]*\.log_every\b", path.read_text())  # code, not "key" text
    )
    assert readers == ["mdlmpe_ds/training/callbacks.py"], readers
