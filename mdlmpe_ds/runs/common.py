"""What every training run assembles before its loop: the model config, the output directory and
resume point, the model and its DeepSpeed engine, the plan, and the checks that all ranks hold the
same data. ``runs/sft_run.py`` and ``runs/pretrain_run.py`` put these together with their own data.
"""

from __future__ import annotations

import functools
import logging
import math
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mdlmpe_ds import run_lock
from mdlmpe_ds.config.run import RunConfig
from mdlmpe_ds.distributed import collectives, process_group
from mdlmpe_ds.distributed import engine as eng
from mdlmpe_ds.hub.resolve import local_run
from mdlmpe_ds.lora import attach as lora_attach
from mdlmpe_ds.models.hf_config import read_hf_config, tokenizer_load_options
from mdlmpe_ds.models.hf_io import load_weights_into
from mdlmpe_ds.models.presets import preset
from mdlmpe_ds.models.transformer import DiffusionLM
from mdlmpe_ds.training import checkpoint as ckpt
from mdlmpe_ds.training import resume_changes, weights_only
from mdlmpe_ds.training.memory_plan import plan_memory

log = logging.getLogger(__name__)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer_dir(directory: str | Path):
    """``AutoTokenizer`` of a local directory; a directory without tokenizer files (e.g. a model
    directory holding only config.json and weights) is named as such, with what to pass instead."""
    from transformers import AutoTokenizer

    path = Path(directory)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{path}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); pass --tokenizer DIR or "
            "a hub id, or add the tokenizer files to this directory (e.g. hf download ORG/NAME "
            f"--include 'tokenizer*' --local-dir {path})"
        )
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, **tokenizer_load_options(path))


def model_config_for(run: RunConfig, tokenizer):
    """The backbone's ModelConfig: a preset with ids from the tokenizer, or a pretrained directory's
    config; then this run's position encoding and MDLMPE knobs (L_ref = data.max_len unless set).
    Checkpointing is not part of it: ``run.recompute()`` is passed at build (``build_model``).
    ``tokenizer`` None (a dry run): a preset keeps its own vocabulary and ids unless the run sets them."""
    import dataclasses

    m = run.model
    mdlmpe = run.mdlmpe_config().validate()
    if m.model_name_or_path is not None:
        base = read_hf_config(m.model_name_or_path)
        if base.max_seq_len != run.data.max_len and process_group.rank() == 0:
            log.warning(max_len_note(m.model_name_or_path, base.max_seq_len, run.data.max_len))
        # L_ref of MDLMPE is the run's max length, and the model config must agree with it.
        return dataclasses.replace(
            base, max_seq_len=run.data.max_len, mdlmpe=mdlmpe, position_encoding=m.position_encoding
        ).validate()
    if tokenizer is None:
        own = preset(m.preset)
        ids = {
            "vocab_size": m.vocab_size or own.vocab_size,
            "mask_token_id": own.mask_token_id if m.mask_token_id is None else m.mask_token_id,
            "eos_token_id": own.eos_token_id if m.eos_token_id is None else m.eos_token_id,
        }
        ids["pad_token_id"] = m.pad_token_id if m.pad_token_id is not None else ids["eos_token_id"]
        return preset(
            m.preset, **ids, max_seq_len=max(run.data.max_len, 8), mdlmpe=mdlmpe,
            position_encoding=m.position_encoding,
        )  # fmt: skip
    vocab = m.vocab_size if m.vocab_size is not None else _round_up(len(tokenizer), 64)
    mask_id = m.mask_token_id
    if mask_id is None:
        mask_id = tokenizer.mask_token_id
        if mask_id is None:
            mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
            if mask_id is None or mask_id == tokenizer.unk_token_id:
                own = _preset_with_mask_for(m.preset, len(tokenizer))
                mask_id, vocab = own.mask_token_id, m.vocab_size or own.vocab_size
    eos = m.eos_token_id if m.eos_token_id is not None else tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token; set model.eos_token_id")
    pad = m.pad_token_id if m.pad_token_id is not None else eos
    if vocab < len(tokenizer):
        raise ValueError(f"model.vocab_size={vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    return preset(
        m.preset,
        vocab_size=vocab,
        mask_token_id=int(mask_id),
        eos_token_id=int(eos),
        pad_token_id=int(pad),
        max_seq_len=max(run.data.max_len, 8),
        mdlmpe=mdlmpe,
        position_encoding=m.position_encoding,
    )


