"""Training config parsing/validation, ds-config batch arithmetic, checkpoint discovery, and the
fail-fast paths of `launch/sft.py` (dry runs: no process group, the model on the meta device)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mdlmpe_ds.config.cli import build_config, from_mapping
from mdlmpe_ds.distributed.engine import prepare_ds_config, warmup_cosine
from mdlmpe_ds.pe.config import FOLLOW_MODEL, MDLMPEConfig
from mdlmpe_ds.training import checkpoint as ckpt
from mdlmpe_ds.training import checkpointer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "dist"))
from sft_fixtures import make_chat, make_tokenizer  # noqa: E402


@pytest.fixture(autouse=True)
def _logging():
    """The run's notes (the plan, warnings) are log records, as the launchers configure them."""
    from mdlmpe_ds.training.log_setup import configure

    configure(rank=0, force=True)  # whatever an earlier test's entry point set


# ------------------------------------------------------------------ config
def test_cli_and_file_overrides(tmp_path):
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps({"optim": {"lr": 2e-5}, "train.grad_accum": 4, "max_len": 256}))
    run = build_config(
        str(cfg_file), ["--lr", "1e-5", "--model.mdlmpe", '{"tau_max": 0.2}', "--head_schedule=false"]
    )
    assert run.optim.lr == 1e-5  # command line beats the file
    assert run.train.grad_accum == 4 and run.data.max_len == 256
    assert (
        run.model.mdlmpe == MDLMPEConfig(max_seq_len=FOLLOW_MODEL, tau_max=0.2)
        and run.train.head_schedule is False
    )
    assert run.mdlmpe_config() == MDLMPEConfig(max_seq_len=256, tau_max=0.2)  # L_ref = data.max_len
    assert from_mapping(run.to_dict()).to_dict() == run.to_dict()


def test_mdlmpe_method_keys_are_typed():
    """model.mdlmpe is an MDLMPEConfig: one key at a time takes its field's type, a JSON object
    merges into the keys set before, and a bad value or unknown key names the key."""
    run = build_config(
        None,
        [
            "--model.mdlmpe.use_gaussian",
            "false",
            "--model.mdlmpe",
            '{"rho": 0.5}',
            "--model.mdlmpe.phase_hidden",
            "8",
        ],
    )
    assert (run.model.mdlmpe.use_gaussian, run.model.mdlmpe.rho, run.model.mdlmpe.phase_hidden) == (
        False,
        0.5,
        8,
    )
    with pytest.raises(ValueError, match=r"bad value 'yes please' for model\.mdlmpe\.use_embedding"):
        build_config(None, ["--model.mdlmpe.use_embedding", "yes please"])
    with pytest.raises(ValueError, match=r"model\.mdlmpe: mdlmpe config: unknown keys \['tau'\]"):
        build_config(None, ["--model.mdlmpe", '{"tau": 0.1}'])
    with pytest.raises(ValueError, match=r"model\.mdlmpe: mdlmpe config: coordinate='cosine' must be one of"):
        build_config(None, ["--model.mdlmpe.coordinate", "cosine"])


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError, match=r"unknown key 'learning_rate'.*optim\.lr"):
        build_config(None, ["--learning_rate", "1"])


def test_bad_values_are_named():
    with pytest.raises(ValueError, match=r"train\.micro_batch_size=0"):
        build_config(None, ["--micro_batch_size", "0"])
    with pytest.raises(ValueError, match=r"bad value 'x' for optim\.lr"):
        build_config(None, ["--lr", "x"])
    with pytest.raises(ValueError, match=r"train\.loss='bert'"):
        build_config(None, ["--loss", "bert"])


def test_warmup_cosine_shape():
    f = warmup_cosine(warmup=2, total=10, cosine=True, min_ratio=0.1)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(10) == pytest.approx(0.1)
    assert all(f(i) >= f(i + 1) for i in range(2, 10))


# ------------------------------------------------------------------ ds config arithmetic
def test_ds_config_batch_mismatch_names_both(tmp_path):
    run = build_config(None, ["--micro_batch_size", "8"])
    # The shipped config leaves the batch arithmetic to the training config ("auto").
    assert prepare_ds_config(REPO / "ds_configs" / "zero3.json", run, world=2)["train_batch_size"] == 16
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}))
    with pytest.raises(ValueError, match=r"fixed\.json sets train_micro_batch_size_per_gpu=4 .* = 8"):
        prepare_ds_config(fixed, run, world=2)
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 16, "zero_optimization": {"stage": 3}}))
    with pytest.raises(ValueError, match=r"train_batch_size=16 .* world size 2 = 8"):
        prepare_ds_config(bad, build_config(None, []), world=2)


