"""Every spelling of a training key the command line took before jsonargparse still works."""

from __future__ import annotations

import pytest

from mdlmpe_ds.config import cli, recipes
from mdlmpe_ds.config.cli import build_config


@pytest.mark.parametrize(
    "tokens",
    [
        ["--lr", "1e-5"],
        ["--optim.lr", "1e-5"],
        ["--lr=1e-5"],
        ["--optim.lr=1e-5"],
    ],
)
def test_bare_dotted_and_equals(tokens):
    assert build_config(None, tokens).optim.lr == 1e-5


def test_aliases_and_switch_and_null_words():
    run = build_config(None, ["--dataset_split", "test", "--head_schedule", "0", "--compile", "On"])
    assert (run.data.split, run.train.head_schedule, run.attention.compile) == ("test", False, True)
    run = build_config(
        None, ["--max_steps", "none", "--epochs", "2", "--tokenizer", "None", "--stop_at=null"]
    )
    assert (run.train.max_steps, run.data.tokenizer, run.train.stop_at) == (None, None, None)
    assert build_config(None, ["--model.mdlmpe.tau_max", "0.1"]).model.mdlmpe.tau_max == 0.1
    assert build_config(None, ["--mdlmpe", '{"tau_max": 0.1}']).model.mdlmpe.tau_max == 0.1


def test_run_flags_sit_in_the_same_parser():
    """The DeepSpeed launcher's --local_rank / --local-rank and --deepspeed, and the run flags."""
    parser = cli.config_parser(None, recipes.sft_config(), "sft", ["llada-8b-sft"])
    argv = [
        "--local_rank=0",
        "--deepspeed",
        "x.json",
        "--recipe=llada-8b-sft",
        "--dry-run",
        "--preset=llada-100m",
    ]
    flags, overrides = cli.parse(
        parser, [*argv, "--local-rank", "1", "--config", "c.yaml", "--resume", "auto"]
    )
    assert (flags["local_rank"], flags["deepspeed"], flags["recipe"], flags["dry_run"]) == (
        1,
        "x.json",
        "llada-8b-sft",
        True,
    )
    assert (flags["config"], flags["resume"]) == ("c.yaml", "auto")
    assert overrides == {"model.preset": "llada-100m"}
    flags, _ = cli.parse(parser, ["--preset", "llada-100m", "--dry_run", "--allow-config-change", "lr,seed"])
    assert flags["dry_run"] and flags["allow_config_change"] == ["lr,seed"]


def test_a_known_key_spelled_with_dashes_gets_its_spelling():
    """--max-steps gave "unrecognized arguments" with no hint; an unknown key still lists the valid ones."""
    from mdlmpe_ds.config.cli import build_config

    with pytest.raises(ValueError, match=r"unknown flag --max-steps; write --max_steps"):
        build_config(None, ["--max-steps", "3"])
    with pytest.raises(
        ValueError, match=r"unknown key 'max_stepz' \(did you mean max_steps\?\); valid keys are"
    ):
        build_config(None, ["--max_stepz", "3"])


def test_sft_names_the_pretraining_keys_it_ignores():
    """SFT accepts --validation and --eval_every and ignores them: a user who gave them is told."""
    from mdlmpe_ds.config.cli import pretrain_only_keys

    given = ["data.validation", "train.eval_every", "optim.lr", "train.max_steps"]
    assert pretrain_only_keys(given) == ["data.validation", "train.eval_every"]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.yaml", "lr: 0.5\noptim:\n  lr: 0.001\n", r"optim.lr is given twice \(as 'lr' and 'optim.lr'\)"),
        (
            "b.yaml",
            "train:\n  max_steps: 5\ntrain:\n  seed: 3\n",
            r"not valid YAML: key 'train' is given twice",
        ),
        ("c.json", '{"optim": {"lr": 0.1}, "optim": {"lr": 0.2}}', r"key 'optim' is given twice"),
    ],
)
def test_a_config_key_given_twice_is_refused(tmp_path, name, text, message):
    """One key in two spellings (lr and optim.lr), or a section twice: one silently won by its place
    in the file (PyYAML and json keep the last)."""
    from mdlmpe_ds.config.cli import build_config

    config = tmp_path / name
    config.write_text(text)
    with pytest.raises(ValueError, match=message):
        build_config(str(config), [])


@pytest.mark.parametrize(
    "text, hint",
    [
        ("resume: auto\n", "--resume is a run flag, not a config key: give it on the command line"),
        ("train:\n  lr: 0.001\n", "'train.lr' (did you mean optim.lr?)"),
        ("optim:\n  weight_decai: 0.1\n", "(did you mean optim.weight_decay?)"),
        ("max_step: 4\n", "(did you mean max_steps?)"),
    ],
)
def test_an_unknown_config_key_says_what_it_most_likely_meant(tmp_path, text, hint):
    """A run flag in a config file, a key in the wrong section, a misspelling: each is named with
    the likely intent, not only the list of valid keys."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="unknown key") as err:
        cli.load_config_file(path)
    assert hint in str(err.value) and str(path) in str(err.value)
    with pytest.raises(ValueError, match="unknown key 'lrr' \\(did you mean lr\\?\\)"):
        cli.canonical_key("lrr", "command line")