def max_len_note(source: str, base_len: int, run_len: int) -> str:
    """Why the fine-tuned model's max length is the run's, not the base's: a fine-tune of LLaDA-8B
    (4096) at --max_len 2048 exports max_sequence_length 2048, and generate/evaluate then refuse
    longer inputs; past the base's length, RoPE runs beyond what the base was trained on."""
    common = (
        f"the fine-tuned model's max length is --max_len {run_len}, not {source}'s {base_len}: it is "
        "MDLMPE's window reference L_ref (docs/method.md 'Window') and the export's max length"
    )
    if run_len > base_len:
        return f"{common}; {run_len} is past the {base_len} positions the base was trained on"
    return (
        f"{common}, so generate/evaluate will refuse longer inputs (train at --max_len {base_len} to keep it)"
    )


def _preset_with_mask_for(name: str, tokenizer_size: int):
    """The preset whose own mask id (and table size) serve when the tokenizer declares no mask token:
    LLaDA's tokenizer has none, and its model config's 126336 is the source of truth. Only when the
    preset's table covers the tokenizer; else the error naming the key to set."""

    own = preset(name)
    if own.vocab_size >= tokenizer_size:
        return own
    raise ValueError(
        f"the tokenizer has no mask token (<|mask|>) and preset {name}'s table ({own.vocab_size}) does not "
        f"cover its {tokenizer_size} tokens; set model.mask_token_id"
    )


