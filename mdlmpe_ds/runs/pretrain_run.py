"""A pretraining run assembled (paper §4.3, Appendix B): the tokenizer (``data.tokenizer``, else the
model directory's, else a SentencePiece BPE of ``data.tokenizer_vocab`` pieces trained on the corpus
and cached by content), the packed corpus and validation windows, the engine, the pretraining task
and the trainer (``run_pretrain``). Its command line is launch/pretrain.py's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import socket
from pathlib import Path

from mdlmpe_ds.config.run import RunConfig
from mdlmpe_ds.data.assets import default_cache_dir
from mdlmpe_ds.data.corpora import corpus_text_files, load_packed_corpus
from mdlmpe_ds.data.fingerprint import packed_fingerprint
from mdlmpe_ds.data.packing import packed_collate
from mdlmpe_ds.data.sampler import LengthGroupedSampler
from mdlmpe_ds.data.spm_tokenizer import train_sentencepiece
from mdlmpe_ds.diffusion.elbo import scored_positions
from mdlmpe_ds.distributed import process_group
from mdlmpe_ds.runs.assembly import (
    FINISHED_SUMMARY,
    RunData,
    RunInputs,
    RunKind,
    assemble_and_train,
    store_dir,
)
from mdlmpe_ds.runs.common import assert_same_on_all_ranks, rank_zero_first
from mdlmpe_ds.tasks.pretrain import PretrainTask
from mdlmpe_ds.training.faults import NO_FAULTS, Faults

log = logging.getLogger(__name__)


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
        rank=process_group.rank(),
        world_size=process_group.world_size(),
        seed=t.seed,
    )
    return RunData(dataset, fingerprint, sampler, packed_collate)


def make_task(run: RunConfig, inputs: RunInputs, data: RunData):
    """The pretraining task with its validation windows (read on each node's first rank first)."""

    family = inputs.model_config.family
    validation = rank_zero_first(lambda: validation_batches(run, inputs.tokenizer, family))
    return PretrainTask(
        run.train, inputs.model_config, data.dataset, data.sampler, data.collator, validation=validation
    )


def summarise(run: RunConfig, summary: dict, trainer, task, data: RunData, total: int) -> None:
    t, world = run.train, process_group.world_size()
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
    (mdlmpe_ds/training/faults.py)."""
    return assemble_and_train(PRETRAIN, run, ds_config_path, resume, dry_run, faults, allow_changes)


def write_summary(out: Path, summary: dict) -> None:
    """``summary.json`` (written last, atomically): the run finished; compare_pe.py reuses it. A run
    that starts training removes it first (runs/assembly.py)."""
    tmp = out / f"{FINISHED_SUMMARY}.tmp"
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    tmp.replace(out / FINISHED_SUMMARY)
