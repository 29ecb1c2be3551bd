"""The run a study's pretraining subprocess will build, resolved here without starting it.

The comparison and the mechanism study launch ``launch/pretrain.py`` once per (encoding, seed)
with flags they assemble. Their ``--dry-run`` and everything they need to know about those runs
before or after training (the length, the corpus, the preset a recipe chose) come from the
``RunConfig`` the subprocess itself would build, parsed by its own parser, so a recipe or a flag
the user forwards is read exactly as the run will read it.
"""

from __future__ import annotations

import shlex
from pathlib import Path


def pretrain_parser():
    """launch/pretrain.py's parser (its run flags and config keys, with its defaults)."""
    from mdlmpe_ds.config import cli, recipes

    names = [n for n, r in recipes.RECIPES.items() if r.launcher == "pretrain"]
    return cli.config_parser(None, recipes.pretrain_demo(), "pretrain", names)


def planned_run(forwarded: list[str], encoding: str, seed: int, out: Path, ds_config: str):
    """(the RunConfig launch/pretrain.py would build for one matched run, its command)."""
    from mdlmpe_ds.config import cli, recipes
    from mdlmpe_ds.experiments import compare
    from mdlmpe_ds.runs import launching

    cmd = compare.pretrain_command(
        [], encoding, seed, compare.run_dir(out, encoding, seed), ds_config, forwarded
    )
    flags, overrides = cli.parse(pretrain_parser(), cmd[1:])  # the arguments after the script
    world = launching.dry_run_world_size()
    return recipes.pretrain_run(flags["config"], flags["recipe"], overrides, world), cmd


def describe(run) -> str:
    """One line of what a planned run trains."""
    t, d, o = run.train, run.data, run.optim
    return (
        f"{run.model.preset}, {run.model.position_encoding}, max_steps {t.max_steps}, lr {run.lr}, "
        f"max_len {d.max_len}, batch {t.micro_batch_size}x{t.grad_accum}, warmup "
        f"{o.warmup_steps or o.warmup_ratio}, corruption {t.corruption}, loss {t.loss}, dataset "
        f"{d.dataset}, tokenizer {d.tokenizer}"
    )


def print_plans(
    tag: str, encodings: list[str], seeds: list[int], forwarded: list[str], out: Path, ds_config: str,
    launcher: list[str],
) -> None:  # fmt: skip
    """A study's ``--dry-run``: each (encoding, seed) run's plan and the command that would train it."""
    for seed in seeds:
        for encoding in encodings:
            run, cmd = planned_run(forwarded, encoding, seed, out, ds_config)
            print(
                f"[{tag}] {encoding} seed {seed}: {describe(run)}\n  {shlex.join([*launcher, *cmd])}",
                flush=True,
            )
