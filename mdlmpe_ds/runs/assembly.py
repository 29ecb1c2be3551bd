"""One run assembly for every training task: resolve the hub ids, load the tokenizer, make the model
config, find the resume point, read the data, build the engine, construct the trainer, train and
summarise. SFT and pretraining differ only in where their tokenizer and data come from, which task
turns the data into batches and what their summary adds; they pass those parts in as a ``RunKind``
(runs/sft_run.py, runs/pretrain_run.py), so the order that ZeRO-3, resume and the data checks rely on is
written once, here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mdlmpe_ds.config.run import RunConfig
from mdlmpe_ds.distributed import engine as eng
from mdlmpe_ds.distributed import process_group
from mdlmpe_ds.hub.resolve import local_run, recorded_tokenizer, resolution
from mdlmpe_ds.runs.common import (
    build_engine,
    check_resume_data,
    clear_overwritten,
    dry_run_plan,
    earlier_run,
    load_tokenizer_dir,
    model_config_for,
    prepare_resume,
    resumed_total,
    set_newer_aside,
    starts_new_history,
)
from mdlmpe_ds.training import checkpoint as ckpt
from mdlmpe_ds.training import lifecycle
from mdlmpe_ds.training.callbacks import callbacks_for
from mdlmpe_ds.training.faults import NO_FAULTS, Faults
from mdlmpe_ds.training.trainer import Trainer

log = logging.getLogger(__name__)


def store_dir(run: RunConfig) -> Path:
    """Where a run's tokenised data (SFT caches, pretraining token stores) lives: ``data.store_dir``,
    which several runs may share, else the run's own ``<output_dir>/data_cache``."""
    return Path(run.data.store_dir) if run.data.store_dir else Path(run.train.output_dir) / "data_cache"


@dataclasses.dataclass
class RunInputs:
    """What a run reads before its data: the local copy of the run (hub ids resolved; the run as
    written keeps the ids), the tokenizer directory and tokenizer, the data source after defaults
    are filled in, and the model config."""

    local: RunConfig
    tokenizer_dir: str
    source: str
    tokenizer: Any
    model_config: Any


@dataclasses.dataclass
class RunData:
    """A task's data: the dataset (its length counts the examples of the plan), its fingerprint
    (equal on every rank, matched against a resumed checkpoint), this rank's sampler and the
    collator that makes micro-batches."""

    dataset: Any
    fingerprint: str
    sampler: Any
    collator: Any


@dataclasses.dataclass(frozen=True)
class RunKind:
    """The task-specific parts of a run.

    ``sources(local)``: (tokenizer directory, data source) of the run with its hub ids resolved.
    ``load_data(run, inputs)``: the tokenised data, sampler and collator.
    ``make_task(run, inputs, data)``: the task the trainer drives (it may read more, e.g. validation).
    ``summarise(run, summary, trainer, task, data, total)``: adds the task's lines to the summary.
    """

    sources: Callable[[RunConfig], tuple[str | Path, str]]
    load_data: Callable[[RunConfig, RunInputs], RunData]
    make_task: Callable[[RunConfig, RunInputs, RunData], Any]
    summarise: Callable[..., None] | None = None


def run_inputs(run: RunConfig, kind: RunKind) -> RunInputs:
    """Resolve the hub ids (rank 0 downloads first), load the tokenizer, make the model config."""
    local = local_run(run)
    tok_dir, source = kind.sources(local)
    tokenizer = load_tokenizer_dir(tok_dir)
    return RunInputs(local, str(tok_dir), source, tokenizer, model_config_for(local, tokenizer))


#: Written by a run that finished (runs/pretrain_run.write_summary; compare_pe.py reuses it).
FINISHED_SUMMARY = "summary.json"


def make_trainer(
    run: RunConfig,
    engine,
    model_config,
    task,
    total: int,
    resume_from: Path | None,
    tokenizer_name: str,
    fingerprint: str,
    faults: Faults,
    resolved: dict | None = None,
    before_first_write: Callable[[], None] | None = None,
) -> Trainer:
    """The one place a run's trainer is constructed, with the callbacks this run needs
    (callbacks.callbacks_for: head schedule, MDLMPE statistics, LoRA, non-finite policy, stops, faults).
    ``resolved``: what the run's names resolved to (hub.resolve.resolution), kept in each checkpoint.
    ``before_first_write``: the trainer calls it once the checkpoint has loaded, before its tracker
    writes into output_dir (``change_output_dir``)."""
    hooks = callbacks_for(run, model_config, faults)
    return Trainer(
        run,
        engine,
        model_config,
        task,
        total,
        resume_from,
        tokenizer_name,
        fingerprint,
        callbacks=hooks,
        resolved=resolved,
        before_first_write=before_first_write,
    )


