"""Inputs and the one straight SFT run shared by the 2-process test modules (each launch costs
20-40 s on 2 cores, so the straight run every fault test compares against is made once)."""

from __future__ import annotations

import pytest
from sft_fixtures import make_chat, make_tokenizer
from sft_runs import BASE_ARGS, check, launch


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_data")
    return [
        "--tokenizer",
        str(make_tokenizer(root / "tokenizer")),
        "--dataset",
        str(make_chat(root / "chat.jsonl")),
    ]


@pytest.fixture(scope="session")
def sft_straight(tmp_path_factory, sft_data):
    """8 updates straight through (checkpoints at 4 and 8), with the engine's probe logits saved."""
    out = tmp_path_factory.mktemp("straight")
    probe = out / "probe.pt"
    proc = launch([*sft_data, *BASE_ARGS, "--output_dir", str(out)], faults={"probe_logits": str(probe)})
    check(proc, "straight run")
    return out
