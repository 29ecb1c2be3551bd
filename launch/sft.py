"""Supervised fine-tuning of LLaDA / Dream with MDLMPE on DeepSpeed ZeRO-3.

Embedded default (tiny LLaDA-family model + MDLMPE, the real Qwen2.5 tokenizer, real chat data
prepared offline; 2 CPU ranks; a few minutes)::

    deepspeed launch/sft.py --deepspeed ds_configs/zero3.json

On a CPU-only machine the `deepspeed` launcher starts one rank (one "device"); this script then
re-launches itself with 2 ranks under torchrun (set MDLMPE_DS_CPU_RANKS=1 to keep one; see
mdlmpe_ds/runs/launching.py). It runs under `torchrun --nproc_per_node N launch/sft.py ...` as well.

A real model on a GPU node (bf16; batch sizes must agree with the ds config, or set them "auto")::

    deepspeed launch/sft.py --deepspeed ds_configs/zero3.json \\
        --model_name_or_path /models/LLaDA-8B-Instruct --dataset allenai/tulu-3-sft-mixture \\
        --max_len 2048 --lr 1e-5 --max_steps 2000 --output_dir outputs/llada-sft
    # multi-node: deepspeed --hostfile hostfile launch/sft.py --deepspeed ds_configs/zero3.json ...

Other flags: `--config run.json|yaml` (training config file; command-line keys override it),
`--dry-run` (validate config + batch arithmetic, build on the meta device, print the plan),
`--resume auto|PATH` (auto: the newest complete checkpoint in output_dir), `--recipe llada-8b-sft|
dream-7b-sft` (the paper's SFT recipe, printed; flags override it). Any training-config key is
`--section.key VALUE` or `--key VALUE`; `--help` lists them all. `--model_name_or_path` and
`--tokenizer` take a local directory or a hub id (`--revision`); `--dataset` a file, a directory or a
hub name (`name:config` or `--dataset_config`, `--dataset_split`).
"""

from __future__ import annotations

import functools
import os
import shlex
import sys
from pathlib import Path

from mdlmpe_ds.runs import launching


def main(argv: list[str] | None = None, faults=None) -> int:
    """Parse, re-launch on CPU ranks, build the config, run, print the summary on rank 0.
    ``faults``: test hooks (mdlmpe_ds/training/faults.py); production passes none."""
    from mdlmpe_ds.config import cli, recipes

    argv = sys.argv[1:] if argv is None else argv
    names = [n for n, r in recipes.RECIPES.items() if r.launcher == "sft"]
    parser = cli.config_parser(__doc__.split("\n\n")[0], recipes.sft_config(), "sft", names)
    flags, overrides = cli.parse(parser, argv)
    args = launching.RunFlags(**flags)
    launching.prepare_process()
    ranks = launching.ranks_to_relaunch(args.dry_run)
    if ranks:
        return launching.relaunch(__file__, ranks, argv)

    from mdlmpe_ds.runs.sft_run import run_sft
    from mdlmpe_ds.training.faults import NO_FAULTS
    from mdlmpe_ds.training.log_setup import configure

    configure()

    chosen = recipes.get(args.recipe, "sft") if args.recipe else None
    run = cli.configure(recipes.sft_config(args.recipe), args.config, overrides, launcher="sft")
    if chosen:
        recipes.check_recipe_model(chosen.name, run)  # a LLaDA recipe on a Dream model, or the reverse
    if chosen and os.environ.get("RANK", "0") == "0":
        print(recipes.describe(chosen, run), flush=True)

    def report(summary: dict) -> None:
        out = Path(run.train.output_dir).resolve()
        resume = launching.resume_command("launch/sft.py", args.deepspeed, argv, args.config)
        board = out / "tensorboard"
        export = shlex.join(
            ["python", "launch/export.py", str(out / "checkpoints" / "latest"), str(out / "export")]
        )
        print(
            f"\n{launching.outcome(summary, run.train.stop_at)}",
            f"\nTensorBoard logs: {board}   (tensorboard --logdir {shlex.quote(str(board))})"
            f"\ncheckpoints:      {out / 'checkpoints'} (last: {summary['last_checkpoint']})"
            f"\nresume with:      {resume}"
            f"\nexport with:      {export}",
            flush=True,
        )

    job = functools.partial(run_sft, faults=faults or NO_FAULTS)
    return launching.run_job(job, run, args, report)


if __name__ == "__main__":
    launching.exit_process(main())