def test_ds_config_auto_filled_and_cpu_traps():
    run = build_config(None, ["--micro_batch_size", "3", "--grad_accum", "2"])
    ds = prepare_ds_config(REPO / "ds_configs" / "zero3_cpu_test.json", run, world=2)
    assert (
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
        ds["train_batch_size"],
    ) == (3, 2, 12)
    assert (
        ds["optimizer"]["params"]["lr"] == run.lr == 3e-3 and ds["optimizer"]["params"]["torch_adam"] is True
    )
    ds = prepare_ds_config(REPO / "ds_configs" / "zero3.json", build_config(None, []), world=2)
    assert ds["bf16"]["enabled"] is False  # precision auto: fp32 on a CPU-only machine


@pytest.mark.parametrize("name", ["zero3.json", "zero3_offload.json"])
def test_shipped_ds_configs_leave_the_batch_to_the_training_config(name):
    """The GPU configs say "auto" for the per-GPU micro-batch and the accumulation: the training
    config decides (e.g. micro-batch 1 at L = 4096 on an 8B model), no second place to edit."""
    ds = json.loads((REPO / "ds_configs" / name).read_text())
    assert ds["train_micro_batch_size_per_gpu"] == ds["gradient_accumulation_steps"] == "auto"


def test_shipped_zero3_with_default_and_other_batches():
    default = prepare_ds_config(REPO / "ds_configs" / "zero3.json", build_config(None, []), world=2)
    # the defaults give what the config used to hard-code: micro-batch 4, no accumulation
    assert (default["train_micro_batch_size_per_gpu"], default["gradient_accumulation_steps"]) == (4, 1)
    assert default["train_batch_size"] == 8
    run = build_config(None, ["--micro_batch_size", "1", "--grad_accum", "8"])
    ds = prepare_ds_config(REPO / "ds_configs" / "zero3.json", run, world=8)
    assert (
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
        ds["train_batch_size"],
    ) == (
        1,
        8,
        64,
    )


# ------------------------------------------------------------------ checkpoint discovery
def test_resume_auto_ignores_incomplete(tmp_path):
    for step, complete in ((2, True), (4, True), (6, False)):
        d = ckpt.step_dir(tmp_path, step)
        d.mkdir(parents=True)
        if complete:
            checkpointer.finalize(d.rename(d.with_name(d.name + ckpt.STAGING)), d)
    (ckpt.checkpoints_root(tmp_path) / "latest").write_text("step_000006\n")  # stale hint
    assert ckpt.resolve_resume("auto", tmp_path).name == "step_000004"
    with pytest.raises(ValueError, match="no COMPLETE marker"):
        ckpt.resolve_resume(str(ckpt.step_dir(tmp_path, 6)), tmp_path)
    removed = checkpointer.prune(tmp_path, keep_last=1, keep=ckpt.step_dir(tmp_path, 4))
    assert sorted(p.name for p in removed) == ["step_000002"]  # incomplete step 6 is newer: kept
    assert ckpt.resolve_resume("auto", tmp_path).name == "step_000004"


# ------------------------------------------------------------------ fail fast (dry runs)
@pytest.fixture(scope="module")
def fixture_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return make_tokenizer(root / "tok"), make_chat(root / "chat.jsonl", rows=16)


def _dry(args, tmp_path):
    from mdlmpe_ds.runs.sft_run import run_sft

    run = build_config(None, [*args, "--output_dir", str(tmp_path / "out")])
    return run_sft(run, str(REPO / "ds_configs" / "zero3.json"), resume=None, dry_run=True)


def _data(args, tmp_path):
    """The data half of an SFT run (a dry run reads no data): tokenizer, tokenised data, collator."""
    from mdlmpe_ds.runs.sft_run import load_data, sft_inputs

    run = build_config(None, [*args, "--output_dir", str(tmp_path / "out")])
    return load_data(run, sft_inputs(run))


def test_dry_run_plan(fixture_data, tmp_path, capsys):
    tok, chat = fixture_data
    result = _dry(
        ["--tokenizer", str(tok), "--dataset", str(chat), "--max_len", "48", "--max_steps", "5"], tmp_path
    )
    assert result["total_updates"] == 5 and result["params"]["mdlmpe"] > 0
    assert "sequences per update" in capsys.readouterr().out


