"""An SFT run assembled: tokenizer, chat data, sampler and collator, the engine, the SFT task and
the trainer (``run_sft``). The demo's tokenizer and chat data are prepared offline
(``data/assets.py``) when no dataset or tokenizer is named.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mdlmpe_ds import engine as eng
from mdlmpe_ds.config import RunConfig
from mdlmpe_ds.faults import NO_FAULTS, Faults
from mdlmpe_ds.runs.common import (
    assert_same_on_all_ranks,
    build_engine,
    check_resume_data,
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


def run_sft(
    run: RunConfig,
    ds_config_path: str,
    resume: str | None = None,
    dry_run: bool = False,
    faults: Faults = NO_FAULTS,
    allow_changes: list[str] | None = None,
) -> dict:
    """Build everything in the ZeRO-3 order and train. Call inside `engine.distributed_session`
    (except dry runs, which build on the meta device and need no process group). ``faults``: test
    hooks (mdlmpe_ds/faults.py)."""
    from transformers import AutoTokenizer

    from mdlmpe_ds.data.sampler import LengthGroupedSampler
    from mdlmpe_ds.data.sft import SFTCollator, eos_pad_id
    from mdlmpe_ds.hub.resolve import resolve_run_names
    from mdlmpe_ds.tasks.sft import SFTTask
    from mdlmpe_ds.trainer import Trainer

    world, rank = eng.world_size(), eng.rank()
    t = run.train
    resolve_run_names(run)  # hub ids -> local snapshots (rank 0 downloads first)
    tok_dir, source = resolve_sources(run)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    model_config = model_config_for(run, tokenizer)
    ds_config = eng.prepare_ds_config(ds_config_path, run, world)
    resume_from = prepare_resume(resume, run, model_config, ds_config, dry_run, allow_changes)

    dataset, fingerprint = build_sft_data(run, source, tokenizer, model_config.family)
    check_resume_data(resume_from, fingerprint, run)
    lengths = dataset.lengths
    sampler = LengthGroupedSampler(lengths, t.micro_batch_size, rank=rank, world_size=world, seed=t.seed)
    total = total_updates_for(run, len(sampler))
    collator = SFTCollator(
        eos_pad_id(tokenizer),
        max_len=run.data.max_len,
        attend_padding=run.data.attend_padding,
        perbatch_cutoff=run.data.perbatch_cutoff,
        resp_cutoff_ratio=run.data.resp_cutoff_ratio,
        pad_to_multiple_of=run.data.pad_to_multiple_of,
        seed=t.seed,
    )
    compiled = model_config.position_encoding == "mdlmpe" and run.attention.compile
    if compiled and not run.data.pad_to_multiple_of and run.data.perbatch_cutoff == "none":
        log.warning(
            "attention.compile with batches as wide as their longest row: every new width "
            "compiles the attention again (eager after 8); set data.pad_to_multiple_of, e.g. 64"
        )
    engine, built = build_engine(run, model_config, ds_config, total, len(dataset), dry_run, resume_from)
    if engine is None:
        return built
    task = SFTTask(t, model_config, dataset, sampler, collator)
    trainer = Trainer(
        run, engine, model_config, task, total, resume_from, str(tok_dir), fingerprint, faults=faults
    )
    summary = trainer.train()
    summary.update({"total_updates": total, "tokenizer": str(tok_dir), "output_dir": t.output_dir})
    return summary
