"""Where every launcher's config comes from: functions that return a complete `RunConfig`.

``sft_config(recipe)`` (launch/sft.py: the dataclass defaults, the embedded CPU demo),
``pretrain_config(preset, world, recipe)`` (launch/pretrain.py: the Shakespeare demo) and
``compare_config(...)`` (launch/compare_pe.py: the pretraining demo trained longer). The config file
and the command line sit on top of the returned config (mdlmpe_ds/config/cli.py).

The paper's recipes (``--recipe NAME``) are tables of training-config values, each with the place
that states it (the paper's Appendix B.3 / B.4, or docs/models.md for what the paper leaves open);
the launcher prints every value the recipe set and which ones the file or flags overrode.

- ``llada-8b-sft``, ``dream-7b-sft``: SFT of the public checkpoints (launch/sft.py);
- ``llada-100m``, ``dream-100m``: from-scratch pretraining (launch/pretrain.py). ``--preset
  llada-100m`` on launch/pretrain.py is the same thing: a preset that has a recipe applies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mdlmpe_ds.config import cli
from mdlmpe_ds.config.run import DataConfig, ModelChoice, OptimConfig, RunConfig, TrainConfig

B4 = "paper App. B.4"
B3 = "paper App. B.3"


@dataclass(frozen=True)
class Recipe:
    name: str
    launcher: str  # "sft" | "pretrain"
    # config key (section.key) -> (value, source)
    values: dict[str, tuple[Any, str]] = field(default_factory=dict)
    # Pretraining recipes split the paper's effective batch over the ranks (see batch_split).
    global_batch: int | None = None
    # The model family the recipe's values are written for ("llada" | "dream"): check_recipe_model.
    family: str | None = None

    def defaults(self) -> dict[str, Any]:
        return {key: value for key, (value, _) in self.values.items()}


_SFT_COMMON: dict[str, tuple[Any, str]] = {
    "model.position_encoding": ("mdlmpe", B4),
    "data.dataset": (
        "allenai/tulu-3-sft-mixture",
        "paper App. B.1 (Tulu-3; SmolTalk is HuggingFaceTB/smoltalk:all)",
    ),
    "optim.lr": (2e-5, B4),
    "train.epochs": (5.0, B4),
    "train.max_steps": (None, B4 + " (five epochs decide the length)"),
    "train.head_schedule": (True, B4 + " Eq. (27)"),
    "train.precision": ("bf16", B4 + " (bfloat16)"),
    "optim.cosine": (True, "docs/models.md §6 (dllm: cosine)"),
    "optim.warmup_ratio": (0.1, "docs/models.md §3.5, §6 (warmup 0.1)"),
    "model.gradient_checkpointing": (True, "docs/models.md §6.1 (8B memory)"),
}

_PRETRAIN_100M: dict[str, tuple[Any, str]] = {
    "data.dataset": ("openwebtext", B3 + " (OWT; data/named_corpora.py holds out its first 100K documents)"),
    "data.validation": ("openwebtext", "paper Table 2 (OWT pretraining-validation: the held-out slice)"),
    "data.max_len": (1024, B3),
    "optim.lr": (1e-4, B3),
    "optim.betas": ((0.9, 0.999), B3),
    "optim.weight_decay": (0.01, B3),
    "optim.cosine": (True, B3),
    "optim.warmup_steps": (2000, B3),
    "optim.min_lr_ratio": (0.0, B3 + " (cosine decay, no floor stated)"),
    "train.max_steps": (200_000, B3),
    "train.save_every": (5000, "choice: 40 checkpoints over 200K steps"),
    "train.eval_every": (5000, B3 + " (fixed validation cadence)"),
    "train.head_schedule": (False, B3 + " (MDLMPE active from the first update)"),
}

RECIPES: dict[str, Recipe] = {
    "llada-8b-sft": Recipe(
        "llada-8b-sft",
        "sft",
        {
            "model.model_name_or_path": ("GSAI-ML/LLaDA-8B-Base", "docs/models.md §6 (dllm: SFT from Base)"),
            **_SFT_COMMON,
            "data.multiturn": ("sample", "docs/models.md §3.2 (LLaDA App. B.1: one sampled turn)"),
            "data.max_len": (1024, "docs/models.md §6 (dllm --max_length 1024)"),
            "train.output_dir": ("outputs/llada-8b-sft", "choice"),
        },
        family="llada",
    ),
    "dream-7b-sft": Recipe(
        "dream-7b-sft",
        "sft",
        {
            "model.model_name_or_path": ("Dream-org/Dream-v0-Base-7B", "docs/models.md §3.5 (Dream-train)"),
            **_SFT_COMMON,
            "data.multiturn": ("last", "docs/models.md §3.5 (response = last answer)"),
            "data.max_len": (2048, "docs/models.md §3.5"),
            "data.perbatch_cutoff": ("random_with_input_pad", "docs/models.md §3.5"),
            "train.dream_weighting": ("cart", "docs/models.md §3.5 (official time_reweighting=cart)"),
            "train.cart_p": (0.1, "docs/models.md §3.5"),
            "optim.betas": ((0.9, 0.95), "docs/models.md §3.5"),
            "optim.weight_decay": (0.01, "docs/models.md §3.5"),
            "optim.clip": (1.0, "docs/models.md §3.5"),
            "train.output_dir": ("outputs/dream-7b-sft", "choice"),
        },
        family="dream",
    ),
    "llada-100m": Recipe(
        "llada-100m",
        "pretrain",
        {
            "model.preset": ("llada-100m", B3),
            # 126,464-token vocabulary: LLaDA's tokenizer (its mask id comes from the preset).
            "data.tokenizer": ("GSAI-ML/LLaDA-8B-Base", B3 + " (126,464-token vocabulary)"),
            **_PRETRAIN_100M,
            "train.output_dir": ("outputs/pretrain-llada-100m", "choice"),
        },
        global_batch=16,
        family="llada",
    ),
    "dream-100m": Recipe(
        "dream-100m",
        "pretrain",
        {
            "model.preset": ("dream-100m", B3),
            "data.tokenizer": ("Dream-org/Dream-v0-Base-7B", "models/presets.py (Dream's native vocabulary)"),
            **_PRETRAIN_100M,
            "train.output_dir": ("outputs/pretrain-dream-100m", "choice"),
        },
        global_batch=16,
        family="dream",
    ),
}


def get(name: str, launcher: str | None = None) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    recipe = RECIPES[name]
    if launcher is not None and recipe.launcher != launcher:
        raise ValueError(f"recipe {name!r} is for launch/{recipe.launcher}.py, not launch/{launcher}.py")
    return recipe


FAMILY_NAMES = {"llada": "LLaDA", "dream": "Dream"}


def check_recipe_model(name: str, run: Any) -> None:
    """Refuse a recipe written for another model family than the run's model: ``--recipe
    llada-8b-sft`` on a Dream model set LLaDA's one-sampled-turn rule, lengths and output_dir while
    the loss followed Dream, a run that is neither recipe. Called once the config is built (the model
    may be a flag or a config-file key); a hub id not yet downloaded is not checked here (the family
    is known only after the download; the run reads it then)."""
    recipe = get(name)
    family, where = model_family(run)
    if recipe.family is None or family is None or family == recipe.family:
        return
    fits = [n for n, r in RECIPES.items() if r.launcher == recipe.launcher and r.family == family]
    instead = f"use --recipe {' or '.join(fits)} (or no --recipe)" if fits else "leave --recipe out"
    ours, theirs = FAMILY_NAMES[recipe.family], FAMILY_NAMES.get(family, family)
    shown = [key for key in ("data.multiturn", "data.tokenizer", "train.output_dir") if key in recipe.values]
    values = ", ".join(f"{key} {recipe.values[key][0]!r}" for key in shown)
    raise ValueError(
        f"--recipe {name} is {ours}'s recipe, but {where} is a {theirs} model: the loss would follow "
        f"{theirs} while the recipe's values ({values}) follow {ours}; {instead}"
    )


def model_family(run: Any) -> tuple[str | None, str]:
    """(family, how the model was named) of ``run``'s model: model.model_name_or_path's config.json
    (a local directory, or a hub id in the local cache), else model.preset's; None when unknown."""
    from mdlmpe_ds.models.hf_config import detect_family

    m = run.model
    if m.model_name_or_path is None:
        from mdlmpe_ds.models.presets import preset

        return preset(m.preset).family, f"--preset {m.preset}"
    raw = _config_json(m.model_name_or_path, getattr(m, "revision", None))
    where = f"--model_name_or_path {m.model_name_or_path}"
    return (detect_family(raw, where) if raw is not None else None), where


