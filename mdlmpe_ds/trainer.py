"""The training loop on a DeepSpeed ZeRO-3 engine: head schedule per update, exact resume, logging.

What is trained is a task (``mdlmpe_ds/tasks``: batches, corruption, loss); this loop is the same
for SFT and pretraining. One optimizer update n (0-based) is:
  1. set the MDLMPE active KV heads to the first round(alpha(n) * H_kv) of the nested order
     (paper Eq. (27)) -- per update, not per micro-batch;
  2. for each of grad_accum micro-batches: the task's corruption, forward and loss; backward;
  3. DeepSpeed's step at the accumulation boundary (clipping, AdamW, lr scheduler). A non-finite
     gradient norm makes ZeRO-3 skip the update (and the lr scheduler) on every rank alike; we count
     it, and stop after `max_consecutive_nonfinite` in a row, pointing at the last good checkpoint.

Non-finite is never saved as good: a checkpoint is written only after an update whose loss and
gradient norm were finite (a flag every rank already agrees on, not a scan of the weights). A save
due at a non-finite update waits for the next finite one; a run whose last update was non-finite
writes no final checkpoint and exits non-zero (NonFiniteError). So every checkpoint this loop
writes is a finite one, and keep-last pruning, which runs only after such a save, keeps it.

Everything that decides the next batch and the next noise draw -- engine state (DeepSpeed), sampler
position, counters, RNG states -- is in every checkpoint, so a resumed run repeats the straight run's
losses, lr and gradient norms bit for bit, in fp32 and in bf16 (tests/dist/test_sft_resume.py), given
the same world size and, on the CPU, the same intra-op thread count (OMP_NUM_THREADS: the order in
which CPU kernels add partial sums depends on it; a resume with another count is warned about).
"""

from __future__ import annotations

import logging
import math
import os
import resource
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mdlmpe_ds import checkpoint as ckpt
from mdlmpe_ds import collectives, lifecycle, lora, stop_request
from mdlmpe_ds import engine as eng
from mdlmpe_ds.config import RunConfig
from mdlmpe_ds.faults import NO_FAULTS, Faults
from mdlmpe_ds.pe.heads import active_head_count, head_fraction, scheduled_kv_heads
from mdlmpe_ds.tasks import Task
from mdlmpe_ds.tracking import make_tracker

log = logging.getLogger(__name__)

T_BUCKETS = 10


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite updates."""


class Stopped(RuntimeError):
    """The run stopped on a signal or a lost launcher after saving a checkpoint; ``exit_code`` is
    128 + the signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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


def mdlmpe_stats(module: torch.nn.Module) -> dict[str, float]:
    """gamma of the embedding path and |delta| statistics of every phase MLP (one per layer, logged
    as ``layer{i}``, or the one shared by all layers, logged as ``shared``).

    |delta| is evaluated on a fixed sample of pair features s ~ U(-pi/2, pi/2)^F (the range of s,
    Eq. (37)), i.e. the size of the learned residual over its input domain, not on a
    training batch (that would need the L x L pair tensor). Collective under ZeRO-3 (gathers the
    small MDLMPE parameters on every rank); call on log steps only.
    """
    from mdlmpe_ds.pe.encoder import MDLMPEEncoder
    from mdlmpe_ds.pe.phase import PhaseMLP, phase_residual

    encoders = [m for m in module.modules() if isinstance(m, MDLMPEEncoder)]
    named_phases = [(n, m) for n, m in module.named_modules() if isinstance(m, PhaseMLP)]
    phases = [m for _, m in named_phases]
    params = [p for m in encoders + phases for p in m.parameters()]
    if not params:
        return {}
    out: dict[str, float] = {}
    with eng.gathered(params), torch.no_grad():
        for i, enc in enumerate(encoders):
            if getattr(enc, "gate_logit", None) is not None:
                out[f"mdlmpe/gamma/embedding{i if len(encoders) > 1 else ''}"] = float(enc.gamma)
        tau_max = encoders[0].config.tau_max if encoders else 0.25
        means, maxes = [], []
        for layer, (name, phase) in enumerate(named_phases):
            gen = torch.Generator().manual_seed(0)
            s = (torch.rand(256, phase.num_pairs, generator=gen) - 0.5) * math.pi  # [256, F]
            params_cpu = type(phase.params())(*(t.detach().float().cpu() for t in phase.params()))
            delta = phase_residual(s, params_cpu, tau_max).abs()  # [256, |M|]
            label = "shared" if name.split(".")[-1] == "shared_phase" else f"layer{layer}"
            out[f"mdlmpe/delta_abs_mean/{label}"] = float(delta.mean())
            means.append(float(delta.mean()))
            maxes.append(float(delta.max()))
        if phases:
            out["mdlmpe/delta_abs_mean"] = sum(means) / len(means)
            out["mdlmpe/delta_abs_max"] = max(maxes)
    return out


