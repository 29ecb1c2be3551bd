"""Recipes, --help and compare's overrides (issue 17): each --recipe prints and applies the paper's
values and the command line wins; --help lists every typed-config key; compare_pe never overrides
a value the user or a preset set, and names each override it makes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from mdlmpe_ds.config import recipes
from mdlmpe_ds.config.cli import build_config, valid_keys
from mdlmpe_ds.config.run import RunConfig

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "dist"))
from sft_fixtures import make_chat, make_tokenizer  # noqa: E402


def _launcher(name):
    spec = importlib.util.spec_from_file_location(f"launch_{name}", REPO / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _value(run, key):
    section, name = key.split(".", 1)
    value = getattr(getattr(run, section), name)
    return tuple(value) if isinstance(value, (list, tuple)) else value


@pytest.mark.parametrize("name", list(recipes.RECIPES))
def test_each_recipe_applies_its_values_and_the_command_line_wins(name):
    recipe = recipes.get(name)
    run = build_config(None, [], defaults=recipe.defaults())
    for key, (value, _) in recipe.values.items():
        assert _value(run, key) == value, key
    run = build_config(None, ["--lr", "3e-5", "--max_len", "64"], defaults=recipe.defaults())
    assert run.optim.lr == 3e-5 and run.data.max_len == 64
    text = recipes.describe(recipe, run)
    assert "optim.lr = 3e-05" in text and "(overridden: recipe says" in text
    assert all(key in text for key in recipe.values)


def test_paper_sft_values():
    llada, dream = (
        build_config(None, [], defaults=recipes.get(n).defaults()) for n in ("llada-8b-sft", "dream-7b-sft")
    )
    for run in (llada, dream):  # Appendix B.4
        assert (run.optim.lr, run.train.epochs, run.train.max_steps) == (2e-5, 5.0, None)
        assert run.train.head_schedule and run.model.position_encoding == "mdlmpe"
    assert llada.data.multiturn == "sample"  # LLaDA's one sampled turn is accepted now
    assert (dream.train.dream_weighting, dream.train.cart_p) == ("cart", 0.1)
    assert RunConfig().train.dream_weighting == "cart"  # Dream's default follows the official recipe


def test_pretrain_preset_and_recipe_are_one_mechanism():
    from mdlmpe_ds.config.recipes import pretrain_config

    for name in ("llada-100m", "dream-100m"):
        assert pretrain_config(name, 2) == pretrain_config(None, 2, recipe=name)
        run = build_config(None, [], defaults=pretrain_config(name, 2))
        assert (run.train.max_steps, run.optim.lr, run.data.max_len) == (200_000, 1e-4, 1024)
    with pytest.raises(ValueError, match=r"is for launch/sft\.py"):
        pretrain_config(None, 2, recipe="llada-8b-sft")


def test_sft_launcher_prints_the_recipe_and_flags_win(tmp_path, capsys):
    from mdlmpe_ds.models import DiffusionLM, preset, save_pretrained

    tok = make_tokenizer(tmp_path / "tok")
    chat = make_chat(tmp_path / "chat.jsonl", rows=16)
    config = preset("dream-tiny", vocab_size=128, mask_token_id=3, eos_token_id=0, pad_token_id=0)
    save_pretrained(DiffusionLM(config), tmp_path / "model", config)
    args = ["--model_name_or_path", str(tmp_path / "model"), "--tokenizer", str(tok), "--dataset", str(chat)]
    args += [
        "--max_len",
        "48",
        "--max_steps",
        "2",
        "--precision",
        "fp32",
        "--output_dir",
        str(tmp_path / "o"),
    ]
    code = _launcher("sft").main(
        [
            "--deepspeed",
            str(REPO / "ds_configs" / "zero3.json"),
            "--dry-run",
            "--recipe",
            "dream-7b-sft",
            *args,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert (
        "recipe dream-7b-sft" in out and "optim.lr = 2e-05" in out and "train.dream_weighting = 'cart'" in out
    )
    assert "data.max_len = 48" in out and "(overridden: recipe says 2048)" in out


@pytest.mark.parametrize("launcher", ["sft", "pretrain", "compare_pe"])
def test_help_lists_every_config_key(launcher, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _launcher(launcher).main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for key in valid_keys():
        line = next((ln for ln in out.splitlines() if ln.startswith(f"  --{key.split('.', 1)[1]} ")), None)
        assert line is not None, f"{key} missing from launch/{launcher}.py --help"
        assert "(default " in line, line
    assert "--recipe NAME" in out and "--dataset_split" in out


def test_compare_never_overrides_user_or_preset_values(capsys):
    compare_pe = _launcher("compare_pe")
    assert (
        compare_pe.main(["--preset", "llada-100m", "--dry-run", "--seeds", "0", "--encodings", "rope"]) == 0
    )
    out = capsys.readouterr().out
    assert "max_steps 200000" in out and "--max_steps 300" not in out and "[compare] sets" not in out
    compare_pe.main(["--dry-run", "--seeds", "0", "--encodings", "rope", "--max_steps", "20"])
    out = capsys.readouterr().out
    assert "max_steps 20," in out and "[compare] sets --max_steps" not in out
    assert "[compare] sets --save_every 150" in out  # named, because it is made
    compare_pe.main(["--dry-run", "--seeds", "0", "--encodings", "rope"])
    assert "[compare] sets --max_steps 300" in capsys.readouterr().out


def test_mask_id_comes_from_the_preset_when_the_tokenizer_has_none(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mdlmpe_ds.runs.common import model_config_for

    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "[UNK]", "hello", "world"])}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", unk_token="[UNK]")
    assert tokenizer.mask_token_id is None  # like LLaDA's tokenizer
    run = build_config(None, ["--preset", "llada-100m", "--max_len", "64"])
    config = model_config_for(run, tokenizer)
    assert (config.mask_token_id, config.vocab_size) == (126336, 126464)


def test_a_recipe_for_the_other_model_family_is_refused(tmp_path, monkeypatch):
    """`--recipe llada-8b-sft` on a Dream checkpoint set LLaDA's one-sampled-turn rule and
    outputs/llada-8b-sft while the loss followed Dream, without a word; now refused by name, with the
    recipe that fits (launch/sft.py calls check_recipe_model once the config is built)."""
    from mdlmpe_ds.models import DiffusionLM, preset, save_pretrained

    config = preset("dream-tiny", vocab_size=128, mask_token_id=3, eos_token_id=0, pad_token_id=0)
    save_pretrained(DiffusionLM(config), tmp_path / "dream", config)
    flags = ["--model_name_or_path", str(tmp_path / "dream")]
    run = build_config(None, flags, defaults=recipes.get("llada-8b-sft").defaults())
    with pytest.raises(ValueError) as exc:
        recipes.check_recipe_model("llada-8b-sft", run)
    assert str(exc.value) == (
        f"--recipe llada-8b-sft is LLaDA's recipe, but --model_name_or_path {tmp_path / 'dream'} is a Dream "
        "model: the loss would follow Dream while the recipe's values (data.multiturn 'sample', "
        "train.output_dir 'outputs/llada-8b-sft') follow LLaDA; use --recipe dream-7b-sft (or no --recipe)"
    )
    recipes.check_recipe_model(
        "dream-7b-sft", build_config(None, flags, defaults=recipes.get("dream-7b-sft").defaults())
    )
    with pytest.raises(ValueError, match="--preset dream-tiny is a Dream model"):
        recipes.check_recipe_model("llada-100m", build_config(None, ["--preset", "dream-tiny"]))
    # launch/sft.py checks it once the config is built, before anything is read or planned
    with pytest.raises(ValueError, match="--recipe llada-8b-sft is LLaDA's recipe"):
        _launcher("sft").main(["--recipe", "llada-8b-sft", "--dry-run", *flags])
    # A hub id that is not downloaded yet: the family is unknown here, so nothing is refused.
    from mdlmpe_ds.hub import resolve

    def not_cached(*args, **kwargs):
        raise resolve.HubResolveError("not in the local Hugging Face cache")

    monkeypatch.setattr(resolve, "_download", not_cached)
    run = build_config(None, ["--model_name_or_path", "Dream-org/Dream-v0-Base-7B"])
    recipes.check_recipe_model("llada-8b-sft", run)
