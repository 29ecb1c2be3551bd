"""Hub names in (issue 17): model / tokenizer hub ids resolve from a local Hugging Face cache with
HF_HUB_OFFLINE=1 (no network), everywhere a model or tokenizer is taken; a missing id fails with a
clear message; datasets take ``name:config`` / ``--dataset_config`` and ``--dataset_split``."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from mdlmpe_ds.config.cli import build_config
from mdlmpe_ds.hub.resolve import HubResolveError, local_run, resolve, split_dataset_name
from mdlmpe_ds.models import DiffusionLM, preset, save_pretrained

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "dist"))
from sft_fixtures import make_chat, make_tokenizer  # noqa: E402

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache under tmp_path, offline; ``add(repo_id, src_dir, refs)`` fills it with the
    standard layout models--org--name/snapshots/REV/... and refs/<ref> = REV."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def add(repo_id: str, src: Path, refs=("main",), rev: str = REV) -> Path:
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo / "snapshots" / rev
        shutil.copytree(src, snapshot, dirs_exist_ok=True)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        for ref in refs:
            (repo / "refs" / ref).write_text(rev)
        return snapshot

    return add


@pytest.fixture(scope="module")
def tiny_hub_model(tmp_path_factory):
    """A tiny LLaDA checkpoint directory with the fixture tokenizer's ids, tokenizer files inside."""
    root = tmp_path_factory.mktemp("hubmodel")
    tok = make_tokenizer(root / "tok")
    model_dir = root / "model"
    config = preset("llada-tiny", vocab_size=128, mask_token_id=3, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    save_pretrained(DiffusionLM(config), model_dir, config)
    for file in tok.iterdir():
        shutil.copy2(file, model_dir / file.name)
    return model_dir, make_chat(root / "chat.jsonl", rows=16)


def test_hub_id_resolves_from_the_local_cache(hub_cache, tiny_hub_model, tmp_path):
    model_dir, _ = tiny_hub_model
    snapshot = hub_cache("org/tiny-llada", model_dir, refs=("main", "v1"))
    assert resolve("org/tiny-llada") == snapshot
    assert resolve("org/tiny-llada", revision="v1") == snapshot
    assert resolve("org/tiny-llada@v1") == snapshot
    assert (resolve("org/tiny-llada") / "config.json").is_file()
    # A local directory is never taken for a hub id.
    assert resolve(str(model_dir)) == model_dir


def test_missing_hub_id_offline_fails_clearly(hub_cache):
    with pytest.raises(HubResolveError, match=r"'org/absent'.*HF_HUB_OFFLINE is set.*not in the local"):
        resolve("org/absent")
    with pytest.raises(HubResolveError, match=r"no such local file or directory, and not a hub id"):
        resolve("./no/such/dir")
    with pytest.raises(ValueError, match=r"model_name_or_path='./nowhere' is not a directory or hub id"):
        build_config(None, ["--model_name_or_path", "./nowhere"])


def test_sft_dry_run_takes_hub_ids_for_model_and_tokenizer(hub_cache, tiny_hub_model, tmp_path, capsys):
    from mdlmpe_ds.runs.sft_run import run_sft

    model_dir, chat = tiny_hub_model
    hub_cache("org/tiny-llada", model_dir)
    args = ["--model_name_or_path", "org/tiny-llada", "--tokenizer", "org/tiny-llada", "--dataset", str(chat)]
    run = build_config(
        None, [*args, "--max_len", "48", "--max_steps", "2", "--output_dir", str(tmp_path / "o")]
    )
    result = run_sft(run, str(REPO / "ds_configs" / "zero3.json"), resume=None, dry_run=True)
    assert result["total_updates"] == 2
    # The run config keeps what the user asked for: a checkpoint of it reproduces the run elsewhere.
    assert run.model.model_name_or_path == "org/tiny-llada" and run.data.tokenizer == "org/tiny-llada"


def _config_only(root: Path, family: str = "llada") -> Path:
    """A model directory holding config.json alone (no weights, no tokenizer): what a dry run reads."""
    from mdlmpe_ds.models.hf_config import hf_config_dict

    root.mkdir(parents=True, exist_ok=True)
    config = preset(f"{family}-8b") if family == "llada" else preset("dream-7b")
    (root / "config.json").write_text(json.dumps(hf_config_dict(config)))
    return root


def test_dry_run_plans_from_config_json_alone(hub_cache, tmp_path, caplog):
    """The hub cache holds only config.json: no weights, no tokenizer, and the dataset is a hub name
    that is never fetched. The plan has its units and, as a bf16 GPU plan, the CUDA allowance; an
    fp32 plan on this CPU machine is one for CPU ranks, without it."""
    import logging

    from mdlmpe_ds.runs.sft_run import run_sft

    hub_cache("GSAI-ML/LLaDA-8B-Instruct", _config_only(tmp_path / "cfg"))
    args = [
        "--model_name_or_path", "GSAI-ML/LLaDA-8B-Instruct", "--dataset", "allenai/tulu-3-sft-mixture",
        "--max_len", "2048", "--max_steps", "2000", "--warmup_ratio", "0.03",
        "--output_dir", str(tmp_path / "o"),
    ]  # fmt: skip
    ds = str(REPO / "ds_configs" / "zero3.json")
    with caplog.at_level(logging.INFO, logger="mdlmpe_ds"):
        gpu = run_sft(build_config(None, [*args, "--precision", "bf16"]), ds, dry_run=True)
        cpu = run_sft(build_config(None, [*args, "--precision", "fp32"]), ds, dry_run=True)
    assert gpu["params"]["backbone"] > 8e9 and gpu["total_updates"] == 2000
    plan = gpu["plan"]
    assert "vocabulary 126,464 tokens" in plan and "max_len 2048 tokens" in plan
    assert "allenai/tulu-3-sft-mixture (not read in a dry run)" in plan
    assert "warmup 60 updates" in plan and "CUDA context" in plan  # 3% of 2,000
    assert "memory plan per GPU (estimate)" in plan
    assert "CUDA context" not in cpu["plan"] and "memory plan per CPU rank (estimate)" in cpu["plan"]
    assert not (tmp_path / "o" / "data_cache").exists()  # no data was tokenised


def test_recipe_dry_run_needs_only_the_configs(hub_cache, tmp_path):
    """--recipe llada-8b-sft names hub ids for model, tokenizer and data: its dry run needs nothing
    but the model's config.json in the cache."""
    from mdlmpe_ds.config import recipes
    from mdlmpe_ds.runs.sft_run import run_sft

    hub_cache("GSAI-ML/LLaDA-8B-Base", _config_only(tmp_path / "cfg"))
    defaults = recipes.get("llada-8b-sft", "sft").defaults()
    run = build_config(None, ["--output_dir", str(tmp_path / "o"), "--precision", "bf16"], defaults=defaults)
    result = run_sft(run, str(REPO / "ds_configs" / "zero3.json"), dry_run=True)
    assert "GSAI-ML/LLaDA-8B-Base" in result["plan"] and result["params"]["backbone"] > 8e9


def test_a_model_directory_without_tokenizer_files_is_named_as_such(tmp_path):
    from mdlmpe_ds.runs.sft_run import run_sft

    model = _config_only(tmp_path / "model")
    run = build_config(None, ["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o")])
    with pytest.raises(FileNotFoundError, match=r"model: no tokenizer files .*pass --tokenizer"):
        run_sft(run, str(REPO / "ds_configs" / "zero3.json"))


