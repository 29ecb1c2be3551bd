"""The save and resume protocol of a training run, on every rank: one ``save``, one ``resume``.

A save (``Checkpointer.save``), in order:
  1. rank 0 creates ``step_N.saving`` (debris of an earlier attempt at this step is removed);
     barrier;
  2. every rank writes its part: DeepSpeed's shards, its trainer state (counters, sampler position,
     RNG, numerics); rank 0 also the config (``checkpoint.write_meta``) and the callbacks' files
     (LoRA's adapter list); barrier, so no ``.tmp`` is left when anyone flushes;
  3. every rank fsyncs what it can see of the staging directory; barrier;
  4. rank 0 commits (``finalize``: manifest, COMPLETE, the atomic swap into ``step_N`` and
     ``latest``), then prunes beyond keep-last (only now that the new one is complete); barrier.
A full disk or an exceeded quota anywhere in it is reported as one error naming the checkpoint
(``disk_full_named``); any other failure there gains a note naming it.

A resume (``Checkpointer.resume``): the checkpoint's model must be this run's; the callbacks may
refuse it (LoRA: every adapter and MDLMPE key there); DeepSpeed loads its shards (its universal
copy on another world size); this rank's trainer state is read and, on the same world size, the
RNG states are restored. The file format shared with the readers is checkpoint.py.

The universal copy (``write_universal``, one process, launch/convert_checkpoint.py) follows the same
rule as a save: written into a scratch folder, fsync'd, sealed with its own manifest and COMPLETE,
then renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mdlmpe_ds.distributed import engine as eng
from mdlmpe_ds.distributed import process_group as distributed
from mdlmpe_ds.training import checkpoint as ckpt
from mdlmpe_ds.training import weights_only
from mdlmpe_ds.training.callback import Callback
from mdlmpe_ds.training.checkpoint import COMPLETE, LATEST, MANIFEST, REPLACED, fsync_dir, fsync_write

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunMeta:
    """What every checkpoint's config.json records about the run besides its step and world size:
    ``run`` and ``model`` have ``to_dict()`` (read at each save, as the run is then); ``resolved``
    is what the run's names resolved to on this machine (hub.resolve.resolution)."""

    run: Any
    model: Any
    tokenizer: str
    data_fingerprint: str | None = None
    resolved: dict[str, Any] = field(default_factory=dict)
    total_updates: int | None = None  # the run's planned updates (runs/common.py: resumed_total)


