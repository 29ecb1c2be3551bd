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

(``--store_dir`` shared by the runs of a comparison tokenises OWT once; README "Data at scale"
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

import json
import os
import sys
from pathlib import Path

from mdlmpe_ds import launching  # light: no torch / DeepSpeed import at module level


def _preset_from(tokens: list[str], config_file: str | None) -> str | None:
    """The model preset named on the command line or in the config file (it picks the recipe)."""
    for i, token in enumerate(tokens):
        for key in ("--preset", "--model.preset"):
            if token == key and i + 1 < len(tokens):
                return tokens[i + 1]
            if token.startswith(key + "="):
                return token.split("=", 1)[1]
    if config_file is not None:
        from mdlmpe_ds.config import load_config_file

        flat = load_config_file(config_file)
        return flat.get("model.preset", flat.get("preset"))
    return None


def write_summary(out: Path, summary: dict) -> None:
    """``summary.json`` (written last, atomically): the run finished; compare_pe.py reuses it."""
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    tmp.replace(out / "summary.json")


def _help(argv: list[str]) -> str | None:
    """Every training-config key with this launcher's defaults, for --help only."""
    if not {"-h", "--help"} & set(argv):
        return None
    from mdlmpe_ds import recipes
    from mdlmpe_ds.config import help_text
    from mdlmpe_ds.pretraining import PRETRAIN_DEFAULTS

    names = [n for n, r in recipes.RECIPES.items() if r.launcher == "pretrain"]
    return help_text(PRETRAIN_DEFAULTS, recipes=names)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = launching.base_parser(__doc__.split("\n\n")[0], _help(argv)).parse_known_args(argv)
    launching.prepare_process()
    ranks = launching.ranks_to_relaunch(args.dry_run)
    if ranks:
        return launching.relaunch(__file__, ranks, argv)

    from mdlmpe_ds import recipes
    from mdlmpe_ds.config import build_config
    from mdlmpe_ds.pretraining import pretrain_defaults, pretrain_recipe, run_pretrain

    world = int(os.environ.get("WORLD_SIZE", "1"))
    recipe, rest = recipes.pop_recipe(rest)
    preset = _preset_from(rest, args.config)
    defaults = pretrain_defaults(preset, world, recipe)
    run = build_config(args.config, rest, defaults=defaults)
    applied = pretrain_recipe(preset, recipe)
    if applied and os.environ.get("RANK", "0") == "0":
        print(recipes.describe(recipes.get(applied), run, world), flush=True)

    def report(summary: dict) -> None:
        out = Path(run.train.output_dir).resolve()
        if summary["finished"]:
            write_summary(out, summary)
        val = summary.get("validation")
        lines = [
            f"\ndone: {summary['total_updates']} updates ({summary['epochs']:.2f} epochs of "
            f"{summary['tokens_per_epoch']:,} tokens)"
            + (f", final loss {summary['history'][-1]['loss']:.4f}" if summary["history"] else ""),
        ]
        if val:
            lines.append(f"validation ELBO perplexity ({run.data.validation}): {val['val/ppl']:.2f}")
        lines += [
            f"TensorBoard logs: {out / 'tensorboard'}   (tensorboard --logdir {out / 'tensorboard'})",
            f"checkpoints:      {out / 'checkpoints'} (last: {summary['last_checkpoint']})",
            f"resume with:      {launching.resume_command('launch/pretrain.py', args.deepspeed, rest)}",
            f"evaluate with:    python launch/evaluate.py {out}",
        ]
        print("\n".join(lines), flush=True)

    return launching.run_job(run_pretrain, run, args, report)


if __name__ == "__main__":
    launching.exit_process(main())