class Trainer:
    """Owns the engine, the task, the counters and the checkpoints of one run."""

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
        faults: Faults = NO_FAULTS,
    ) -> None:
        self.run, self.engine, self.model_config, self.task = run, engine, model_config, task
        self.total_updates = total_updates
        self.tokenizer_dir = str(tokenizer_dir)
        self.data_fingerprint = data_fingerprint
        self.faults = faults
        self.stop_requested = False
        self.rank, self.world = eng.rank(), eng.world_size()
        self.state = TrainerState()
        self.uses_mdlmpe = model_config.position_encoding == "mdlmpe"
        self.last_good: Path | None = None
        self.save_pending = False  # a save fell on a non-finite update: write it after the next finite one
        if resume_from is not None:
            self._resume(resume_from)
        self.tracker = make_tracker(self.rank, run.train.output_dir, total_updates, self.state.step)
        if resume_from is not None:
            self.tracker.print(f"resumed from {resume_from} (update {self.state.step}/{total_updates})")

    # ---------------------------------------------------------------- one update
    def _heads(self, update: int) -> float:
        """Apply alpha(n) to every layer; returns the active fraction actually set."""
        if not self.uses_mdlmpe:
            return 0.0
        h_kv = self.model_config.num_kv_heads
        if not self.run.train.head_schedule:
            self.engine.module.set_active_kv_heads(torch.ones(h_kv, dtype=torch.bool))
            return 1.0
        mask = scheduled_kv_heads(update, self.total_updates, h_kv)
        self.engine.module.set_active_kv_heads(mask)
        return active_head_count(head_fraction(update, self.total_updates), h_kv) / h_kv

    def _update(self, batches) -> dict[str, float]:
        t = self.run.train
        update = self.state.step
        fraction = self._heads(update)
        nan = update in self.faults.nan_updates
        lr = float(self.engine.get_lr()[0])  # the lr this update uses
        loss_sum, tokens, samples = 0.0, 0, 0
        bucket_sum = [0.0] * T_BUCKETS
        bucket_cnt = [0.0] * T_BUCKETS
        for _ in range(t.grad_accum):
            micro = self.task.micro(self.engine, next(batches), self.state.micro_step, self.rank)
            loss = micro.loss * float("nan") if nan else micro.loss
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
        if update == self.faults.stop_in_update:
            lifecycle.request_stop("received SIGTERM (test fault)", 128 + signal.SIGTERM)
        # The stop flag rides on the update's own all-reduce, so every rank sees the same sum and
        # stops after the same update, wherever its signal arrived.
        stop = 1.0 if lifecycle.stop_reason() is not None else 0.0
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
            "mdlmpe/active_head_fraction": fraction,
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
        stop_request.poll("setting up (before the first update)")
        stop_request.set_phase("training")
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
                if step % t.log_every == 0 or step == self.total_updates:
                    metrics.update(mdlmpe_stats(self.engine.module))
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
                        "active_head_fraction": metrics["mdlmpe/active_head_fraction"],
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
                if self.state.nonfinite_consecutive:
                    self.tracker.print(
                        f"update {step}: non-finite loss/gradient, update skipped "
                        f"({self.state.nonfinite_consecutive} in a row, {self.state.nonfinite_total} total)"
                    )
                finite = self.state.nonfinite_consecutive == 0
                if self.state.nonfinite_consecutive >= t.max_consecutive_nonfinite:
                    raise NonFiniteError(
                        f"{self.state.nonfinite_consecutive} consecutive non-finite updates (limit "
                        f"train.max_consecutive_nonfinite={t.max_consecutive_nonfinite}) at update {step}; "
                        + self._last_good_advice()
                    )
                stopping = t.stop_at is not None and step >= t.stop_at
                end = step == self.total_updates or stopping
                if not finite and (end or self.stop_requested):
                    self.save_pending = False
                    raise NonFiniteError(
                        f"the last update ({step}) was non-finite: no checkpoint written from it; "
                        + self._last_good_advice()
                    )
                due = step % t.save_every == 0 or end or self.save_pending
                if due and not finite:
                    self.save_pending = True
                    self.tracker.print(
                        f"update {step} was non-finite: its checkpoint waits for the next finite update"
                    )
                elif self.stop_requested:
                    self._save_on_stop(step)
                elif due:
                    self.save()
                    self.save_pending = False
                if stopping:
                    self.tracker.print(
                        f"stopping at update {step} (train.stop_at); resume with --resume auto"
                    )
                    break
        finally:
            self.tracker.close()
        if self.uses_mdlmpe:  # all heads at the end and at inference (docs/method.md "Head schedule")
            self.engine.module.set_active_kv_heads(
                torch.ones(self.model_config.num_kv_heads, dtype=torch.bool)
            )
        if self.faults.probe_logits is not None:
            self._probe_logits(Path(self.faults.probe_logits))
        return {
            "history": history,
            "step": self.state.step,  # the update reached (< total_updates after train.stop_at)
            "last_checkpoint": str(self.last_good) if self.last_good else None,
            "tensorboard": str(Path(t.output_dir) / "tensorboard"),
        }

    def _probe_logits(self, path: Path) -> None:
        """Test hook: logits of the engine (all heads, eval mode) on the first examples, saved by
        rank 0, to compare with an exported-and-reloaded model (tests/dist)."""
        batch = self.task.probe_batch()
        if "positions" in batch:
            raise RuntimeError(
                "the logits probe compares position-free forwards; run it without left padding"
            )
        self.engine.eval()
        with torch.no_grad():
            logits = self.engine(
                batch["input_ids"].to(self.engine.device), valid=batch["valid"].to(self.engine.device)
            )
        self.engine.train()
        state = eng.consolidated_state_dict(self.engine)  # collective; the trained weights (LoRA tests)
        if self.rank == 0:
            torch.save(
                {
                    "input_ids": batch["input_ids"],
                    "valid": batch["valid"],
                    "logits": logits.float().cpu(),
                    "state": state,
                },
                path,
            )

    def _last_good_advice(self) -> str:
        where = self.last_good or ckpt.newest_complete(self.run.train.output_dir)
        return (
            f"last good checkpoint: {where or 'none saved yet'}. Lower optim.lr or check the data, "
            f"then resume with --resume {where or 'auto'}"
        )

    def _save_on_stop(self, step: int) -> None:
        """A signal or a lost launcher stopped the run after a finite update: write what
        train.save_on_signal asks for, then raise Stopped (exit 128 + the signal number)."""
        choice = self.run.train.save_on_signal
        reason = lifecycle.stop_reason() or "another rank was asked to stop"
        code = lifecycle.exit_code() or 128 + signal.SIGTERM
        if choice == "full":
            self.save()
            raise Stopped(
                f"stopped after update {step} ({reason}); checkpoint {self.last_good} is complete: "
                f"continue with --resume auto",
                code,
            )
        if choice == "model":
            weights = self.save_weights()
            raise Stopped(
                f"stopped after update {step} ({reason}); model weights only in {weights} "
                f"(train.save_on_signal model: export them with python launch/export.py {weights} DIR); "
                f"--resume auto continues from the last full checkpoint, {self.last_good or 'none yet'}",
                code,
            )
        raise Stopped(
            f"stopped after update {step} ({reason}); nothing saved (train.save_on_signal none): "
            f"--resume auto continues from the last checkpoint, {self.last_good or 'none yet'}",
            code,
        )

    # ---------------------------------------------------------------- checkpoints
    def save(self) -> Path:
        """Everything into ``step_N.saving``: DeepSpeed shards, per-rank state, config; every rank
        fsyncs; barrier; rank 0 writes the manifest and COMPLETE and swaps the directory in as
        ``step_N`` (replacing an older copy atomically), then prunes (checkpoint.py). A full disk
        is reported as such, naming the checkpoint."""
        with ckpt.disk_full_named(ckpt.step_dir(self.run.train.output_dir, self.state.step), self.last_good):
            return self._save()

    def _save(self) -> Path:
        t = self.run.train
        start = time.perf_counter()
        final = ckpt.step_dir(t.output_dir, self.state.step)
        staging = ckpt.staging_dir(t.output_dir, self.state.step)
        if self.rank == 0:
            if staging.exists():  # debris of this step's earlier attempt (recovered at start)
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        eng.barrier()
        # LoRA: the frozen base is not written again (lora.checkpoint_save_kwargs)
        self.engine.save_checkpoint(
            str(staging), tag=ckpt.DS_TAG, save_latest=False, **lora.checkpoint_save_kwargs(self.run)
        )
        self.state.sampler = self.task.sampler.state_dict()
        ckpt.write_trainer_state(
            staging,
            self.rank,
            {"trainer": asdict(self.state), "rng": ckpt.rng_state(), "numerics": ckpt.numerics_state()},
        )
        if self.rank == 0:
            ckpt.write_meta(
                staging,
                self.state.step,
                self.world,
                self.run.to_dict(),
                self.model_config.to_dict(),
                self.tokenizer_dir,
                self.data_fingerprint,
            )
            lora.write_checkpoint_meta_of(staging, self.run, self.engine.module)  # LoRA runs only
        eng.barrier()  # every rank's files are written (no .tmp left) before anyone flushes
        ckpt.fsync_tree(staging)
        eng.barrier()
        if self.rank == 0:
            if self.faults.kill_in_save == self.state.step:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.faults.pause_in_save == self.state.step:
                time.sleep(self.faults.pause_s)
            ckpt.finalize(staging, final)
            for gone in ckpt.prune(t.output_dir, t.keep_last, keep=final):
                self.tracker.print(f"removed old checkpoint {gone}")
        eng.barrier()
        self.last_good = final
        if self.rank == 0:  # the save's cost, for sizing preemption grace (docs/resume.md)
            size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
            took = time.perf_counter() - start
            self.tracker.print(f"saved checkpoint {final} ({size / 2**20:.1f} MiB in {took:.2f} s)")
        return final

    def save_weights(self) -> Path:
        """train.save_on_signal model: each rank's partition of the weights only, in parallel
        (weights_only.py), atomically under ``output_dir/weights/step_N``. Not resumable."""
        from mdlmpe_ds import weights_only

        final = weights_only.weights_dir(self.run.train.output_dir, self.state.step)
        staging = final.with_name(final.name + ckpt.STAGING)
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        eng.barrier()
        weights_only.save_partitions(self.engine.module, staging, self.rank)
        eng.barrier()
        if self.rank == 0:
            ckpt.write_meta(
                staging, self.state.step, self.world, self.run.to_dict(), self.model_config.to_dict(),
                self.tokenizer_dir, self.data_fingerprint,
            )  # fmt: skip
            weights_only.write_marker(self.engine.module, staging, self.world)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(staging, final)
        eng.barrier()
        return final

    def _resume(self, path: Path) -> None:
        saved = ckpt.read_saved_run(path)
        ckpt.check_same_model(saved, self.model_config.to_dict())
        # Another world size reads DeepSpeed's universal copy (the run assembly has switched the engine's
        # "checkpoint.load_universal" on and checked that the copy exists).
        tag = ckpt.DS_TAG if saved.world_size == self.world else ckpt.DS_UNIVERSAL_TAG
        lora.check_resume(path, self.run, self.engine.module)  # adapter + MDLMPE keys all there
        loaded, _ = self.engine.load_checkpoint(str(path), tag=tag, **lora.checkpoint_load_kwargs(self.run))
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load {path}/{tag}")
        # DeepSpeed restored the saved optimizer groups and base lrs: this run's optim keys win
        # (resume_changes.py "applied").
        eng.apply_optim_settings(self.engine, self.run, self.total_updates)
        same_world = saved.world_size == self.world
        state = ckpt.read_trainer_state(path, self.rank if same_world else 0)
        self.state = TrainerState(**state["trainer"])
        # Same global micro-batch sequence on any world size (the sampler re-cuts its groups).
        self.task.sampler.load_state_dict(self.state.sampler)
        if same_world:
            ckpt.set_rng_state(state["rng"])
            differences = ckpt.numerics_differences(state.get("numerics"))
            if differences and eng.on_cpu():
                log.warning(
                    f"note: {path} was written with other CPU numerics ({'; '.join(differences)}): the "
                    f"resumed losses will differ from an uninterrupted run's in the last bits "
                    f"(set OMP_NUM_THREADS as at save for a bitwise continuation)"
                )
        else:  # per-rank noise streams are keyed by rank: continue from the global count
            self.state.micro_step = self.state.micro_step * saved.world_size // self.world
        self.last_good = path