def test_offline_advice_names_the_hf_command(hub_cache):
    with pytest.raises(HubResolveError, match=r"hf download org/absent --revision v2") as err:
        resolve("org/absent", revision="v2")
    assert "huggingface-cli" not in str(err.value)


def test_run_config_keeps_hub_ids_and_records_them(hub_cache, tiny_hub_model, tmp_path):
    """local_run gives the snapshot folders to build from and leaves the run config as written; the
    tokenizer a checkpoint records is the hub id, pinned by the model's revision when it is the
    model's own repo."""
    from mdlmpe_ds.hub.resolve import local_run, recorded_tokenizer

    model_dir, _ = tiny_hub_model
    snapshot = hub_cache("org/tiny-llada", model_dir, refs=("main", "v1"))
    run = build_config(None, ["--model_name_or_path", "org/tiny-llada", "--revision", "v1"])
    local = local_run(run)
    assert local.model.model_name_or_path == str(snapshot)
    assert run.model.model_name_or_path == "org/tiny-llada" and run.model.revision == "v1"
    assert recorded_tokenizer(run, snapshot) == "org/tiny-llada@v1"
    mine = build_config(None, ["--tokenizer", str(model_dir)])
    assert recorded_tokenizer(mine, model_dir) == str(model_dir)


def test_inference_loaders_take_hub_ids(hub_cache, tiny_hub_model):
    from mdlmpe_ds.evaluation.loading import load_model, load_tokenizer

    model_dir, _ = tiny_hub_model
    snapshot = hub_cache("org/tiny-llada", model_dir)
    model, tok_dir = load_model("org/tiny-llada")
    assert Path(tok_dir) == snapshot and model.config.vocab_size == 128
    assert load_tokenizer("org/tiny-llada").mask_token == "<|mask|>"