def test_a_preset_dry_run_says_its_vocabulary_is_the_presets(fixture_data, tmp_path, caplog):
    """sft.py --dry-run planned the demo with the preset's 512 tokens (0.17 M parameters) while the
    real run built the tokenizer's 151,680 (19.5 M), and did not say so."""
    tok, chat = fixture_data
    args = ["--tokenizer", str(tok), "--dataset", str(chat), "--max_len", "48", "--max_steps", "5"]
    with caplog.at_level("WARNING", logger="mdlmpe_ds.runs.common"):
        _dry(args, tmp_path)
    assert "the plan uses the llada-tiny preset's own vocabulary" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mdlmpe_ds.runs.common"):
        _dry([*args, "--vocab_size", "1024"], tmp_path / "sized")
    assert "own vocabulary" not in caplog.text


def test_pad_to_multiple_of_reaches_the_collator_and_compile_warns_without_it(
    fixture_data, tmp_path, capsys, monkeypatch
):
    """The compiled attention compiles once per batch width: without a width multiple the run says
    so; with one, the collator rounds widths. Bad values and cutoff combinations are named."""
    from mdlmpe_ds.runs import sft_run as sft  # where the run builds its collator

    made = []

    def recording_collator(*args, **kwargs):
        made.append(sft_collator(*args, **kwargs))
        return made[-1]

    sft_collator = sft.SFTCollator
    monkeypatch.setattr(sft, "SFTCollator", recording_collator)
    tok, chat = fixture_data
    base = ["--tokenizer", str(tok), "--dataset", str(chat), "--max_len", "48", "--max_steps", "2"]
    compiled = [*base, "--attention.compile", "true"]
    _data(compiled, tmp_path)
    assert "set data.pad_to_multiple_of" in capsys.readouterr().out
    _data([*compiled, "--pad_to_multiple_of", "16"], tmp_path)
    assert "set data.pad_to_multiple_of" not in capsys.readouterr().out
    assert made[-1].pad_to_multiple_of == 16
    _data(base, tmp_path)
    assert "set data.pad_to_multiple_of" not in capsys.readouterr().out  # eager: any width is fine
    with pytest.raises(ValueError, match=r"data\.pad_to_multiple_of=0"):
        build_config(None, ["--pad_to_multiple_of", "0"])
    with pytest.raises(ValueError, match=r"data\.pad_to_multiple_of=16 cannot be combined"):
        build_config(None, ["--pad_to_multiple_of", "16", "--perbatch_cutoff", "random_with_input_pad"])


def test_sft_data_cached_under_the_output_dir(fixture_data, tmp_path, caplog):
    """run_sft tokenises into <output_dir>/data_cache: a restart or resume loads it instead."""
    import logging

    tok, chat = fixture_data
    args = ["--tokenizer", str(tok), "--dataset", str(chat), "--max_len", "48", "--max_steps", "2"]
    _data(args, tmp_path)
    assert len(list((tmp_path / "out" / "data_cache").glob("sft-*.npz"))) == 1
    with caplog.at_level(logging.INFO, logger="mdlmpe_ds.data.sft_encode"):
        _data(args, tmp_path)
    assert "loaded from cache" in caplog.text


def test_setup_timeout_is_its_own_setting():
    assert build_config(None, []).train.setup_timeout_min == 60.0
    assert build_config(None, ["--setup_timeout_min", "5"]).train.setup_timeout_min == 5.0
    with pytest.raises(ValueError, match=r"train\.setup_timeout_min=0"):
        build_config(None, ["--setup_timeout_min", "0"])


def test_missing_dataset_file(fixture_data, tmp_path):
    tok, _ = fixture_data
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        _data(["--tokenizer", str(tok), "--dataset", str(tmp_path / "nope.jsonl")], tmp_path)


def test_malformed_row_names_file_and_row(fixture_data, tmp_path):
    tok, chat = fixture_data
    bad = tmp_path / "bad.jsonl"
    lines = chat.read_text().splitlines()
    lines[3] = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]}
    )
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl.*row 3"):
        _data(["--tokenizer", str(tok), "--dataset", str(bad)], tmp_path)