def _config_json(name: str, revision: str | None) -> dict | None:
    """The parsed config.json of a local model directory or of a hub id already cached (no download)."""
    import json

    from mdlmpe_ds.hub.resolve import cached_config

    file = cached_config(name, revision)
    if file is None:
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None  # the run reports an unreadable config.json with its own message


def batch_split(recipe: Recipe, world: int) -> dict[str, Any]:
    """micro_batch_size x grad_accum x world = the recipe's global batch (micro 4 where it fits, as
    ds_configs/zero3.json; on 8 or 16 ranks 2 or 1, and the ds config must then agree or say auto)."""
    if recipe.global_batch is None:
        return {}
    if recipe.global_batch % world:
        raise ValueError(
            f"the {recipe.name} recipe's global batch {recipe.global_batch} does not split over {world} "
            "ranks; set --micro_batch_size and --grad_accum explicitly"
        )
    per_rank = recipe.global_batch // world
    micro = 4 if per_rank % 4 == 0 else per_rank
    return {"train.micro_batch_size": micro, "train.grad_accum": per_rank // micro}


def describe(recipe: Recipe, run: Any, world: int | None = None) -> str:
    """One line per value the recipe sets: the value in effect, its source, and whether a config
    file or the command line overrode it."""
    lines = [f"recipe {recipe.name} (launch/{recipe.launcher}.py):"]
    values = dict(recipe.values)
    if world is not None:
        values.update({k: (v, f"global batch {recipe.global_batch} over {world} ranks")
                       for k, v in batch_split(recipe, world).items()})  # fmt: skip
    for key, (value, source) in values.items():
        section, name = key.split(".", 1)
        actual = getattr(getattr(run, section), name)
        if isinstance(value, tuple):
            actual = tuple(actual) if actual is not None else actual
        note = "" if actual == value else f"   (overridden: recipe says {value!r})"
        lines.append(f"  {key} = {actual!r}   [{source}]{note}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the launchers' configs
def sft_config(recipe: str | None = None) -> RunConfig:
    """launch/sft.py's config: the embedded CPU demo (the dataclass defaults), or a paper recipe."""
    config = RunConfig()
    if recipe is not None:
        config = cli.from_mapping(get(recipe, "sft").defaults(), f"recipe {recipe}", base=config)
    return config


def pretrain_demo() -> RunConfig:
    """launch/pretrain.py's embedded CPU demo: the tiny LLaDA-family model on Shakespeare's works,
    held-out works for validation, MDLMPE on every head from the first update."""
    return RunConfig(
        model=ModelChoice(preset="llada-tiny"),
        data=DataConfig(
            dataset="shakespeare", validation="shakespeare-heldout", max_len=128, tokenizer_vocab=2048
        ),
        optim=OptimConfig(lr=3e-3, betas=(0.9, 0.999), warmup_ratio=0.05),
        train=TrainConfig(
            micro_batch_size=4,
            max_steps=60,
            save_every=30,
            eval_every=30,
            head_schedule=False,
            output_dir="outputs/pretrain-demo",
        ),
    )


PRETRAIN_PRESETS = tuple(name for name, r in RECIPES.items() if r.launcher == "pretrain")
PAPER_GLOBAL_BATCH = 16


def pretrain_recipe(preset: str | None, recipe: str | None) -> str | None:
    """The recipe a pretraining run applies: ``--recipe``, else a ``--preset`` that has one."""
    if recipe is not None:
        get(recipe, "pretrain")
        return recipe
    return preset if preset in PRETRAIN_PRESETS else None


def pretrain_config(preset: str | None, world: int, recipe: str | None = None) -> RunConfig:
    """launch/pretrain.py's config: the recipe's values (``--recipe``, or a ``--preset`` with a
    recipe) over the CPU demo's, the preset named.

    The recipe's global batch of 16 is micro-batch 4 x gradient accumulation on 1, 2 or 4 ranks; on
    8 or 16 ranks micro-batches of 2 or 1 (the shipped ds configs say "auto"; one that sets the
    batch explicitly must agree)."""
    config = pretrain_demo()
    name = pretrain_recipe(preset, recipe)
    if name is not None:
        chosen = get(name, "pretrain")
        values = {**chosen.defaults(), **batch_split(chosen, world)}
        config = cli.from_mapping(values, f"recipe {name}", base=config)
    if preset is not None:
        config = cli.from_mapping({"model.preset": preset}, "--preset", base=config)
    return config


def pretrain_run(
    config_file: str | None, recipe: str | None, overrides: dict[str, Any], world: int
) -> RunConfig:
    """A pretraining run's config from its parsed command line (mdlmpe_ds/config/cli.py ``parse``): the
    preset (the command line's ``--preset``, else the config file's) picks the recipe; the recipe
    over the demo, under the file and the flags, validated."""
    preset = overrides.get("model.preset")
    if preset is None and config_file is not None:
        preset = cli.load_config_file(config_file).get("model.preset")
    return cli.configure(pretrain_config(preset, world, recipe), config_file, overrides)


# The tiny CPU comparison: the pretraining demo trained longer. Applied only to keys that neither
# the user (flags, --config) nor a recipe sets; launch/compare_pe.py prints each one it applies.
COMPARE_LONGER = {"train.max_steps": 300, "train.save_every": 150}