class Checkpointer:
    """Writes and reads the checkpoints of one run under ``output_dir/checkpoints``; ``last_good``
    is the newest complete one this run wrote or resumed from. ``say`` prints on rank 0 (the
    tracker's console, set once the tracker exists)."""

    def __init__(
        self,
        output_dir: str | Path,
        keep_last: int,
        meta: RunMeta,
        hooks: Sequence[Callback] = (),
        say: Callable[[str], None] = print,
    ) -> None:
        self.output_dir, self.keep_last, self.meta = output_dir, keep_last, meta
        self.hooks, self.say = list(hooks), say
        self.rank, self.world = distributed.rank(), distributed.world_size()
        self.last_good: Path | None = None

    def _kwargs(self, which: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for hook in self.hooks:
            out.update(getattr(hook, which)())
        return out

    def _write_meta(self, staging: Path, step: int, engine) -> None:
        m = self.meta
        run, model = m.run.to_dict(), m.model.to_dict()
        resolved = self._resolved(engine)
        ckpt.write_meta(
            staging, step, self.world, run, model, m.tokenizer, m.data_fingerprint, resolved, m.total_updates
        )

    def _resolved(self, engine) -> dict[str, Any]:
        """``meta.resolved`` plus, when train.precision is not what the engine runs in ("auto"), the
        precision it ran in: DeepSpeed's optimizer state differs between bf16 and fp32, and "auto"
        resolves by machine and ds config, so a resume compares this (resume_changes.RESOLVED_KEYS)."""
        precision = "bf16" if engine.bfloat16_enabled() else "fp32"
        if precision == self.meta.run.train.precision:
            return self.meta.resolved
        return {**self.meta.resolved, "train.precision": {"value": precision, "commit": None}}

    # ---------------------------------------------------------------- save
    def save(self, engine, step: int, trainer_state: Callable[[], dict[str, Any]]) -> Path:
        """Checkpoint ``step`` (module docstring); ``trainer_state()`` is this rank's counters and
        sampler position, read after DeepSpeed's shards are written. Collective."""
        with disk_full_named(ckpt.step_dir(self.output_dir, step), self.last_good):
            return self._save(engine, step, trainer_state)

    def _save(self, engine, step: int, trainer_state: Callable[[], dict[str, Any]]) -> Path:
        start = time.perf_counter()
        final = ckpt.step_dir(self.output_dir, step)
        staging = ckpt.staging_dir(self.output_dir, step)
        if self.rank == 0:
            if staging.exists():  # debris of this step's earlier attempt (recovered at start)
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        distributed.barrier()
        # the callbacks' kwargs: LoRA does not write the frozen base again
        engine.save_checkpoint(
            str(staging), tag=ckpt.DS_TAG, save_latest=False, **self._kwargs("save_kwargs")
        )
        state = {"trainer": trainer_state(), "rng": rng_state(), "numerics": numerics_state()}
        ckpt.write_trainer_state(staging, self.rank, state)
        if self.rank == 0:
            self._write_meta(staging, step, engine)
            for hook in self.hooks:
                hook.on_save_meta(staging, engine.module)
        distributed.barrier()  # every rank's files are written (no .tmp left) before anyone flushes
        fsync_tree(staging)
        distributed.barrier()
        if self.rank == 0:
            for hook in self.hooks:
                hook.before_commit(step)
            finalize(staging, final)
            for gone in prune(self.output_dir, self.keep_last, keep=final):
                self.say(f"removed old checkpoint {gone}")
        distributed.barrier()
        self.last_good = final
        if self.rank == 0:  # the save's cost, for sizing preemption grace (docs/resume.md)
            size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
            took = time.perf_counter() - start
            self.say(f"saved checkpoint {final} ({size / 2**20:.1f} MiB in {took:.2f} s)")
        return final

    def save_weights(self, engine, step: int) -> Path:
        """train.save_on_signal model: each rank's partition of the weights only, in parallel
        (weights_only.py), atomically under ``output_dir/weights/step_N``. Not resumable."""

        final = weights_only.weights_dir(self.output_dir, step)
        staging = final.with_name(final.name + ckpt.STAGING)
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        distributed.barrier()
        weights_only.save_partitions(engine.module, staging, self.rank)
        distributed.barrier()
        if self.rank == 0:
            self._write_meta(staging, step, engine)
            weights_only.write_marker(engine.module, staging, self.world)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(staging, final)
        distributed.barrier()
        return final

    def last_good_advice(self) -> str:
        """Where to continue from after a failure (the non-finite errors)."""
        where = self.last_good or ckpt.newest_complete(self.output_dir)
        return (
            f"last good checkpoint: {where or 'none saved yet'}. Lower optim.lr or check the data, "
            f"then resume with --resume {where or 'auto'}"
        )

    # ---------------------------------------------------------------- resume
    def resume(self, engine, path: Path) -> tuple[dict[str, Any], int]:
        """Load checkpoint ``path`` into ``engine`` and restore this process's RNG (same world
        size); returns this rank's saved trainer state (rank 0's on another world size) and the
        world size that wrote it. Collective."""
        saved = ckpt.read_saved_run(path)
        ckpt.check_same_model(saved, self.meta.model.to_dict())
        # Another world size reads DeepSpeed's universal copy (the run assembly has switched the engine's
        # "checkpoint.load_universal" on and verified the copy: checkpoint.universal_problems).
        same_world = saved.world_size == self.world
        tag = ckpt.DS_TAG if same_world else ckpt.DS_UNIVERSAL_TAG
        for hook in self.hooks:
            hook.before_resume(path, engine.module)
        loaded, _ = engine.load_checkpoint(str(path), tag=tag, **self._kwargs("load_kwargs"))
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load {path}/{tag}")
        state = ckpt.read_trainer_state(path, self.rank if same_world else 0)
        if same_world:
            set_rng_state(state["rng"])
            differences = numerics_differences(state.get("numerics"))
            if differences and distributed.on_cpu():
                log.warning(
                    f"note: {path} was written with other CPU numerics ({'; '.join(differences)}): the "
                    f"resumed losses will differ from an uninterrupted run's in the last bits "
                    f"(set OMP_NUM_THREADS as at save for a bitwise continuation)"
                )
        self.last_good = path
        return state, saved.world_size


# ---------------------------------------------------------------------------- the steps
def fsync_tree(path: Path) -> None:
    """Flush every file below ``path`` (and the directories) to stable storage. Called by every rank
    on the files it can see after writing its own, so COMPLETE never precedes data in the page cache."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def seal(staging: Path, marker: str) -> None:
    """The manifest of the fsync'd files in ``staging``, then COMPLETE (holding ``marker``): what
    makes a directory verifiable (checkpoint.verify). Its files must be flushed before (fsync_tree)."""
    fsync_write(staging / MANIFEST, json.dumps({"files": ckpt.manifest_of(staging)}, indent=1))
    fsync_write(staging / COMPLETE, f"{marker}\n")


def finalize(staging: Path, final: Path) -> None:
    """Rank 0, after every rank's files are written and fsync'd (barrier): manifest, COMPLETE, then
    the atomic swap of ``staging`` into ``final`` and `latest`."""
    seal(staging, final.name)
    replaced = final.with_name(final.name + REPLACED)
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        os.rename(final, replaced)
    os.rename(staging, final)
    fsync_dir(final.parent)
    if replaced.exists():
        shutil.rmtree(replaced)
    fsync_write(final.parent / LATEST, f"{final.name}\n")


def write_universal(ckpt_dir: Path) -> Path:
    """DeepSpeed's universal copy of checkpoint ``ckpt_dir`` (its ``ds/`` shards; a step directory
    ``checkpoint.resolve_checkpoint`` has verified, as launch/convert_checkpoint.py does first),
    for a resume on another world size; one process. Returns the copy, ``ckpt_dir/ds_universal``.

    Atomic like a save: engine.ds_to_universal writes into the scratch folder
    ``ds_universal.converting/`` (a killed conversion's is removed first), whose copy is
    fsync'd and sealed (manifest, COMPLETE) before it is renamed into place; an older copy is
    replaced only then. A killed conversion leaves no ``ds_universal``, and a resume verifies the
    copy against its manifest (checkpoint.universal_problems), so no partial copy is ever loaded."""
    final = ckpt_dir / ckpt.DS_UNIVERSAL_TAG
    scratch = ckpt_dir / ckpt.UNIVERSAL_SCRATCH
    if scratch.exists():
        shutil.rmtree(scratch)
    staged = scratch / ckpt.DS_UNIVERSAL_TAG  # DeepSpeed's latest_universal lands in scratch/ too
    eng.ds_to_universal(ckpt_dir / ckpt.DS_TAG, staged)
    fsync_tree(staged)
    seal(staged, f"{ckpt.DS_UNIVERSAL_TAG} of {ckpt_dir.name}")
    if final.exists():  # an older or broken copy: out of the way only now
        os.rename(final, scratch / "replaced")
    os.rename(staged, final)
    fsync_dir(ckpt_dir)
    shutil.rmtree(scratch)
    return final


@contextlib.contextmanager
def disk_full_named(final: Path, last_good: Path | None) -> Iterator[None]:
    """Turn a full disk or an exceeded quota during a save into one error that says which and
    names the checkpoint. Torch's writer reports both as "PytorchStreamWriter failed writing file
    ...: file write failed", without the errno; a small write beside the checkpoint then asks the
    filesystem itself (``_space_errno``). Any other failure keeps its type and gains a note that
    names the checkpoint and the one a resume would continue from."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        code = _space_errno(err, final.parent)
        resume_from = last_good or "the start"
        if code is None:
            err.add_note(
                f"while saving checkpoint {final}: the partial save is removed at the next start, "
                f"and --resume auto continues from {resume_from}"
            )
            raise
        what, fix = ckpt.no_space_words(code)
        fix += " under it" if code == errno.EDQUOT else ""
        raise OSError(
            code,
            f"{what} while saving checkpoint {final} "
            f"({ckpt.free_mib(final.parent)} MiB free on its filesystem): the partial save is removed at "
            f"the next start; {fix} or move --output_dir, then --resume auto continues from "
            f"{resume_from}",
        ) from err


#: what ``_space_errno`` writes to ask the filesystem whether a save could go on (1 MiB: above
#: the block and page sizes a quota or a nearly full disk still lets through).
SPACE_PROBE_BYTES = 2**20


def _space_errno(err: BaseException, where: Path) -> int | None:
    """ENOSPC or EDQUOT when ``err`` is, or hides, a full disk or an exceeded quota; else None."""
    if isinstance(err, OSError) and err.errno in ckpt.NO_SPACE_ERRNOS:
        return err.errno
    if "No space left" in str(err):
        return errno.ENOSPC
    if "Disk quota exceeded" in str(err):
        return errno.EDQUOT
    if "file write failed" not in str(err) and "inline_container" not in str(err):
        return None
    # torch's writer: no errno. Write a probe beside the checkpoint and let its errno decide (a
    # quota leaves the disk's free space untouched, so the free space alone cannot tell).
    probe = where / f".space_probe.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            block = memoryview(bytes(SPACE_PROBE_BYTES))
            while block:  # a short write near the limit: the next one raises its errno
                block = block[os.write(fd, block) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as probe_err:
        if probe_err.errno in ckpt.NO_SPACE_ERRNOS:
            return probe_err.errno
        return None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    try:
        return errno.ENOSPC if shutil.disk_usage(where).free < 64 * 2**20 else None
    except OSError:
        return None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def numerics_state() -> dict[str, Any]:
    """What, besides the saved state, decides the floating-point results of the next updates.

    On the CPU the intra-op thread count does: a reduction (matmul, sum, norm) split over n threads
    adds its partial sums in an n-dependent order. With OMP_NUM_THREADS=2 instead of 1 the fp32 losses
    of the test run moved by ~1e-8 relative from update 4 on (deterministic for a fixed n), while two
    runs with the same count agree bit for bit, straight or resumed. The torch build changes kernels.
    """
    return {"intra_op_threads": torch.get_num_threads(), "torch": torch.__version__}


def numerics_differences(saved: dict[str, Any] | None) -> list[str]:
    """Why a resumed run may not repeat the straight run bit for bit (empty: it should)."""
    if not saved:
        return []
    now = numerics_state()
    return [
        f"{key} {saved.get(key)!r} at save, {value!r} now"
        for key, value in now.items()
        if saved.get(key) != value
    ]


def prune(output_dir: str | Path, keep_last: int, keep: Path) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last` (never ``keep``, the one just
    written); directories without COMPLETE older than the newest complete one are debris of
    interrupted saves from before atomic saving, and go too. Returns what was deleted."""
    complete = ckpt.complete_checkpoints(output_dir)
    doomed = [p for p in (complete[:-keep_last] if keep_last > 0 else []) if p != keep]
    root = ckpt.checkpoints_root(output_dir)
    if complete:
        newest_step = ckpt.step_of(complete[-1])
        for child in root.iterdir():
            match = ckpt.STEP_DIR.match(child.name)
            if match and not ckpt.is_complete(child) and int(match.group(1)) < newest_step:
                doomed.append(child)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=False)
    return doomed
