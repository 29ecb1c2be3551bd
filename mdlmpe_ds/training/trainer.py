"""The training loop on a DeepSpeed ZeRO-3 engine: updates, metrics, when to save, exact resume.

What is trained is a task (``mdlmpe_ds/tasks``: batches, corruption, loss); what else a run does
is its callbacks (callback.py hooks; callbacks.py: the MDLMPE head schedule and statistics, LoRA's
checkpoint policy, the non-finite policy, stop handling, test faults), handed in by the run; the
save and resume protocol is the checkpointer's (checkpointer.py). This loop is the same for SFT and
pretraining, and imports neither ``lora`` nor ``pe``. One optimizer update n (0-based) is:
  1. the callbacks' ``before_update`` (e.g. the active KV heads of alpha(n), per update, not per
     micro-batch);
  2. for each of grad_accum micro-batches: the task's corruption, forward and loss; backward;
  3. DeepSpeed's step at the accumulation boundary (clipping, AdamW, lr scheduler). A non-finite
     gradient norm makes ZeRO-3 skip the update (and the lr scheduler) on every rank alike; the loop
     counts it (a flag every rank already agrees on, not a scan of the weights) and a callback
     decides what it means;
  4. one host all-reduce of the update's sums and the ranks' stop votes; metrics; a checkpoint when
     one is due and every callback allows it (else it waits for the next update that is allowed);
     after a checkpoint, the stop votes once more: a stop that arrived while it was written ends the
     run there, with that checkpoint as the stop's save (callbacks.StopHandling).

Everything that decides the next batch and the next noise draw -- engine state (DeepSpeed), sampler
position, counters, RNG states -- is in every checkpoint, so a resumed run repeats the straight run's
losses, lr and gradient norms bit for bit, in fp32 and in bf16 (tests/dist/test_sft_resume.py), given
the same world size and, on the CPU, the same intra-op thread count (OMP_NUM_THREADS: the order in
which CPU kernels add partial sums depends on it; a resume with another count is warned about).
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mdlmpe_ds.config.run import RunConfig
from mdlmpe_ds.distributed import collectives
from mdlmpe_ds.distributed import engine as eng
from mdlmpe_ds.distributed import process_group as distributed
from mdlmpe_ds.tasks import Task
from mdlmpe_ds.training.callback import Callback, NonFiniteError, Stopped
from mdlmpe_ds.training.checkpointer import Checkpointer, RunMeta
from mdlmpe_ds.training.tracking import make_tracker

__all__ = ["NonFiniteError", "Stopped", "Trainer", "TrainerState"]

log = logging.getLogger(__name__)

T_BUCKETS = 10


@dataclass
class TrainerState:
    """Counters that, with DeepSpeed's state and the sampler's, define where the run is."""

    step: int = 0  # optimizer updates attempted (applied + skipped): the head schedule's n
    micro_step: int = 0  # micro-batches consumed by this rank: the noise generator's step
    samples_seen: int = 0  # global
    tokens_seen: int = 0  # global, non-padding tokens
    nonfinite_total: int = 0
    nonfinite_consecutive: int = 0
    sampler: dict[str, Any] = field(default_factory=dict)


def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


class Trainer:
    """Owns the engine, the task, the counters and the checkpointer of one run; ``callbacks``
    (callbacks.callbacks_for) do the rest, in list order."""

    def __init__(
        self,
        run: RunConfig,
        engine,
        model_config,
        task: Task,
        total_updates: int,
        resume_from: Path | None,
        tokenizer_dir: str = "",
        data_fingerprint: str | None = None,
        callbacks: Sequence[Callback] = (),
        resolved: dict | None = None,
        before_first_write: Callable[[], None] | None = None,
    ) -> None:
        """``before_first_write``: called on every rank once ``resume_from`` has loaded and before
        the tracker writes into output_dir (the run assembly's stop check and output_dir changes:
        runs/assembly.change_output_dir), so a cancelled or refused resume leaves the history as it
        was."""
        self.run, self.engine, self.model_config, self.task = run, engine, model_config, task
        self.total_updates = total_updates
        self.callbacks = list(callbacks)
        self.stop_requested = False
        self.rank, self.world = distributed.rank(), distributed.world_size()
        self.state = TrainerState()
        self.save_pending = False  # a save a callback deferred: write it after the next allowed update
        meta = RunMeta(run, model_config, str(tokenizer_dir), data_fingerprint, resolved or {}, total_updates)
        self.checkpointer = Checkpointer(run.train.output_dir, run.train.keep_last, meta, self.callbacks)
        if resume_from is not None:
            self._resume(resume_from)
        if before_first_write is not None:
            before_first_write()
        self.tracker = make_tracker(self.rank, run.train.output_dir, total_updates, self.state.step)
        self.checkpointer.say = self.tracker.print
        if resume_from is not None:
            self.tracker.print(f"resumed from {resume_from} (update {self.state.step}/{total_updates})")

    @property
    def last_good(self) -> Path | None:
        """The newest complete checkpoint this run wrote or resumed from."""
        return self.checkpointer.last_good

    # ---------------------------------------------------------------- one update
    def _update(self, batches) -> dict[str, float]:
        t = self.run.train
        update = self.state.step
        before: dict[str, float] = {}
        for cb in self.callbacks:
            before.update(cb.before_update(self, update))
        lr = float(self.engine.get_lr()[0])  # the lr this update uses
        loss_sum, tokens, samples = 0.0, 0, 0
        bucket_sum = [0.0] * T_BUCKETS
        bucket_cnt = [0.0] * T_BUCKETS
        for _ in range(t.grad_accum):
            micro = self.task.micro(self.engine, next(batches), self.state.micro_step, self.rank)
            loss = micro.loss
            for cb in self.callbacks:
                loss = cb.micro_loss(self, update, loss)
            self.engine.backward(loss)
            self.engine.step()
            self.state.micro_step += 1
            loss_sum += float(loss.detach())
            tokens += micro.tokens
            samples += micro.samples
            for b, (nll, count) in enumerate(
                zip(micro.stats.bucket_nll.tolist(), micro.stats.bucket_count.tolist())
            ):
                bucket_sum[b] += nll
                bucket_cnt[b] += count
        applied = bool(self.engine.was_step_applied())
        for cb in self.callbacks:
            cb.after_steps(self, update)
        # The stop votes ride on the update's own all-reduce, so every rank sees the same sum and
        # stops after the same update, wherever its signal arrived.
        stop = 1.0 if any([cb.wants_stop(self) for cb in self.callbacks]) else 0.0
        reduced = collectives.all_reduce_sum([loss_sum, tokens, samples, *bucket_sum, *bucket_cnt, stop])
        self.stop_requested = reduced[-1] > 0
        reduced = reduced[:-1]
        loss_mean = reduced[0] / (t.grad_accum * self.world)
        self.state.step += 1
        self.state.tokens_seen += int(reduced[1])
        self.state.samples_seen += int(reduced[2])
        finite = applied and math.isfinite(loss_mean)
        if finite:
            self.state.nonfinite_consecutive = 0
        else:
            self.state.nonfinite_total += 1
            self.state.nonfinite_consecutive += 1
        grad_norm = self.engine.get_global_grad_norm()
        out = {
            "train/loss": loss_mean,
            "train/lr": lr,
            "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "train/samples_seen": float(self.state.samples_seen),
            "train/tokens_seen": float(self.state.tokens_seen),
            "train/nonfinite_skipped": float(self.state.nonfinite_total),
            "train/update_applied": float(finite),
            **before,
            "_tokens": reduced[1],
        }
        sums, counts = reduced[3 : 3 + T_BUCKETS], reduced[3 + T_BUCKETS :]
        # unweighted per-token CE of the masked tokens (the loss itself carries 1/p weights)
        out["train/nll"] = sum(sums) / max(sum(counts), 1.0)
        out["train/masked_tokens"] = sum(counts)  # loss positions of this update, all ranks
        for b in range(T_BUCKETS):
            if counts[b] > 0:
                # unweighted per-token NLL of the masked tokens whose row has t in this bucket
                out[f"nll_by_t/{b / T_BUCKETS:.1f}-{(b + 1) / T_BUCKETS:.1f}"] = sums[b] / counts[b]
        return out

    # ---------------------------------------------------------------- loop
    def train(self) -> dict[str, Any]:
        """Run to total_updates; returns a summary (per-update losses, lrs, fractions, paths)."""
        t = self.run.train
        history: list[dict[str, float]] = []
        for cb in self.callbacks:
            cb.on_start(self)
        batches = self.task.batches()
        self.engine.train()
        try:
            # A run resumed at or past train.stop_at trains nothing more (the summary says so).
            while self.state.step < self.total_updates and not (
                t.stop_at is not None and self.state.step >= t.stop_at
            ):
                start = time.perf_counter()
                metrics = self._update(batches)
                elapsed = time.perf_counter() - start
                tokens = metrics.pop("_tokens")
                metrics["train/tokens_per_s"] = tokens / max(elapsed, 1e-9)
                metrics["memory/peak_gb"] = peak_memory_gb()
                step = self.state.step
                for cb in self.callbacks:
                    metrics.update(cb.on_metrics(self, step, metrics))
                metrics.update(
                    self.task.periodic_metrics(self.engine, step, self.total_updates, self.tracker.print)
                )
                # a stop that arrived during the validation: save now, not after one more update
                self.stop_requested = self.stop_requested or self.task.evaluation_stopped
                self.tracker.scalars(step, metrics)
                history.append(
                    {
                        "step": step,
                        "loss": metrics["train/loss"],
                        "lr": metrics["train/lr"],
                        "active_head_fraction": metrics.get("mdlmpe/active_head_fraction", 0.0),
                    }
                )
                remaining = (self.total_updates - step) * elapsed
                self.tracker.progress(
                    step,
                    {
                        "loss": f"{metrics['train/loss']:.4f}",
                        "tok/s": f"{metrics['train/tokens_per_s']:.0f}",
                        "eta": f"{remaining:.0f}s",
                    },
                )
                stopping = t.stop_at is not None and step >= t.stop_at
                end = step == self.total_updates or stopping
                for cb in self.callbacks:
                    cb.after_update(self, step, end or self.stop_requested)
                due = step % t.save_every == 0 or end or self.save_pending
                if (due or self.stop_requested) and not all(
                    [cb.can_save(self, step) for cb in self.callbacks]
                ):
                    self.save_pending = True
                elif self.stop_requested:
                    self._stop(step)
                elif due:
                    self.save()
                    self.save_pending = False
                    # A stop that arrived while the save was written: that save is the stop's save.
                    self.stop_requested = not end and self._stop_voted()
                    if self.stop_requested:
                        self._stop(step)
                if stopping:
                    self.tracker.print(
                        f"stopping at update {step} (train.stop_at); resume with --resume auto"
                    )
                    break
        finally:
            self.tracker.close()
        for cb in self.callbacks:  # e.g. all heads at the end and at inference
            cb.on_end(self)
        return {
            "history": history,
            "step": self.state.step,  # the update reached (< total_updates after train.stop_at)
            "last_checkpoint": str(self.last_good) if self.last_good else None,
            "tensorboard": str(Path(t.output_dir) / "tensorboard"),
        }

    def _stop_voted(self) -> bool:
        """The callbacks' stop votes, agreed over the ranks (one host all-reduce; collective), for the
        points between updates where no update's all-reduce carries them (after a save)."""
        mine = 1.0 if any([cb.wants_stop(self) for cb in self.callbacks]) else 0.0
        return collectives.all_reduce_max([mine])[0] > 0

    def _stop(self, step: int) -> None:
        """Every rank agreed to stop after update ``step``: the callbacks save what the run asks for
        and raise ``Stopped`` (callbacks.StopHandling); without a stop handler, stop unsaved."""
        for cb in self.callbacks:
            cb.on_stop(self, step)
        raise Stopped(f"stopped after update {step}: nothing saved (no stop handler)", 143)

    # ---------------------------------------------------------------- checkpoints
    def save(self) -> Path:
        """A full checkpoint of this update (checkpointer.py); collective."""

        def trainer_state() -> dict[str, Any]:
            self.state.sampler = self.task.sampler.state_dict()
            return asdict(self.state)

        return self.checkpointer.save(self.engine, self.state.step, trainer_state)

    def save_weights(self) -> Path:
        """The model weights only (train.save_on_signal model); not resumable. Collective."""
        return self.checkpointer.save_weights(self.engine, self.state.step)

    def _resume(self, path: Path) -> None:
        state, saved_world = self.checkpointer.resume(self.engine, path)
        # DeepSpeed restored the saved optimizer groups and base lrs: this run's optim keys win
        # (resume_changes.py "applied").
        eng.apply_optim_settings(self.engine, self.run, self.total_updates)
        self.state = TrainerState(**state["trainer"])
        # Same global micro-batch sequence on any world size (the sampler re-cuts its groups).
        changed = self.run.train.allow_data_change
        for note in self.task.sampler.load_state_dict(self.state.sampler, data_changed=changed):
            log.warning(f"resume on other data (train.allow_data_change): {note}")
        if saved_world != self.world:
            self.state.micro_step = resumed_micro_step(self.state.micro_step, saved_world, self.world)


def resumed_micro_step(saved: int, saved_world: int, world: int) -> int:
    """Where a resume on another world size starts each rank's micro-step, the SFT noise key's third
    part (seed, rank, micro_step: docs/data.md section 5; the data position is the sampler's, not this).

    Every rank of the saved run (and of every run before it) drew only micro-steps below ``saved``:
    the ranks step together and the counter only grows. Starting at ``saved`` or later therefore
    never repeats a key, whichever ranks the new run has; the global count scaled to the new world
    size (larger when the world shrinks) is kept where it is larger. Only called on another world size:
    on the same one the counter is restored as saved, and the resume repeats the straight run."""
    return max(saved, saved * saved_world // world)