def test_checkpoint_from_another_model(fixture_data, tmp_path):
    from mdlmpe_ds.runs.sft_run import run_sft

    tok, chat = fixture_data
    out = tmp_path / "out"
    d = ckpt.step_dir(out, 4)
    d.mkdir(parents=True)
    other = {"family": "dream", "hidden_size": 999}
    ckpt.write_meta(d, 4, 2, {}, other, "")
    checkpointer.finalize(d.rename(d.with_name(d.name + ckpt.STAGING)), d)
    run = build_config(None, ["--tokenizer", str(tok), "--dataset", str(chat), "--output_dir", str(out)])
    with pytest.raises(ValueError, match=r"(?s)from another model.*hidden_size: checkpoint 999"):
        run_sft(run, str(REPO / "ds_configs" / "zero3.json"), resume="auto", dry_run=True)


def test_pretrained_directory_takes_the_runs_max_len_and_encoding(tmp_path, caplog):
    """A real LLaDA/Dream directory (max length 4096 / 131072) fine-tuned at data.max_len: the model
    config and MDLMPE's L_ref must both follow the run, or validation rejects every real checkpoint."""
    import dataclasses

    from mdlmpe_ds.models.hf_io import save_pretrained
    from mdlmpe_ds.models.presets import preset
    from mdlmpe_ds.models.transformer import DiffusionLM
    from mdlmpe_ds.runs.common import model_config_for

    tiny = preset("llada-tiny")
    base = dataclasses.replace(
        tiny, max_seq_len=4096, mdlmpe=dataclasses.replace(tiny.mdlmpe, max_seq_len=4096)
    )
    save_pretrained(DiffusionLM(base), tmp_path, base)
    run = build_config(
        None, ["--model_name_or_path", str(tmp_path), "--max_len", "64", "--position_encoding", "mdlmpe"]
    )
    with caplog.at_level("WARNING", logger="mdlmpe_ds.runs.common"):
        cfg = model_config_for(run, tokenizer=None)
    assert cfg.max_seq_len == 64 and cfg.mdlmpe.max_seq_len == 64
    assert cfg.position_encoding == "mdlmpe" and cfg.family == "llada"
    # said at start: the export's max length is the run's (a probe found it only in config.json)
    assert "max length is --max_len 64, not" in caplog.text and "refuse longer inputs" in caplog.text
    caplog.clear()
    longer = build_config(None, ["--model_name_or_path", str(tmp_path), "--max_len", "8192"])
    with caplog.at_level("WARNING", logger="mdlmpe_ds.runs.common"):
        model_config_for(longer, tokenizer=None)
    assert "8192 is past the 4096 positions the base was trained on" in caplog.text
    caplog.clear()
    same = build_config(None, ["--model_name_or_path", str(tmp_path), "--max_len", "4096"])
    with caplog.at_level("WARNING", logger="mdlmpe_ds.runs.common"):
        model_config_for(same, tokenizer=None)
    assert not caplog.text


def test_resume_may_change_how_steps_are_computed_not_the_model(tmp_path):
    """Checkpointing switches are run-time choices, not in the model config: an older checkpoint
    that stored them (and, in its MDLMPE block, the attention-implementation keys it stored then)
    resumes; any model key, MDLMPE's method keys included, differs."""
    old = {
        "tau_max": 0.25,
        "backend": "blocked",
        "block_size": 128,
        "compile": False,
        "checkpoint_blocks": True,
    }
    stored = {
        "hidden_size": 64,
        "gradient_checkpointing": True,
        "recompute_mdlmpe_attention": False,
        "mdlmpe": old,
    }
    saved = ckpt.SavedRun(tmp_path, 4, 2, {}, stored)
    model = {"hidden_size": 64, "mdlmpe": {"tau_max": 0.25}}
    ckpt.check_same_model(saved, model)
    with pytest.raises(ValueError, match=r"hidden_size: checkpoint 64 vs run 32"):
        ckpt.check_same_model(saved, {**model, "hidden_size": 32})
    with pytest.raises(ValueError, match=r"mdlmpe: checkpoint .*'tau_max': 0.25.* vs run .*'tau_max': 0.5"):
        ckpt.check_same_model(saved, {**model, "mdlmpe": {"tau_max": 0.5}})