def updates_per_epoch(num_batches_per_rank: int, grad_accum: int) -> int:
    return max(1, num_batches_per_rank // grad_accum)


def total_updates_for(run: RunConfig, num_batches_per_rank: int) -> int:
    if run.train.max_steps is not None:
        return run.train.max_steps
    return max(1, math.ceil(run.train.epochs * updates_per_epoch(num_batches_per_rank, run.train.grad_accum)))


def saved_grad_accum(saved: ckpt.SavedRun, run: RunConfig) -> int:
    """The checkpoint's grad_accum (this run's where the record lacks it): with its world size, the
    micro-batches each of its updates took."""
    return int(saved.run_config.get("train", {}).get("grad_accum", run.train.grad_accum))


def resumed_total(
    run: RunConfig, num_batches_per_rank: int, saved: ckpt.SavedRun | None, world: int, fingerprint: str
) -> tuple[int, str | None]:
    """The run's total updates, and a note to log when resuming changed how it is counted.

    An ``--epochs`` run counts its total in updates of micro_batch_size x grad_accum x world
    sequences. Resumed on another number of ranks or another grad_accum, its updates hold another
    number of sequences, so recounting the epochs from scratch would end it early (1 -> 2 ranks)
    or train past its epochs (2 -> 1). The updates the saved plan had left are converted to the
    new size instead, and the plan itself (``saved.total_updates``) is carried from checkpoint to
    checkpoint, so a second resume on the new size keeps it. A ``--max_steps`` run, a changed
    ``--epochs`` (resume_changes: the new total applies) and other data (``fingerprint`` is not
    the checkpoint's: train.allow_data_change) count from scratch."""
    fresh = total_updates_for(run, num_batches_per_rank)
    if saved is None or run.train.max_steps is not None:
        return fresh, None
    if saved.data_fingerprint not in (None, fingerprint):
        return fresh, None
    was = saved.run_config.get("train", {})
    if was.get("max_steps") is not None or was.get("epochs") != run.train.epochs:
        return fresh, None
    before = saved_grad_accum(saved, run) * saved.world_size
    now = run.train.grad_accum * world
    planned = saved.total_updates
    if planned is None:  # a checkpoint from before the record: its plan, recounted at its size
        if before == now:
            return fresh, None
        batches = num_batches_per_rank * world // saved.world_size
        planned = max(1, math.ceil(run.train.epochs * updates_per_epoch(batches, before // saved.world_size)))
    if before == now:
        return planned, None
    left = max(0, planned - saved.step)
    total = saved.step + math.ceil(left * before / now)
    return total, (
        f"--epochs {run.train.epochs:g}: the checkpoint (update {saved.step} of {planned}) took "
        f"{before} micro-batches per update, this run takes {now}; its {left} remaining updates are "
        f"{total - saved.step} now, so the run ends at update {total} (the lr cosine and the head "
        "schedule follow the new total)"
    )


def describe_plan(
    run: RunConfig, model_config, world: int, total: int | None, n_examples: int | None, params: dict
) -> str:
    """The run's plan with its units. ``n_examples`` / ``total`` None: a dry run, which reads no data."""
    t = run.train
    per_update = t.micro_batch_size * t.grad_accum * world
    scheduled = t.head_schedule and model_config.position_encoding == "mdlmpe"
    name = run.model.model_name_or_path or run.model.preset
    if run.model.revision:
        name += f" (revision {run.model.revision})"
    if n_examples is None:
        data = f"data: {run.data.dataset} (not read in a dry run), max_len {run.data.max_len} tokens"
    else:
        data = f"data: {n_examples:,} examples, max_len {run.data.max_len} tokens"
    if total is None:
        updates = f"updates: {t.epochs:g} epochs of the data (counted when it is read; not in a dry run)"
    else:
        warmup = run.warmup_updates(total)
        updates = f"updates: {total:,} (warmup {warmup:,} updates, cosine {run.optim.cosine})"
        if t.max_steps is None:  # the updates were counted from it (resumed_total, after a resize)
            updates += f", {t.epochs:g} epoch{'' if t.epochs == 1 else 's'}"
        elif n_examples is not None:
            updates += f", ~{total * per_update / max(1, n_examples):.2f} epochs"
        if warmup >= total:
            updates += (
                f"\nwarning: the warmup ({warmup:,} updates) spans the whole run ({total:,}): the learning "
                "rate never reaches its peak; lower --warmup_steps or raise --max_steps"
            )
    return "\n".join(
        [
            f"model: {name} ({model_config.family}), position encoding {model_config.position_encoding}, "
            f"vocabulary {model_config.vocab_size:,} tokens",
            f"parameters: backbone {params['backbone']:,}  mdlmpe {params['mdlmpe']:,}  "
            f"total {params['total']:,}",
            data,
            f"batch: micro {t.micro_batch_size} x grad_accum {t.grad_accum} x world {world} = {per_update} "
            f"sequences per update (at most {per_update * run.data.max_len:,} tokens)",
            updates,
            f"head schedule: {'on' if scheduled else 'off'};"
            f" checkpoints every {t.save_every} updates into {Path(t.output_dir) / 'checkpoints'}"
            f" (keep the last {t.keep_last})",
        ]
    )


def assert_same_on_all_ranks(fingerprint: str, what: str) -> None:
    """Raise ``what`` (with every rank's digest) unless all ranks hold the same hex ``fingerprint``
    (data/fingerprint.py: the sampler indexes the data globally, so every rank must hold the same)."""
    if not dist.is_initialized():
        return
    mine = torch.tensor(list(bytes.fromhex(fingerprint)), dtype=torch.uint8)  # [32], host: gloo
    gathered = collectives.all_gather(mine, setup=True)
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        raise RuntimeError(f"{what} (fingerprints {[bytes(g.tolist()).hex()[:16] for g in gathered]})")


#: The folder of output_dir where ``--resume auto`` sets an earlier run's records aside when it
#: finds no checkpoint to continue (``restarts_without_checkpoint``).
EARLIER_RUNS = "earlier_runs"
#: What a run leaves in output_dir besides its checkpoints: its history and its weights-only saves.
RECORDS = ("metrics.jsonl", "tensorboard", weights_only.WEIGHTS)


def earlier_run(output_dir: str | Path) -> list[str]:
    """What another run left in ``output_dir`` (names): its checkpoint directories, a non-empty
    metrics.jsonl, a non-empty tensorboard/, its weights-only saves (weights/). The history counts
    as much as the checkpoints: a run whose checkpoints were deleted after its export still has its
    only record there."""
    out = Path(output_dir)
    found = [p.name for p in ckpt.existing_run(out)]
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append("metrics.jsonl")
    board = out / "tensorboard"
    if board.is_dir() and any(board.iterdir()):
        found.append("tensorboard/")
    if weights_only.weights_saves(out):
        found.append(f"{weights_only.WEIGHTS}/")
    return found


def starts_new_history(resume: str | None, output_dir: str | Path) -> bool:
    """Whether this run writes a new history into ``output_dir``: it does not resume, or it resumes
    from a checkpoint outside ``output_dir`` (another run's, continued here)."""
    if resume is None:
        return True
    if resume == "auto":
        return False
    return not Path(resume).resolve().is_relative_to(Path(output_dir).resolve())


def restarts_without_checkpoint(resume: str | None, output_dir: str | Path) -> bool:
    """``--resume auto`` where output_dir holds no checkpoint directory: a new run starts there.
    It is the one command a requeued job repeats, so it must not refuse (a job killed before its
    first save has only a short history), but what an earlier run left there must not be truncated
    or written over either (a run whose checkpoints were deleted after its export)."""
    return resume == "auto" and not ckpt.existing_run(output_dir)


def set_records_aside(output_dir: str | Path) -> Path:
    """Rank 0: move output_dir's ``RECORDS`` into a new ``earlier_runs/run-<time>/``; returns it."""
    out = Path(output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = out / EARLIER_RUNS / f"run-{stamp}", 1
    while dest.exists():  # two restarts within a second
        dest, n = out / EARLIER_RUNS / f"run-{stamp}-{n}", n + 1
    dest.mkdir(parents=True)
    for name in RECORDS:
        if (out / name).exists():
            (out / name).rename(dest / name)
    ckpt.fsync_dir(out)
    return dest


def prepare_output_dir(resume: str | None, run: RunConfig, dry_run: bool = False) -> None:
    """Rank 0, then everyone: finish or discard what a killed save left; refuse an output_dir
    holding another run (``earlier_run``) when this run starts a new history there
    (``starts_new_history``), unless train.overwrite_output_dir, whose deletion waits for
    ``clear_overwritten``: after the data, the model and the engine are built, so that a typo in
    the command does not cost the earlier run. A dry run only checks."""
    t = run.train
    if process_group.rank() == 0:
        if not dry_run:  # before anything in output_dir is touched (run_lock.py)
            run_lock.acquire(t.output_dir, log=log.warning)
        for action in [] if dry_run else ckpt.recover_interrupted(t.output_dir):
            log.info(action)
        earlier = earlier_run(t.output_dir)
        if earlier and starts_new_history(resume, t.output_dir):
            if not t.overwrite_output_dir:
                source = "" if resume is None else f", and --resume {resume} is a checkpoint outside it"
                raise FileExistsError(
                    f"{t.output_dir} already holds a run ({', '.join(earlier)}){source}. "
                    f"Continue it with --resume auto, or start over with --overwrite_output_dir true "
                    f"(deletes its checkpoints, metrics and TensorBoard logs once this run's data, "
                    f"model and engine are ready), or pick another --output_dir"
                )
            verb = "would delete" if dry_run else "will delete, once the data, model and engine are ready,"
            log.info(f"--overwrite_output_dir: the run {verb} the earlier run in {t.output_dir}")
        elif earlier and restarts_without_checkpoint(resume, t.output_dir):
            fate = "delete" if t.overwrite_output_dir else f"move to {Path(t.output_dir) / EARLIER_RUNS}/"
            log.warning(
                f"--resume auto: {t.output_dir} holds no checkpoint to continue from, only an earlier "
                f"run's {', '.join(earlier)}: starting a new run. It will {fate} them once its data, "
                "model and engine are ready (a job stopped before then leaves them as they are)"
            )
    process_group.barrier()
    if not dry_run:
        check_output_dir_shared(t.output_dir)


def clear_overwritten(resume: str | None, run: RunConfig) -> None:
    """Collective, after the engine is built and before the trainer writes anything: with
    train.overwrite_output_dir, delete the earlier run that ``prepare_output_dir`` found (its
    checkpoints, metrics.jsonl, TensorBoard logs and weights-only saves); without it, a
    ``--resume auto`` that found no checkpoint sets the earlier run's records aside
    (``set_records_aside``) instead of truncating its history."""
    t = run.train
    out = Path(t.output_dir)
    if process_group.rank() == 0 and earlier_run(out):
        restart = restarts_without_checkpoint(resume, out)
        if t.overwrite_output_dir and (restart or starts_new_history(resume, out)):
            for stale in (ckpt.checkpoints_root(out), out / "tensorboard", out / weights_only.WEIGHTS):
                shutil.rmtree(stale, ignore_errors=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
            log.info(f"--overwrite_output_dir: removed the earlier run's checkpoints and logs in {out}")
        elif restart:
            moved = set_records_aside(out)
            log.warning(f"--resume auto found no checkpoint: the earlier run's records are now in {moved}")
    process_group.barrier()


def set_newer_aside(resume_from: Path | None, run: RunConfig) -> None:
    """Collective, once the trainer has loaded ``resume_from`` (every check passed): checkpoints
    newer than it move to checkpoints/superseded/ (checkpoint.supersede_newer). Not before: a
    resume refused by any check (another model, data, world size) must leave them where
    ``--resume auto`` finds them."""
    if resume_from is not None and process_group.rank() == 0:
        for moved in ckpt.supersede_newer(run.train.output_dir, resume_from):
            log.info(f"moved {moved.name} aside to {moved} (newer than the checkpoint resumed from)")
    process_group.barrier()


#: Seconds a rank keeps looking for the run lock rank 0 wrote before calling output_dir unshared
#: (a network filesystem may show another node's new file a moment late).
SHARED_DIR_WAIT_S = 10.0


def check_output_dir_shared(output_dir: str | Path, wait_s: float = SHARED_DIR_WAIT_S) -> None:
    """Raise on every rank unless every rank sees, in ``output_dir``, the run lock rank 0 has just
    written there (run_lock.py). Collective; before any data, model or engine work.

    Why: a multi-node run whose output_dir is a node-local disk (the same path on each node, a
    different directory) would otherwise train to the end and lose every checkpoint. Each rank
    writes its own ZeRO-3 shards into step_N.saving on its own disk, rank 0 commits the step on
    its node only, and the other nodes' shards stay in step_N.saving, which the next start
    deletes as the debris of an interrupted save; no checkpoint can be resumed. Nothing here
    supports node-local checkpoints, so the run stops before it trains, naming the ranks and hosts
    that do not see rank 0's directory."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    host = socket.gethostname()
    views = collectives.all_gather_object((host, run_lock.read(output_dir)), setup=True)
    written, seen = views[0][1], views[process_group.rank()][1]
    deadline = time.monotonic() + wait_s
    while seen != written and time.monotonic() < deadline:
        time.sleep(0.5)
        seen = run_lock.read(output_dir)
    outcomes = collectives.all_gather_object((host, seen == written), setup=True)
    blind = [(r, h) for r, (h, ok) in enumerate(outcomes) if not ok]
    if blind:
        lock = Path(output_dir) / run_lock.LOCK
        who = ", ".join(f"rank {r} on {h}" for r, h in blind)
        raise RuntimeError(
            f"--output_dir {output_dir} is not one directory for every rank: {who} "
            f"{'does' if len(blind) == 1 else 'do'} not see "
            f"the run lock {lock} that rank 0 on {views[0][0]} wrote there (waited {wait_s:g} s). "
            "A multi-node run must write to a filesystem every node mounts at the same path (NFS, "
            "Lustre, ...): each rank writes its own ZeRO-3 shards of every checkpoint and rank 0 "
            "commits them, so on node-local disks no checkpoint could be resumed. Nothing was trained"
        )


def prepare_resume(
    resume: str | None,
    run: RunConfig,
    model_config,
    ds_config: dict,
    dry_run: bool = False,
    allow_changes: list[str] | None = None,
) -> Path | None:
    """The checkpoint to resume from (None: a fresh run), verified against its manifest and checked
    against this run's config (resume_changes.py: ``allow_changes`` are the keys of
    --allow_config_change) and model before any data or engine work (checkpoints newer than it are
    moved aside only once it has loaded: ``set_newer_aside``); a checkpoint of another world size
    switches the engine to its universal copy, once that is verified (``check_universal_copy``)."""
    prepare_output_dir(resume, run, dry_run)
    resume_from = ckpt.resolve_resume(resume, run.train.output_dir, log=log.warning)  # damage skipped
    process_group.barrier()  # every rank has verified before rank 0 may move anything
    if resume_from is None:
        return None
    saved = ckpt.read_saved_run(resume_from)
    allowed = resume_changes.parse_allowed(allow_changes)
    # "auto" keys compare what they resolved to: the checkpoint's record and this run's ds config
    at_save = {key: saved.resolved_value(key) for key in resume_changes.RESOLVED_KEYS}
    here = {"train.precision": eng.resolved_precision(ds_config)}
    for line in resume_changes.check_resume_config(
        saved.run_config, run.to_dict(), allowed, resume_from, (at_save, here)
    ):
        log.info(line)
    ckpt.check_same_model(saved, model_config.to_dict())
    world = process_group.world_size()
    if saved.world_size != world:
        check_universal_copy(resume_from, saved.world_size, world)
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
        log.info(f"resuming a {saved.world_size}-rank checkpoint on {world} ranks from its universal copy")
    change = per_update_change(run, saved.world_size, saved_grad_accum(saved, run), world)
    if change:
        log.warning(change)
    return resume_from


def per_update_change(run: RunConfig, saved_world: int, saved_accum: int, world: int) -> str | None:
    """The note of a resume whose updates hold another number of sequences than the checkpoint's
    (another world size, or a forced grad_accum): the global batch changes from here on. None when
    they hold as many."""
    mb = run.train.micro_batch_size
    before, now = mb * saved_accum * saved_world, mb * run.train.grad_accum * world
    if before == now:
        return None
    length = (
        "the run keeps its total updates (--max_steps), so it sees "
        + ("more" if now > before else "fewer")
        + " sequences than planned"
        if run.train.max_steps is not None
        else "an --epochs run converts its remaining updates to the new size"
    )
    return (
        f"an update now holds {now} sequences (micro {mb} x grad_accum {run.train.grad_accum} x world "
        f"{world}), the checkpoint's held {before} (grad_accum {saved_accum} x world {saved_world}): "
        f"the global batch changes from here on, and {length}"
    )


def check_universal_copy(resume_from: Path, saved_world: int, world: int) -> None:
    """Raise on every rank, naming the bad file and the command that rebuilds it, unless
    ``resume_from``'s universal copy is sealed and matches its manifest (checkpoint.universal_problems).
    Rank 0 reads the files and every rank gets its answer (one collective): a large copy is not
    read once per rank."""
    problems = ckpt.universal_problems(resume_from) if process_group.rank() == 0 else None
    problems = collectives.all_gather_object(problems, setup=True)[0]
    if problems is None or problems:
        raise RuntimeError(eng.load_universal_instructions(resume_from, saved_world, world, problems or ()))


def build_model(run: RunConfig, model_config, ds_config: dict, dry_run: bool):
    """The model under ZeRO-3: weights created partitioned with the run's seed (the same on every
    rank), MDLMPE initialised, a pretrained directory streamed in. A dry run builds on the meta
    device only. The one place a run's model is made (and wrapped, e.g. by adapters)."""

    torch.manual_seed(run.train.seed)  # same initial weights on every rank
    build = functools.partial(DiffusionLM, model_config, impl=run.attention, recompute=run.recompute())
    model = eng.build_model(build, ds_config, meta=dry_run)
    if not dry_run:
        eng.init_mdlmpe_parameters(model)
        if run.model.model_name_or_path is not None:
            load_weights_into(model, run.model.model_name_or_path, gathered=eng.gathered_factory())
    return model


def build_engine(
    run: RunConfig,
    model_config,
    ds_config: dict,
    total: int | None,
    n_examples: int | None,
    dry_run: bool,
    resume_from: Path | None = None,
    as_written: RunConfig | None = None,
):
    """The model under ZeRO-3 (weights created partitioned, MDLMPE initialised, a pretrained
    directory streamed in) and its DeepSpeed engine; logs the plan. Returns (engine, result) where a
    dry run builds on the meta device only and returns (None, {plan, total_updates, params}).
    ``run`` holds the local directories to read; ``as_written`` the names the plan shows."""
    model = build_model(run, model_config, ds_config, dry_run)
    params = {"backbone": model.num_backbone_parameters(), "mdlmpe": model.num_mdlmpe_parameters()}
    params["total"] = params["backbone"] + params["mdlmpe"]
    plan = describe_plan(
        as_written or run, model_config, process_group.world_size(), total, n_examples, params
    )
    plan += lora_attach.attach(model, run, ds_config, resume_from, params, meta=dry_run)  # LoRA runs only

    # A CPU machine plans for GPUs when told bf16 (the documented way); fp32 there is a CPU run.
    cpu_ranks = process_group.on_cpu() and not ds_config.get("bf16", {}).get("enabled")
    memory = plan_memory(
        model_config, ds_config, process_group.world_size(), run.train.micro_batch_size, run.data.max_len,
        impl=run.attention, recompute=run.recompute(), device="cpu" if cpu_ranks else "cuda",
        **lora_attach.memory_plan_kwargs(params),
    )  # fmt: skip
    plan += "\n" + memory.format()
    if dry_run:
        log.info("dry run (meta device, nothing allocated):\n" + plan)
        return None, {
            "plan": plan,
            "total_updates": total,
            "params": params,
            "memory_gib": memory.total / 2**30,
        }
    log.info(plan)
    return eng.initialize(model, ds_config, run, total), {"plan": plan, "params": params}


def dry_run_plan(run: RunConfig, ds_config_path: str, resume: str | None = None) -> dict:
    """``--dry-run``: the plan from the model's config alone. A hub id fetches its config.json only;
    no weights, tokenizer or data are read (the vocabulary is the config's). Validates the config and
    the ds config's batch arithmetic, builds the model on the meta device, prints the plan."""

    local = local_run(run, config_only=True)
    model_config = model_config_for(local, tokenizer=None)
    ds_config = eng.prepare_ds_config(ds_config_path, run, process_group.world_size())
    resume_from = prepare_resume(resume, run, model_config, ds_config, dry_run=True)
    total = run.train.max_steps
    _, built = build_engine(local, model_config, ds_config, total, None, True, resume_from, as_written=run)
    if run.model.model_name_or_path is None and run.model.vocab_size is None and process_group.rank() == 0:
        log.warning(PRESET_VOCABULARY_NOTE.format(vocab=model_config.vocab_size, preset=run.model.preset))
    return built


#: A dry run of a preset reads no tokenizer, so it plans with the preset's own vocabulary; the real
#: run sizes the embeddings from its tokenizer (the SFT demo's Qwen2.5: 151,680 rows, 19.5 M
#: parameters against the preset's 0.17 M), so its parameters and memory are larger than planned.
PRESET_VOCABULARY_NOTE = (
    "dry run: the plan uses the {preset} preset's own vocabulary ({vocab:,} tokens); the real run sizes "
    "the embeddings from its tokenizer, so its parameter count and memory can be much larger "
    "(pass --vocab_size to plan with the tokenizer's size)"
)


def check_resume_data(resume_from: Path | None, fingerprint: str, run: RunConfig) -> None:
    """Refuse to resume on other data than the checkpoint's (train.allow_data_change overrides)."""
    if resume_from is None:
        return
    warning = ckpt.check_same_data(ckpt.read_saved_run(resume_from), fingerprint, run.train.allow_data_change)
    if warning:
        log.warning(warning)


def rank_zero_first(build: Callable[[], Any]) -> Any:
    """``build()`` on each node's local rank 0, then on the node's other ranks: `datasets` writes
    its Arrow cache (and we our tokenizer and data caches) on first use, and ranks building it at
    the same time were seen to disagree; the others then read what their node's first rank cached.

    Nodes build at the same time (their caches may be one shared folder: the writes are atomic
    renames). The waits are on the setup group (``train.setup_timeout_min``), before and after the
    others' build, so no rank waits for data on the short collective timeout.
    """
    first = collectives.local_rank() == 0
    if first:
        out = build()
    collectives.setup_barrier("data setup on each node's first rank")
    if not first:
        out = build()
    collectives.setup_barrier("data setup on the other ranks")
    return out
