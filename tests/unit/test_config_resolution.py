"""The user's config is never changed in place: validation checks it, resolution returns a separate
local view, and a launcher's config function returns a new config each time."""

from __future__ import annotations

import copy

from mdlmpe_ds.config import recipes
from mdlmpe_ds.config.cli import build_config
from mdlmpe_ds.config.run import RunConfig
from mdlmpe_ds.hub.resolve import local_run


def test_validate_leaves_the_config_as_written():
    run = RunConfig()
    run.model.lora = "targets=q,r=4"  # a valid spec, not in its normal form
    run.model.model_name_or_path = "GSAI-ML/LLaDA-8B-Instruct"  # a hub id
    before = copy.deepcopy(run.to_dict())
    run.validate()
    assert run.to_dict() == before


def test_resolution_is_a_separate_view(monkeypatch):
    """local_run folds the dataset's config name (and would swap hub ids for snapshots) in its copy;
    the user's config still holds what was asked for."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = RunConfig()
    run.data.dataset, run.data.dataset_config = "HuggingFaceTB/smoltalk", "all"
    run.data.tokenizer = None
    before = copy.deepcopy(run.to_dict())
    local = local_run(run, config_only=True)
    assert run.to_dict() == before
    assert (local.data.dataset, local.data.dataset_config) == ("HuggingFaceTB/smoltalk:all", None)


def test_command_line_writes_the_dataset_config_once():
    run = build_config(None, ["--dataset", "HuggingFaceTB/smoltalk", "--dataset_config", "all"])
    assert (run.data.dataset, run.data.dataset_config) == ("HuggingFaceTB/smoltalk:all", None)


def test_launcher_configs_are_new_each_time():
    first = recipes.pretrain_config("llada-100m", 2)
    first.optim.lr = 1.0
    assert recipes.pretrain_config("llada-100m", 2).optim.lr == 1e-4
    sft = recipes.sft_config("llada-8b-sft")
    assert (
        sft.model.model_name_or_path == "GSAI-ML/LLaDA-8B-Base"
        and RunConfig().model.model_name_or_path is None
    )


def test_epochs_given_without_max_steps_decide_the_length(tmp_path):
    """max_steps has a default (40) that wins over epochs: an --epochs given alone was ignored
    without a word (40 updates, about 5 epochs of the probe's data). Given alone, from the command
    line or a config file, epochs now decide; given with max_steps, max_steps does; neither given,
    the default 40."""
    from mdlmpe_ds.config.cli import build_config

    assert build_config(None, ["--epochs", "1"]).train.max_steps is None
    assert build_config(None, ["--epochs", "1", "--max_steps", "7"]).train.max_steps == 7
    assert build_config(None, []).train.max_steps == 40
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  epochs: 2\n")
    from_file = build_config(str(config), [])
    assert from_file.train.max_steps is None and from_file.train.epochs == 2
    assert build_config(str(config), ["--max_steps", "5"]).train.max_steps == 5


def test_the_plan_warns_when_the_warmup_spans_the_run():
    """--warmup_steps 100 with --max_steps 8 was accepted without a word: the lr never reaches its
    peak. The plan printed at start says so, and says nothing when the warmup ends in time."""
    from types import SimpleNamespace

    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.runs.common import describe_plan

    model = SimpleNamespace(family="llada", position_encoding="mdlmpe", vocab_size=100)
    params = {"backbone": 1, "mdlmpe": 1, "total": 2}
    long_warmup = build_config(None, ["--warmup_steps", "100", "--max_steps", "8"])
    assert "warning: the warmup (100 updates) spans the whole run (8)" in describe_plan(
        long_warmup, model, 2, 8, 64, params
    )
    fine = build_config(None, ["--warmup_steps", "2", "--max_steps", "8"])
    assert "warning" not in describe_plan(fine, model, 2, 8, 64, params)