def change_output_dir(resume: str | None, resume_from: Path | None, run: RunConfig) -> None:
    """Collective, the setup's only changes to what an earlier run left, made as late as they can be:
    inputs, data, model and engine are built and the checkpoint has loaded (every check has passed),
    and nothing of this run is written yet. First the stop request, agreed over the ranks: a SIGTERM
    or Ctrl-C during the build or the load (minutes for a large model; scancel, a preemption) was only
    recorded, and the job stops here with the output_dir as it found it. Then --overwrite_output_dir
    deletes the earlier run (``clear_overwritten``) and an older-step resume sets the newer checkpoints
    aside (``set_newer_aside``)."""
    lifecycle.stop_setup_if_asked(
        "setting up (before the first update)", lambda: stopped_setup_advice(resume, run)
    )
    clear_overwritten(resume, run)
    set_newer_aside(resume_from, run)


def stopped_setup_advice(resume: str | None, run: RunConfig) -> str:
    """What a run stopped during setup leaves, read from the disk as it is now: the earlier run an
    --overwrite_output_dir has not deleted yet, the newest checkpoint --resume auto would continue
    from, or nothing to continue (never a checkpoint that is not there)."""
    out = run.train.output_dir
    if run.train.overwrite_output_dir and starts_new_history(resume, out) and earlier_run(out):
        return (
            f"the earlier run in {out} is intact (--overwrite_output_dir deletes it only once the new "
            f"run is ready to train): run the same command again to start over"
        )
    newest = ckpt.newest_complete(out)
    if newest is None:
        return f"{out} holds no checkpoint to continue from: run the same command again to start"
    return (
        f"the checkpoints in {ckpt.checkpoints_root(out)} are as they were: run the same command again, "
        f"or --resume auto to continue from the newest, {newest}"
    )


def assemble_and_train(
    kind: RunKind,
    run: RunConfig,
    ds_config_path: str,
    resume: str | None = None,
    dry_run: bool = False,
    faults: Faults = NO_FAULTS,
    allow_changes: list[str] | None = None,
) -> dict:
    """Build everything in the ZeRO-3 order and train. Call inside `engine.distributed_session`
    (except dry runs, which plan from the model's config alone on the meta device and need no
    process group). ``faults``: test hooks (mdlmpe_ds/training/faults.py); ``allow_changes``: the keys of
    --allow_config_change.

    The order: inputs (tokenizer, model config), then the resume point (its config and model are
    checked before any data work), then the data (its fingerprint checked against the checkpoint
    before any engine work), the task, the engine, the trainer (which loads the checkpoint). Only then,
    unless a stop was requested meanwhile, is what an earlier run left changed (``change_output_dir``)."""
    if dry_run:  # from the model's config alone: no weights, no tokenizer, no data
        return dry_run_plan(run, ds_config_path, resume)
    inputs = run_inputs(run, kind)
    model_config = inputs.model_config
    ds_config = eng.prepare_ds_config(ds_config_path, run, process_group.world_size())
    resume_from = prepare_resume(resume, run, model_config, ds_config, dry_run, allow_changes)
    data = kind.load_data(run, inputs)
    check_resume_data(resume_from, data.fingerprint, run)
    task = kind.make_task(run, inputs, data)
    saved = ckpt.read_saved_run(resume_from) if resume_from is not None else None
    world = process_group.world_size()
    total, recount = resumed_total(run, len(data.sampler), saved, world, data.fingerprint)
    if recount and process_group.rank() == 0:
        log.warning(recount)
    engine, _ = build_engine(
        inputs.local, model_config, ds_config, total, len(data.dataset), False, resume_from, as_written=run
    )
    tokenizer_name = recorded_tokenizer(run, inputs.tokenizer_dir)
    resolved = resolution(run, inputs.local, inputs.tokenizer_dir, inputs.source)
    trainer = make_trainer(
        run,
        engine,
        model_config,
        task,
        total,
        resume_from,
        tokenizer_name,
        data.fingerprint,
        faults,
        resolved,
        before_first_write=lambda: change_output_dir(resume, resume_from, run),
    )
    if process_group.rank() == 0:  # a finished run's summary is not this run's, until it ends
        (Path(run.train.output_dir) / FINISHED_SUMMARY).unlink(missing_ok=True)
    summary = trainer.train()
    summary.update(
        {"total_updates": total, "tokenizer": inputs.tokenizer_dir, "output_dir": run.train.output_dir}
    )
    if kind.summarise is not None:
        kind.summarise(run, summary, trainer, task, data, total)
    return summary
