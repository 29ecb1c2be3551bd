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
from mdlmpe_ds.data.sft_encode import SFTDataStats, build_sft_dataset, eos_pad_id
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
    if len(dataset) == 0:
        raise ValueError(no_examples_message(source, stats, d.max_len))
    losses = length_losses(stats, d.max_len)
    if losses:
        log.warning(f"data {source}: {stats.summary()}: {losses}")
    else:
        log.info(f"data {source}: {stats.summary()}")
    return dataset, fingerprint


#: The share of examples dropped or cut for length above which the run warns: a few long outliers
#: are normal, but past this max_len is likely too small for the data (or the data not the one meant).
LARGE_LENGTH_LOSS = 0.1


def _lengths(stats: SFTDataStats, max_len: int) -> str:
    """The lengths to choose ``max_len`` by, and the flag: 'the longest example is 95 tokens, the
    median 40: raise --max_len (data.max_len, now 16; 95 keeps every example whole)'."""
    if not stats.longest:  # a cache written before lengths were counted
        return f"raise --max_len (data.max_len, now {max_len})"
    return (
        f"the longest example is {stats.longest} tokens, the median {stats.median_length}: raise "
        f"--max_len (data.max_len, now {max_len}; {stats.longest} keeps every example whole)"
    )


def length_losses(stats: SFTDataStats, max_len: int) -> str | None:
    """Why a large share of the examples is dropped or cut at ``max_len``, with the counts, or None.

    A truncated answer loses its end of turn (the model learns answers that never end) and a dropped
    example is lost data: past ``LARGE_LENGTH_LOSS`` this is a warning, not a count in an INFO line."""
    lost = stats.dropped + stats.truncated
    if not stats.candidates or lost < LARGE_LENGTH_LOSS * stats.candidates:
        return None
    parts = []
    if stats.dropped:
        fills = f"the prompt alone fills --max_len {max_len}"
        parts.append(f"{stats.dropped} of {stats.candidates} examples dropped: {fills}")
    if stats.truncated:
        n = stats.shortest_cut
        shortest = f" (to as few as {n} answer token{'s' * (n != 1)})" if n else ""
        parts.append(
            f"{stats.truncated} of {stats.candidates} answers cut at --max_len {max_len}{shortest}, "
            "without their end of turn"
        )
    return "; ".join(parts) + f"; {_lengths(stats, max_len)}"


def no_examples_message(source: str, stats: SFTDataStats, max_len: int) -> str:
    """Why ``source`` gave no example: every row skipped as malformed, or every example too long."""
    if stats.dropped:
        skipped = f", {stats.skipped} malformed rows skipped" if stats.skipped else ""
        return (
            f"{source}: no usable SFT examples: all {stats.dropped} examples ({stats.rows} rows{skipped}) "
            f"were dropped as too long, their prompts alone fill --max_len {max_len}; "
            f"{_lengths(stats, max_len)}"
        )
    reasons = ", ".join(f"{k} ({n})" for k, n in sorted(stats.skip_reasons.items(), key=lambda kv: -kv[1]))
    return (
        f"{source}: no usable SFT examples: all {stats.rows} rows were malformed and skipped "
        f"(--skip_malformed true){f': {reasons}' if reasons else ''}"
    )


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