def _configured_dataset(root: Path) -> Path:
    """A dataset folder with two config names (like HuggingFaceTB/smoltalk's "all")."""
    rows = {
        "all": [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
        * 3,
        "tiny": [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
    }
    for name, data in rows.items():
        (root / name).mkdir(parents=True)
        for split in ("train", "test"):
            lines = data if split == "train" else data[:1]
            (root / name / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cards = "".join(
        f"- config_name: {name}\n  data_files:\n"
        f"  - split: train\n    path: {name}/train.jsonl\n  - split: test\n    path: {name}/test.jsonl\n"
        for name in rows
    )
    (root / "README.md").write_text(f"---\nconfigs:\n{cards}---\n")
    return root


def test_dataset_config_name_and_split(tmp_path, monkeypatch):
    from mdlmpe_ds.data.sft_rows import load_sft_rows

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = _configured_dataset(tmp_path / "smoltalk-like")
    assert len(load_sft_rows(f"{data}:all")) == 3
    assert len(load_sft_rows(f"{data}:tiny")) == 1
    assert len(load_sft_rows(f"{data}:all", split="test")) == 1
    run = build_config(None, ["--dataset", str(data), "--dataset_config", "all", "--dataset_split", "test"])
    assert run.data.split == "test"
    local_run(run)
    assert run.data.dataset == f"{data}:all"
    assert split_dataset_name("HuggingFaceTB/smoltalk:all") == ("HuggingFaceTB/smoltalk", "all")
    assert split_dataset_name("allenai/tulu-3-sft-mixture") == ("allenai/tulu-3-sft-mixture", None)
    with pytest.raises(ValueError, match="names config 'all' but dataset_config is 'tiny'"):
        split_dataset_name("x/y:all", "tiny")


def test_resolution_names_each_key_that_resolved_and_its_commit(hub_cache, tiny_hub_model):
    """What a checkpoint records beside the run as written: the snapshot the hub id resolved to (with
    its commit) and the tokenizer directory read; a run of local paths resolves nothing."""
    from mdlmpe_ds.hub.resolve import resolution

    model_dir, chat = tiny_hub_model
    snapshot = hub_cache("org/tiny-llada", model_dir, refs=("main", "v1"))
    run = build_config(
        None, ["--model_name_or_path", "org/tiny-llada", "--revision", "v1", "--dataset", str(chat)]
    )
    assert resolution(run, local_run(run), snapshot, str(chat)) == {
        "model.model_name_or_path": {"value": str(snapshot), "commit": REV},
        "tokenizer": {"value": str(snapshot), "commit": REV},
    }
    assert run.model.model_name_or_path == "org/tiny-llada"
    mine = build_config(None, ["--model_name_or_path", str(model_dir), "--dataset", str(chat)])
    assert resolution(mine, local_run(mine), model_dir, str(chat)) == {}
    demo = build_config(None, ["--dataset", "org/chat", "--dataset_config", "all"])
    assert resolution(demo, local_run(demo), None, "/data/chat.jsonl") == {
        "data.dataset": {"value": "/data/chat.jsonl", "commit": None}
    }
    assert demo.data.dataset == "org/chat:all"  # folded by the command line: the name as written
