"""A pretraining run assembled (paper §4.3, Appendix B): the tokenizer (``data.tokenizer``, else the
model directory's, else a SentencePiece BPE of ``data.tokenizer_vocab`` pieces trained on the corpus
and cached by content), the packed corpus and validation windows, the engine, the pretraining task
and the trainer (``run_pretrain``); and the pretraining command line (``main``), which
launch/pretrain.py and the encoding comparison (``python -m mdlmpe_ds.runs.pretrain``) both run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from mdlmpe_ds import engine as eng
from mdlmpe_ds import launching, recipes
from mdlmpe_ds.config import RunConfig
from mdlmpe_ds.faults import NO_FAULTS, Faults
from mdlmpe_ds.runs.assembly import RunData, RunInputs, RunKind, assemble_and_train, store_dir
from mdlmpe_ds.runs.common import assert_same_on_all_ranks, rank_zero_first

log = logging.getLogger(__name__)

# Defaults of launch/pretrain.py: the embedded CPU demo (tiny LLaDA-family model on Shakespeare).
PRETRAIN_DEFAULTS: dict[str, Any] = {
    "model.preset": "llada-tiny",
    "data.dataset": "shakespeare",
    "data.validation": "shakespeare-heldout",
    "data.max_len": 128,
    "data.tokenizer_vocab": 2048,
    "optim.lr": 3e-3,
    "optim.betas": (0.9, 0.999),
    "optim.warmup_ratio": 0.05,
    "train.micro_batch_size": 4,
    "train.max_steps": 60,
    "train.save_every": 30,
    "train.eval_every": 30,
    "train.head_schedule": False,
    "train.output_dir": "outputs/pretrain-demo",
}

# Paper Appendix B.3 (AdamW lr 1e-4, betas 0.9/0.999, weight decay 0.01, cosine, 2K warmup steps,
# effective batch 16, L = 1024, 200K steps, MDLMPE on every head from the start): the llada-100m and
# dream-100m recipes of mdlmpe_ds/recipes.py, which a --preset of that name applies as --recipe does.
RECIPE_PRESETS = tuple(name for name, r in recipes.RECIPES.items() if r.launcher == "pretrain")
PAPER_GLOBAL_BATCH = 16


def pretrain_recipe(preset: str | None, recipe: str | None) -> str | None:
    """The recipe a pretraining run applies: ``--recipe``, else a ``--preset`` that has one."""
    if recipe is not None:
        recipes.get(recipe, "pretrain")
        return recipe
    return preset if preset in RECIPE_PRESETS else None


def pretrain_defaults(preset: str | None, world: int, recipe: str | None = None) -> dict[str, Any]:
    """Launcher defaults: the recipe's values (``--recipe``, or a ``--preset`` with a recipe) over the
    CPU demo's. Config files and flags override them.

    The recipe's global batch of 16 is micro-batch 4 x gradient accumulation on 1, 2 or 4 ranks; on
    8 or 16 ranks micro-batches of 2 or 1 (the shipped ds configs say "auto"; one that sets the
    batch explicitly must agree)."""
    defaults = dict(PRETRAIN_DEFAULTS)
    name = pretrain_recipe(preset, recipe)
    if name is not None:
        chosen = recipes.get(name, "pretrain")
        defaults.update(chosen.defaults())
        defaults.update(recipes.batch_split(chosen, world))
    if preset is not None:
        defaults["model.preset"] = preset
    return defaults


# ------------------------------------------------------------------------------------ tokenizer
def _files_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def sentencepiece_for_corpus(spec: str, vocab: int, cache_root: Path | None = None) -> Path:
    """A SentencePiece BPE tokenizer directory trained on corpus ``spec``, cached by content + size.

    Trained into a temporary directory and renamed into place, so an interrupted run never leaves a
    half-written tokenizer behind. Nodes sharing the cache may train it at the same time (each
    node's first rank builds): the first rename wins and the others keep that copy.
    """
    from mdlmpe_ds.data.assets import default_cache_dir
    from mdlmpe_ds.data.corpora import corpus_text_files
    from mdlmpe_ds.data.spm_tokenizer import train_sentencepiece

    files = corpus_text_files(spec)
    root = (cache_root or default_cache_dir()) / "tokenizers"
    out = root / f"spm-bpe-{vocab}-{_files_digest(files)}"
    if (out / "tokenizer.json").is_file():
        return out
    tmp = root / f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    train_sentencepiece(files, vocab, tmp)
    if out.exists() and not (out / "tokenizer.json").is_file():
        shutil.rmtree(out, ignore_errors=True)  # an incomplete leftover, never a finished copy
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "tokenizer.json").is_file():
            raise
    return out


def resolve_tokenizer_dir(run: RunConfig) -> Path:
    if run.data.tokenizer is not None:
        return Path(run.data.tokenizer)
    if run.model.model_name_or_path is not None:
        return Path(run.model.model_name_or_path)
    return sentencepiece_for_corpus(run.data.dataset, run.data.tokenizer_vocab)


def validation_batches(run: RunConfig, tokenizer, family: str) -> list[dict] | None:
    """The first ``train.eval_sequences`` windows of ``data.validation``, in micro-batches, each
    with the positions a ``family`` model is scored on (``maskable``)."""
    from mdlmpe_ds.data.corpora import load_packed_corpus
    from mdlmpe_ds.data.pretrain import packed_collate
    from mdlmpe_ds.diffusion.elbo import scored_positions

    d, t = run.data, run.train
    if d.validation is None:
        return None
    packed = load_packed_corpus(
        d.validation, tokenizer, d.max_len, split=d.text_split, text_column=d.text_column,
        cache_dir=store_dir(run), role="eval", workers=d.build_workers,
    )  # fmt: skip
    if len(packed) == 0:
        raise ValueError(f"validation corpus {d.validation!r} is shorter than one {d.max_len}-token window")
    n = min(t.eval_sequences, len(packed))
    items = [packed[i] for i in range(n)]
    batches = [packed_collate(items[i : i + t.micro_batch_size]) for i in range(0, n, t.micro_batch_size)]
    for batch in batches:
        batch["maskable"] = scored_positions(batch["valid"], family)
    return batches


def pretrain_sources(local: RunConfig) -> tuple[Path, str]:
    """(tokenizer directory, corpus): the tokenizer is resolved (or trained) on each node's first
    rank first."""
    return rank_zero_first(lambda: resolve_tokenizer_dir(local)), local.data.dataset


def load_data(run: RunConfig, inputs: RunInputs) -> RunData:
    """The packed corpus (each node's first rank packs and caches it first), checked equal on every
    rank, and this rank's sampler over its windows."""
    from mdlmpe_ds.data.corpora import load_packed_corpus
    from mdlmpe_ds.data.fingerprint import packed_fingerprint
    from mdlmpe_ds.data.pretrain import packed_collate
    from mdlmpe_ds.data.sampler import LengthGroupedSampler

    d, t = run.data, run.train
    tokenizer = inputs.tokenizer

    def pack():
        return load_packed_corpus(
            d.dataset, tokenizer, d.max_len, split=d.text_split, text_column=d.text_column,
            max_documents=d.max_documents, cache_dir=store_dir(run), role="train",
            workers=d.build_workers,
        )  # fmt: skip

    dataset = rank_zero_first(pack)
    fingerprint = packed_fingerprint(dataset, tokenizer)  # one digest: ranks agree, the checkpoint matches
    assert_same_on_all_ranks(fingerprint, f"{d.dataset}: the ranks packed different token streams")
    if len(dataset) == 0:
        raise ValueError(f"corpus {d.dataset!r} is shorter than one {d.max_len}-token window")
    log.info(
        f"data {d.dataset}: {len(dataset)} windows of {d.max_len} tokens "
        f"({dataset.num_tokens:,} tokens, {dataset.doc_ends.size} documents), "
        f"tokenizer {inputs.tokenizer_dir}"
    )
    sampler = LengthGroupedSampler(
        [d.max_len] * len(dataset),
        t.micro_batch_size,
        rank=eng.rank(),
        world_size=eng.world_size(),
        seed=t.seed,
    )
    return RunData(dataset, fingerprint, sampler, packed_collate)


def make_task(run: RunConfig, inputs: RunInputs, data: RunData):
    """The pretraining task with its validation windows (read on each node's first rank first)."""
    from mdlmpe_ds.tasks.pretrain import PretrainTask

    family = inputs.model_config.family
    validation = rank_zero_first(lambda: validation_batches(run, inputs.tokenizer, family))
    return PretrainTask(
        run.train, inputs.model_config, data.dataset, data.sampler, data.collator, validation=validation
    )


def summarise(run: RunConfig, summary: dict, trainer, task, data: RunData, total: int) -> None:
    t, world = run.train, eng.world_size()
    summary.update(
        {
            "finished": trainer.state.step >= total,  # False after train.stop_at
            "validation": task.last_validation,
            "tokens_per_epoch": data.dataset.num_tokens,
            "epochs": (total * t.micro_batch_size * t.grad_accum * world) / max(1, len(data.dataset)),
        }
    )
    if task.last_validation is not None and not math.isfinite(task.last_validation["val/ppl"]):
        log.warning("the final validation perplexity is not finite")


PRETRAIN = RunKind(sources=pretrain_sources, load_data=load_data, make_task=make_task, summarise=summarise)


def run_pretrain(
    run: RunConfig,
    ds_config_path: str,
    resume: str | None = None,
    dry_run: bool = False,
    faults: Faults = NO_FAULTS,
    allow_changes: list[str] | None = None,
) -> dict:
    """Build the packed data, the model under ZeRO-3 and the engine; pretrain (runs/assembly.py).
    Call inside `engine.distributed_session` (except dry runs). ``faults``: test hooks
    (mdlmpe_ds/faults.py)."""
    return assemble_and_train(PRETRAIN, run, ds_config_path, resume, dry_run, faults, allow_changes)


# ------------------------------------------------------------------------------------ command line
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
    from mdlmpe_ds.config import help_text

    names = [n for n, r in recipes.RECIPES.items() if r.launcher == "pretrain"]
    return help_text(PRETRAIN_DEFAULTS, recipes=names)


def main(
    argv: list[str] | None = None,
    script: str | None = None,
    description: str | None = None,
    faults: Faults = NO_FAULTS,
) -> int:
    """The pretraining command line: parse, re-launch on CPU ranks, build the config (recipe and
    demo defaults under file and flags), run, and print the summary on rank 0. ``script``: the file
    a CPU re-launch runs (launch/pretrain.py), else this module (``-m``)."""
    from functools import partial

    from mdlmpe_ds.config import build_config
    from mdlmpe_ds.log_setup import configure

    argv = sys.argv[1:] if argv is None else argv
    description = description or __doc__.split("\n\n")[0]
    args, rest = launching.base_parser(description, _help(argv)).parse_known_args(argv)
    launching.prepare_process()
    ranks = launching.ranks_to_relaunch(args.dry_run)
    if ranks:
        return launching.relaunch(script or __spec__.name, ranks, argv, module=script is None)
    configure()

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
            f"\n{launching.outcome(summary, run.train.stop_at)} ({summary['epochs']:.2f} epochs of "
            f"{summary['tokens_per_epoch']:,} tokens planned)",
        ]
        if val:
            lines.append(f"validation ELBO perplexity ({run.data.validation}): {val['val/ppl']:.2f}")
        lines += [
            f"TensorBoard logs: {out / 'tensorboard'}   (tensorboard --logdir {out / 'tensorboard'})",
            f"checkpoints:      {out / 'checkpoints'} (last: {summary['last_checkpoint']})",
            "resume with:      "
            + launching.resume_command("launch/pretrain.py", args.deepspeed, rest, args.config),
            f"evaluate with:    python launch/evaluate.py {out}",
        ]
        print("\n".join(lines), flush=True)

    return launching.run_job(partial(run_pretrain, faults=faults), run, args, report)


if __name__ == "__main__":
    launching.exit_process(main())
