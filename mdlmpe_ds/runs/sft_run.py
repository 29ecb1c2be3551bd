"""An SFT run: its tokenizer and chat data, sampler, collator and task, assembled into a run by
runs/assembly.py (``run_sft``). The demo's tokenizer and chat data are prepared offline
(``data/assets.py``) when no dataset or tokenizer is named.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mdlmpe_ds.config.run import RunConfig
from mdlmpe_ds.data.assets import ensure_assets
from mdlmpe_ds.data.fingerprint import sft_fingerprint
from mdlmpe_ds.data.sampler import LengthGroupedSampler
from mdlmpe_ds.data.sft_collate import SFTCollator
from mdlmpe_ds.data.sft_encode import build_sft_dataset, eos_pad_id
from mdlmpe_ds.distributed import process_group
from mdlmpe_ds.runs.assembly import RunData, RunInputs, RunKind, assemble_and_train, run_inputs, store_dir
from mdlmpe_ds.runs.common import assert_same_on_all_ranks, rank_zero_first
from mdlmpe_ds.tasks.sft import SFTTask
from mdlmpe_ds.training.faults import NO_FAULTS, Faults

log = logging.getLogger(__name__)

DEMO_DATASET = "chat-demo"


def demo_assets() -> tuple[Path, Path]:
    """(Qwen2.5 tokenizer dir, chat.jsonl) prepared offline by data/assets.py (rank 0 first)."""

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
            cache_dir=store_dir(run),
            seed=run.train.seed,  # the turn drawn by multiturn="sample"
        )
    )
    fingerprint = sft_fingerprint(dataset, tokenizer)  # one digest: ranks agree, the checkpoint matches
    assert_same_on_all_ranks(fingerprint, f"{source}: the ranks built different SFT datasets")
    log.info(f"data {source}: {stats.summary()}")
    if len(dataset) == 0:
        raise ValueError(f"{source}: no usable SFT examples")
    return dataset, fingerprint


def sft_inputs(run: RunConfig) -> RunInputs:
    """Resolve the hub ids (rank 0 downloads first; ``run`` keeps the ids), load the tokenizer and
    make the model config."""
    return run_inputs(run, SFT)


def load_data(run: RunConfig, inputs: RunInputs) -> RunData:
    """Tokenise (or load from the cache) the chat data, and make this rank's sampler and the collator."""

    t, d = run.train, run.data
    family = inputs.model_config.family
    dataset, fingerprint = build_sft_data(run, inputs.source, inputs.tokenizer, family)
    sampler = LengthGroupedSampler(
        dataset.lengths,
        t.micro_batch_size,
        rank=process_group.rank(),
        world_size=process_group.world_size(),
        seed=t.seed,
    )
    collator = SFTCollator(
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
    return RunData(dataset, fingerprint, sampler, collator)


def make_task(run: RunConfig, inputs: RunInputs, data: RunData):

    return SFTTask(run.train, inputs.model_config, data.dataset, data.sampler, data.collator)


SFT = RunKind(sources=resolve_sources, load_data=load_data, make_task=make_task)


def run_sft(
    run: RunConfig,
    ds_config_path: str,
    resume: str | None = None,
    dry_run: bool = False,
    faults: Faults = NO_FAULTS,
    allow_changes: list[str] | None = None,
) -> dict:
    """Build everything in the ZeRO-3 order and train an SFT run (runs/assembly.py). Call inside
    `engine.distributed_session` (except dry runs). ``faults``: test hooks (mdlmpe_ds/training/faults.py)."""
    return assemble_and_train(SFT, run, ds_config_path, resume, dry_run, faults, allow_changes)
