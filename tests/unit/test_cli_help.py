"""The launchers' --help comes from the typed config: every key has its own text, SFT's help sets the
pretraining-only keys apart, and the command line is parsed once (``--preset=x`` as ``--preset x``)."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import fields
from pathlib import Path

import pytest

from mdlmpe_ds.config.run import SECTIONS
from mdlmpe_ds.pe.config import MDLMPEConfig

REPO = Path(__file__).resolve().parents[2]


def _launcher(name: str):
    spec = importlib.util.spec_from_file_location(f"launch_{name}_help", REPO / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _help(name: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        _launcher(name).main(["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _entries(out: str) -> dict[str, str]:
    """Option name -> its help text (the lines under its flags, whitespace joined)."""
    entries: dict[str, str] = {}
    current = None
    for line in out.splitlines():
        flags = re.match(r"^  (--\S+)", line)
        if flags:
            current = flags.group(1).split(",")[0].removeprefix("--")
            entries[current] = ""
        elif current is not None and line.startswith("      "):
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            current = None
    return entries


def _keys() -> list[tuple[str, str]]:
    """(bare or dotted flag name, its field's help) for every config key and MDLMPE method key."""
    out = [(f.name, f.metadata.get("help", "")) for cls in SECTIONS.values() for f in fields(cls)]
    return out + [(f"model.mdlmpe.{f.name}", f.metadata.get("help", "")) for f in fields(MDLMPEConfig)]


def test_every_key_has_its_own_help():
    keys = _keys()
    assert all(text.strip() for _, text in keys), [k for k, text in keys if not text.strip()]
    seen: dict[str, str] = {}
    for key, text in keys:
        assert text not in seen, f"{key} repeats the help of {seen.get(text)}"
        seen[text] = key


@pytest.mark.parametrize("launcher", ["sft", "pretrain"])
def test_help_prints_each_keys_own_text(launcher, capsys):
    entries = _entries(_help(launcher, capsys))
    for key, text in _keys():
        assert key in entries, f"--{key} missing from launch/{launcher}.py --help"
        shown = "".join(entries[key].split())  # argparse wraps lines, even inside a word
        assert "".join(text.split()) in shown, (key, entries[key])
    # the three keys that printed "-", another key's sentence and a cut text before
    assert "recompute the MDLMPE attention" in entries["recompute_mdlmpe_attention"]
    assert "launcher died" in entries["orphan_grace_s"] and "seconds" in entries["orphan_grace_s"]
    assert "1e-5 for a pretrained model" in entries["lr"]


def test_sft_help_sets_the_pretraining_keys_apart(capsys):
    out = _help("sft", capsys)
    apart = [k for cls in SECTIONS.values() for k in fields(cls) if k.metadata.get("pretrain_only")]
    assert {k.name for k in apart} >= {"text_split", "validation", "eval_every", "tokenizer_vocab"}
    for key in apart:
        line = next(i for i, ln in enumerate(out.splitlines()) if ln.startswith(f"  --{key.name} "))
        header = [ln for ln in out.splitlines()[:line] if ln and not ln.startswith(" ")][-1]
        assert "read by launch/pretrain.py only" in header, (key.name, header)
    assert "read by launch/pretrain.py only" not in _help("pretrain", capsys)


@pytest.mark.parametrize("spelling", [["--preset", "llada-100m"], ["--preset=llada-100m"]])
def test_compare_reads_the_preset_either_way(spelling, capsys):
    """--preset=x picks the recipe as --preset x does: compare adds none of its own defaults."""
    compare_pe = _launcher("compare_pe")
    assert compare_pe.main([*spelling, "--dry-run", "--seeds", "0", "--encodings", "rope"]) == 0
    out = capsys.readouterr().out
    assert "max_steps 200000" in out and "[compare] sets" not in out
