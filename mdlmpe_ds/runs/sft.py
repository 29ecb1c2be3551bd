"""An SFT run assembled: tokenizer, chat data, sampler and collator, the engine, the SFT task and
the trainer (``run_sft``). The demo's tokenizer and chat data are prepared offline
(``data/assets.py``) when no dataset or tokenizer is named.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from mdlmpe_ds import engine as eng
from mdlmpe_ds.config import RunConfig
from mdlmpe_ds.faults import NO_FAULTS, Faults
from mdlmpe_ds.runs.common import (
    assert_same_on_all_ranks,
    build_engine,
    check_resume_data,
    dry_run_plan,
    load_tokenizer_dir,
    model_config_for,
    prepare_resume,
    rank_zero_first,
    total_updates_for,
)

log = logging.getLogger(__name__)

DEMO_DATASET = "chat-demo"


def demo_assets() -> tuple[Path, Path]:
    """(Qwen2.5 tokenizer dir, chat.jsonl) prepared offline by data/assets.py (rank 0 first)."""
    from mdlmpe_ds.data.assets import ensure_assets

    paths = rank_zero_first(lambda: ensure_assets(parts=("qwen_tokenizer", "chat")))
    return paths.qwen_tokenizer_dir, paths.chat_jsonl


def resolve_sources(run: RunConfig) -> tuple[str, str]:
    """(tokenizer dir, dataset source) after the demo defaults are filled in."""
    d, m = run.data, run.model
    tokenizer, dataset = d.tokenizer, d.dataset
    if dataset == DEMO_DATASET or (tokenizer is None and m.model_name_or_path is None):
        tok_dir, chat = demo_assets()
        if dataset == DEMO_DATASET:
            dataset = str(chat)
        if tokenizer is None and m.model_name_or_path is None:
            tokenizer = str(tok_dir)
    if tokenizer is None:
        tokenizer = m.model_name_or_path
    return tokenizer, dataset


def build_sft_data(run: RunConfig, source: str, tokenizer, family: str):
    """The tokenised SFT dataset of ``source`` (each node's first rank builds and caches it first)
    and its fingerprint, checked equal on every rank."""
    from mdlmpe_ds.data.fingerprint import sft_fingerprint
    from mdlmpe_ds.data.sft import build_sft_dataset

    d = run.data
    dataset, stats = rank_zero_first(
        lambda: build_sft_dataset(
            source,
            tokenizer,
            family,
            d.max_len,
            split=d.split,
            skip_malformed=d.skip_malformed,
            multiturn=d.multiturn,
            # keyed by source (its datasets fingerprint), tokenizer, template and settings; built by
            # each node's first rank, loaded by the others; data.store_dir shares it across runs
            cache_dir=Path(run.data.store_dir or Path(run.train.output_dir) / "data_cache"),
            seed=run.train.seed,  # the turn drawn by multiturn="sample"
        )
    )
    fingerprint = sft_fingerprint(dataset, tokenizer)  # one digest: ranks agree, the checkpoint matches
    assert_same_on_all_ranks(fingerprint, f"{source}: the ranks built different SFT datasets")
    log.info(f"data {source}: {stats.summary()}")
    if len(dataset) == 0:
        raise ValueError(f"{source}: no usable SFT examples")
    return dataset, fingerprint


@dataclasses.dataclass
class SFTInputs:
    """What an SFT run reads before its engine: the local copy of the run (hub ids resolved), the
    tokenizer, the model config, and (after ``load_data``) the tokenised data, sampler and collator."""

    local: RunConfig
    tokenizer_dir: str
    source: str
    tokenizer: Any
    model_config: Any
    dataset: Any = None
    fingerprint: str = ""
    sampler: Any = None
    collator: Any = None


def sft_inputs(run: RunConfig) -> SFTInputs:
    """Resolve the hub ids (rank 0 downloads first; ``run`` keeps the ids), load the tokenizer and
    make the model config."""
    from mdlmpe_ds.hub.resolve import local_run

    local = local_run(run)
    tok_dir, source = resolve_sources(local)
    tokenizer = load_tokenizer_dir(tok_dir)
    return SFTInputs(local, str(tok_dir), source, tokenizer, model_config_for(local, tokenizer))


def load_data(run: RunConfig, inputs: SFTInputs) -> SFTInputs:
    """Tokenise (or load from the cache) the chat data, and make this rank's sampler and the collator."""
    from mdlmpe_ds.data.sampler import LengthGroupedSampler
    from mdlmpe_ds.data.sft import SFTCollator, eos_pad_id

    t, d = run.train, run.data
    family = inputs.model_config.family
    inputs.dataset, inputs.fingerprint = build_sft_data(run, inputs.source, inputs.tokenizer, family)
    lengths = inputs.dataset.lengths
    inputs.sampler = LengthGroupedSampler(
        lengths, t.micro_batch_size, rank=eng.rank(), world_size=eng.world_size(), seed=t.seed
    )
    inputs.collator = SFTCollator(
        eos_pad_id(inputs.tokenizer),
        max_len=d.max_len,
        attend_padding=d.attend_padding,
        perbatch_cutoff=d.perbatch_cutoff,
        resp_cutoff_ratio=d.resp_cutoff_ratio,
        pad_to_multiple_of=d.pad_to_multiple_of,
        seed=t.seed,
    )
    compiled = inputs.model_config.position_encoding == "mdlmpe" and run.attention.compile
    if compiled and not d.pad_to_multiple_of and d.perbatch_cutoff == "none":
        log.warning(
            "attention.compile with batches as wide as their longest row: every new width "
            "compiles the attention again (eager after 8); set data.pad_to_multiple_of, e.g. 64"
        )
    return inputs


def run_sft(
    run: RunConfig,
    ds_config_path: str,
    resume: str | None = None,
    dry_run: bool = False,
    faults: Faults = NO_FAULTS,
    allow_changes: list[str] | None = None,
) -> dict:
    """Build everything in the ZeRO-3 order and train. Call inside `engine.distributed_session`
    (except dry runs, which plan from the model's config alone on the meta device and need no
    process group). ``faults``: test hooks (mdlmpe_ds/faults.py)."""
    from mdlmpe_ds.callbacks import callbacks_for
    from mdlmpe_ds.hub.resolve import recorded_tokenizer
    from mdlmpe_ds.tasks.sft import SFTTask
    from mdlmpe_ds.trainer import Trainer

    if dry_run:  # from the model's config alone: no weights, no tokenizer, no data
        return dry_run_plan(run, ds_config_path, resume)
    t = run.train
    inputs = sft_inputs(run)
    model_config = inputs.model_config
    ds_config = eng.prepare_ds_config(ds_config_path, run, eng.world_size())
    resume_from = prepare_resume(resume, run, model_config, ds_config, dry_run, allow_changes)
    load_data(run, inputs)
    check_resume_data(resume_from, inputs.fingerprint, run)
    total = total_updates_for(run, len(inputs.sampler))
    engine, _ = build_engine(
        inputs.local, model_config, ds_config, total, len(inputs.dataset), False, resume_from, as_written=run
    )
    task = SFTTask(t, model_config, inputs.dataset, inputs.sampler, inputs.collator)
    tokenizer_name = recorded_tokenizer(run, inputs.tokenizer_dir)
    hooks = callbacks_for(run, model_config, faults)
    fingerprint = inputs.fingerprint
    trainer = Trainer(
        run, engine, model_config, task, total, resume_from, tokenizer_name, fingerprint, callbacks=hooks
    )
    summary = trainer.train()
    summary.update({"total_updates": total, "tokenizer": inputs.tokenizer_dir, "output_dir": t.output_dir})
    return summary