def test_checkpointing_is_passed_at_build_not_a_model_key(tmp_path, caplog):
    """The run's model.gradient_checkpointing / recompute_mdlmpe_attention become a Recompute given
    to the model at build; a model config has neither key (to_dict, hence checkpoints and exports),
    a new config naming one is an error saying where it went, and a stored one (an older checkpoint
    or export) loads without them, logged at debug level."""
    import logging

    from mdlmpe_ds.models import DiffusionLM, ModelConfig, Recompute, preset, save_pretrained
    from mdlmpe_ds.runs.common import model_config_for

    tiny = preset("llada-tiny", position_encoding="mdlmpe")
    save_pretrained(DiffusionLM(tiny), tmp_path, tiny)
    args = ["--model_name_or_path", str(tmp_path), "--max_len", str(tiny.max_seq_len)]
    run = build_config(None, args)
    assert run.recompute() == Recompute(layers=True, mdlmpe_attention=False)  # the defaults
    flipped = build_config(
        None, [*args, "--gradient_checkpointing", "false", "--recompute_mdlmpe_attention", "true"]
    )
    assert flipped.recompute() == Recompute(layers=False, mdlmpe_attention=True)
    cfg = model_config_for(run, tokenizer=None)
    assert model_config_for(flipped, tokenizer=None) == cfg == tiny  # the same model either way
    assert not {"gradient_checkpointing", "recompute_mdlmpe_attention"} & set(cfg.to_dict())
    for key, field_name in (
        ("gradient_checkpointing", "layers"),
        ("recompute_mdlmpe_attention", "mdlmpe_attention"),
    ):
        pattern = rf"'{key}' is not a model key any more.*--model\.{key}.*Recompute\({field_name}="
        with pytest.raises(ValueError, match=pattern):
            preset("llada-tiny", **{key: True})
        with pytest.raises(ValueError, match=pattern):
            ModelConfig.from_dict({**cfg.to_dict(), key: True})
        with caplog.at_level(logging.DEBUG, logger="mdlmpe_ds.models.config"):
            assert ModelConfig.from_dict({**cfg.to_dict(), key: True}, stored=True) == cfg
        assert f"dropped the run-time keys ['{key}']" in caplog.text
    model = DiffusionLM(cfg, recompute=Recompute(layers=True))
    assert model.recompute.layers and DiffusionLM(cfg).recompute == Recompute()
    with pytest.raises(ValueError, match=r"recompute: layers='yes' must be true or false"):
        DiffusionLM(cfg, recompute=Recompute(layers="yes"))


@pytest.mark.parametrize(
    ("key", "value", "where"),
    [
        ("backend", "reference", "attention.backend"),
        ("block_size", 64, "attention.query_block"),
        ("triton_tile", 16, "attention.tile"),
        ("compile", True, "attention.compile"),
    ],
)
def test_attention_keys_in_a_model_config_say_where_they_moved(tmp_path, key, value, where):
    """How the attention runs is the run's `attention` section: the old MDLMPE keys are an error
    naming the key and its new place, on the command line, in a YAML file, and in a model config."""
    from mdlmpe_ds.models import ModelConfig, preset

    pattern = rf"'{key}' is not a model key any more.*{where}"
    with pytest.raises(ValueError, match=rf"model\.mdlmpe: .*{pattern}"):
        build_config(None, ["--model.mdlmpe", json.dumps({key: value})])
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(f"model:\n  mdlmpe:\n    {key}: {json.dumps(value)}\n")
    with pytest.raises(ValueError, match=pattern):
        build_config(str(yaml_file), [])
    with pytest.raises(ValueError, match=pattern):
        preset("llada-tiny", position_encoding="mdlmpe", mdlmpe={key: value})
    stored = preset("llada-tiny", position_encoding="mdlmpe").to_dict()
    stored["mdlmpe"][key] = value
    with pytest.raises(ValueError, match=pattern):
        ModelConfig.from_dict(stored)
    # A config an older checkpoint or export stored: the key is dropped, the model is the same.
    assert ModelConfig.from_dict(stored, stored=True) == preset("llada-tiny", position_encoding="mdlmpe")


def test_attention_section_is_the_run_time_choice():
    from mdlmpe_ds.attention import AttentionImpl

    run = build_config(None, ["--attention.backend", "reference", "--query_block", "32", "--compile", "true"])
    assert run.attention == AttentionImpl(backend="reference", query_block=32, tile=None, compile=True)
    assert run.to_dict()["attention"]["query_block"] == 32 and "query_block" not in json.dumps(
        run.to_dict()["model"]
    )
    with pytest.raises(ValueError, match=r"attention: tile=48 must be None \(per GPU\) or a power of 2"):
        build_config(None, ["--attention.tile", "48"])
    with pytest.raises(ValueError, match="'checkpoint_blocks' is gone"):
        build_config(None, ["--model.mdlmpe", '{"checkpoint_blocks": false}'])
    assert build_config(None, ["--block_size", "4"]).train.block_size == 4  # still the SFT block
