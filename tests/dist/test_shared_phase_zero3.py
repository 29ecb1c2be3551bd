"""phase_mlp="shared" under the real 2-process ZeRO-3 engine: the one phase MLP every layer reads is
gathered by each layer that reads it, trains, and a run resumed from its checkpoint in new processes
repeats the straight run bit for bit.

The shipped zero3.json keeps parameters under 100k elements whole on every rank ("persistent"), the
phase MLP among them, so gathering would never be exercised: this run uses that config with
``stage3_param_persistence_threshold`` 0, which partitions every parameter. Then a phase weight a
layer reads without having gathered it is an empty tensor (a crash), and one gathered for the
forward but not for the backward loses its gradient.

Two launches (~30-40 s each on 2 cores): the interrupted run is the straight run's own update-2
checkpoint copied into a fresh output_dir and resumed there (as test_sft_resume's bf16 test does).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sft_runs import BASE_ARGS, DS_CONFIG, check, launch, metrics

pytestmark = pytest.mark.dist

UPDATES = 4
KEYS = (
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "mdlmpe/active_head_fraction",
    "mdlmpe/delta_abs_mean/shared",
)


@pytest.fixture
def data(sft_data):  # tests/dist/conftest.py
    return sft_data


def _partitioning_config(path: Path) -> Path:
    """The shipped zero3.json with every parameter partitioned (no persistent small parameters)."""
    config = json.loads(DS_CONFIG.read_text())
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path.write_text(json.dumps(config, indent=2))
    return path


def test_shared_phase_mlp_trains_and_resumes_bitwise_under_partitioned_zero3(data, tmp_path):
    ds_config = _partitioning_config(tmp_path / "zero3_partition_all.json")
    args = [*data, *BASE_ARGS, "--max_steps", str(UPDATES), "--save_every", "2"]
    args += ["--model.mdlmpe.phase_mlp", "shared"]
    full, out = tmp_path / "straight", tmp_path / "resumed"
    check(launch([*args, "--output_dir", str(full)], ds_config=ds_config), "shared-phase straight run")
    half = "step_000002"
    shutil.copytree(full / "checkpoints" / half, out / "checkpoints" / half)
    resumed = launch([*args, "--output_dir", str(out), "--resume", "auto"], ds_config=ds_config)
    check(resumed, "shared-phase resumed run")
    assert half in resumed.stdout and "resumed from" in resumed.stdout
    # The model the run trained has one phase MLP (its checkpoint config says so; one |delta| curve).
    saved = json.loads((full / "checkpoints" / f"step_{UPDATES:06d}" / "config.json").read_text())
    assert saved["model_config"]["mdlmpe"]["phase_mlp"] == "shared"
    straight, again = metrics(full), metrics(out, first=3)
    assert not any(key.startswith("mdlmpe/delta_abs_mean/layer") for key in straight[UPDATES])
    # The shared MLP was trained through every layer's gathered weights (W2 starts at zero).
    assert straight[UPDATES]["mdlmpe/delta_abs_mean/shared"] > 1e-4
    assert straight[UPDATES]["mdlmpe/active_head_fraction"] > 0
    for step in range(3, UPDATES + 1):
        for key in KEYS:
            # On CPU with gloo the resumed run repeats the straight run bit for bit (test_sft_resume).
            assert again[step][key] == straight[step][key], (step, key, straight[step][key], again[step][key])
