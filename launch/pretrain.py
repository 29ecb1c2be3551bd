"""Pretrain a masked diffusion LM from scratch on packed text, on DeepSpeed ZeRO-3.

Embedded default (tiny LLaDA-family model with MDLMPE, a SentencePiece tokenizer trained on the
corpus, Shakespeare's works prepared offline, held-out works for validation; 2 CPU ranks; ~2 min)::

    deepspeed launch/pretrain.py --deepspeed ds_configs/zero3.json

The paper's 100M setting (Appendix B recipe: lr 1e-4, AdamW 0.9/0.999, wd 0.01, cosine, 2K warmup,
global batch 16, L 1024, 200K steps) on a GPU node, OpenWebText streamed from the hub into a token
store once (rank 0; the other ranks wait, then map it), its held-out slice for validation::

    deepspeed launch/pretrain.py --deepspeed ds_configs/zero3.json --preset llada-100m \\
        --dataset openwebtext --validation openwebtext --store_dir /scratch/token_stores \\
        --position_encoding mdlmpe --output_dir outputs/llada-100m-mdlmpe

(``--store_dir`` shared by the runs of a comparison tokenises OWT once; docs/results.md "Token stores"
gives its disk size, build time and memory per rank.)

Position encodings: ``--position_encoding rope|alibi|absolute|mdlmpe``; MDLMPE ablations through
``--mdlmpe '{"use_gaussian": false}'`` (pe/config.py keys). Corpora (``--dataset``, ``--validation``):
a named offline corpus (shakespeare, shakespeare-heldout, ptb, enwiki-excerpt, news-excerpt,
botchan), a named hub corpus of the paper (openwebtext, wikitext-2, wikitext-103, lm1b, text8;
``name@split`` picks a split), local .txt files or a directory, a .jsonl/.parquet file, or a hub
dataset (mdlmpe_ds/data/corpora.py). Every run of the same seed and data draws the same masks for the
same window, whatever the encoding. Other flags as launch/sft.py: ``--config``, ``--dry-run``,
``--resume auto|PATH``, any training-config key as ``--section.key VALUE`` / ``--key VALUE``.
"""

from __future__ import annotations

import functools
import os
import shlex
import sys
from pathlib import Path

from mdlmpe_ds.runs import launching


def main(argv: list[str] | None = None, faults=None) -> int:
    """The pretraining command line: parse, re-launch on CPU ranks, build the config (recipe and
    demo under file and flags), run, and print the summary on rank 0. ``faults``: test hooks
    (mdlmpe_ds/training/faults.py); production passes none."""
    from mdlmpe_ds.config import cli, recipes

    argv = sys.argv[1:] if argv is None else argv
    names = [n for n, r in recipes.RECIPES.items() if r.launcher == "pretrain"]
    parser = cli.config_parser(__doc__.split("\n\n")[0], recipes.pretrain_demo(), "pretrain", names)
    flags, overrides = cli.parse(parser, argv)
    args = launching.RunFlags(**flags)
    launching.prepare_process()
    ranks = launching.ranks_to_relaunch(args.dry_run)
    if ranks:
        return launching.relaunch(__file__, ranks, argv)

    from mdlmpe_ds.runs.pretrain_run import run_pretrain, write_summary
    from mdlmpe_ds.training.faults import NO_FAULTS
    from mdlmpe_ds.training.log_setup import configure

    configure()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    run = recipes.pretrain_run(args.config, args.recipe, overrides, world)
    applied = recipes.pretrain_recipe(run.model.preset, args.recipe)
    if applied:
        recipes.check_recipe_model(applied, run)
    if applied and os.environ.get("RANK", "0") == "0":
        print(recipes.describe(recipes.get(applied), run, world), flush=True)

    def report(summary: dict) -> None:
        out = Path(run.train.output_dir).resolve()
        if summary["finished"]:
            write_summary(out, summary)
        val = summary.get("validation")
        lines = [
            f"\n{launching.outcome(summary, run.train.stop_at)} ({summary['epochs']:.2f} epochs of "
            f"{summary['tokens_per_epoch']:,} tokens planned)",
        ]
        if val:
            lines.append(f"validation ELBO perplexity ({run.data.validation}): {val['val/ppl']:.2f}")
        board = out / "tensorboard"
        lines += [
            f"TensorBoard logs: {board}   (tensorboard --logdir {shlex.quote(str(board))})",
            f"checkpoints:      {out / 'checkpoints'} (last: {summary['last_checkpoint']})",
            "resume with:      "
            + launching.resume_command("launch/pretrain.py", args.deepspeed, argv, args.config),
            "evaluate with:    " + shlex.join(["python", "launch/evaluate.py", str(out)]),
        ]
        print("\n".join(lines), flush=True)

    job = functools.partial(run_pretrain, faults=faults or NO_FAULTS)
    return launching.run_job(job, run, args, report)


if __name__ == "__main__":
    launching.exit_process(main())
