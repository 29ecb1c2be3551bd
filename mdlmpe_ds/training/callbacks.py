"""The callbacks of a training run, and ``callbacks_for``, the list a run hands the loop.

Each is one concern the loop (trainer.py) used to hard-code, now attached to its hook points
(callback.py):

- ``HeadSchedule``: the MDLMPE active KV heads per optimizer update (paper Eq. (27)), all heads at
  the end (docs/method.md "Head schedule");
- ``MDLMPEStats``: gamma and |delta| statistics on log steps;
- ``LoRACheckpoints``: a LoRA run's checkpoints hold the adapters, not the frozen base (lora/checkpoints.py);
- ``NonFinitePolicy``: a non-finite update is never saved; too many in a row end the run;
- ``StopHandling``: a signal or a lost launcher stops the run after a saved update (lifecycle.py);
- ``TestFaults``: the injected faults of the fault tests (faults.py); production runs have none.

Order matters where two callbacks share a hook: the faults' stop request is made before the stop
vote, and the heads are all switched on before the logits probe reads the model.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import torch

from mdlmpe_ds import stop_request
from mdlmpe_ds.config.run import RunConfig
from mdlmpe_ds.distributed import engine as eng
from mdlmpe_ds.lora import checkpoints as lora_checkpoints
from mdlmpe_ds.pe.encoder import MDLMPEEncoder
from mdlmpe_ds.pe.heads import active_head_count, head_fraction, scheduled_kv_heads
from mdlmpe_ds.pe.phase import PhaseMLP, phase_residual
from mdlmpe_ds.training import checkpoint as ckpt
from mdlmpe_ds.training import lifecycle
from mdlmpe_ds.training.callback import Callback, NonFiniteError, Stopped
from mdlmpe_ds.training.faults import NO_FAULTS, Faults
from mdlmpe_ds.training.trainer import Trainer


def callbacks_for(run: RunConfig, model_config, faults: Faults = NO_FAULTS) -> list[Callback]:
    """Every callback of a training run, in hook order (the run assembly's one call)."""
    return [
        HeadSchedule(
            model_config.position_encoding == "mdlmpe", model_config.num_kv_heads, run.train.head_schedule
        ),
        MDLMPEStats(run.train.log_every),
        LoRACheckpoints(run),
        TestFaults(faults),  # before StopHandling: its stop request is part of this update's vote
        NonFinitePolicy(run.train.max_consecutive_nonfinite),
        StopHandling(run.train.save_on_signal),
    ]


class HeadSchedule(Callback):
    """alpha(n) on every layer before update n: the first round(alpha(n) * H_kv) KV heads of the
    nested order (pe/heads.py); all heads when the schedule is off, at the end and for inference."""

    def __init__(self, uses_mdlmpe: bool, num_kv_heads: int, scheduled: bool) -> None:
        self.uses_mdlmpe, self.num_kv_heads, self.scheduled = uses_mdlmpe, num_kv_heads, scheduled

    def _all(self, trainer: Trainer) -> None:
        trainer.engine.module.set_active_kv_heads(torch.ones(self.num_kv_heads, dtype=torch.bool))

    def before_update(self, trainer: Trainer, update: int) -> dict[str, float]:
        """Applies alpha(update); reports the active fraction actually set."""
        if not self.uses_mdlmpe:
            return {"mdlmpe/active_head_fraction": 0.0}
        h_kv, total = self.num_kv_heads, trainer.total_updates
        if not self.scheduled:
            self._all(trainer)
            return {"mdlmpe/active_head_fraction": 1.0}
        trainer.engine.module.set_active_kv_heads(scheduled_kv_heads(update, total, h_kv))
        fraction = active_head_count(head_fraction(update, total), h_kv) / h_kv
        return {"mdlmpe/active_head_fraction": fraction}

    def on_end(self, trainer: Trainer) -> None:
        if self.uses_mdlmpe:
            self._all(trainer)


def mdlmpe_stats(module: torch.nn.Module) -> dict[str, float]:
    """gamma of the embedding path and |delta| statistics of every phase MLP (one per layer, logged
    as ``layer{i}``, or the one shared by all layers, logged as ``shared``).

    |delta| is evaluated on a fixed sample of pair features s ~ U(-pi/2, pi/2)^F (the range of s,
    Eq. (37)), i.e. the size of the learned residual over its input domain, not on a
    training batch (that would need the L x L pair tensor). Collective under ZeRO-3 (gathers the
    small MDLMPE parameters on every rank); call on log steps only.
    """
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


class MDLMPEStats(Callback):
    """``mdlmpe_stats`` every ``log_every`` updates and after the last (collective: every rank)."""

    def __init__(self, log_every: int) -> None:
        self.log_every = log_every

    def on_metrics(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> dict[str, float]:
        if step % self.log_every == 0 or step == trainer.total_updates:
            return mdlmpe_stats(trainer.engine.module)
        return {}


class LoRACheckpoints(Callback):
    """A LoRA run (``--lora``) saves and loads without the frozen base, records its adapter list,
    and refuses a checkpoint that lacks an adapter or MDLMPE key it trains; other runs: nothing."""

    def __init__(self, run: RunConfig) -> None:
        self.run = run

    def save_kwargs(self) -> dict:
        return lora_checkpoints.checkpoint_save_kwargs(self.run)

    def load_kwargs(self) -> dict:
        return lora_checkpoints.checkpoint_load_kwargs(self.run)

    def on_save_meta(self, staging: Path, module: torch.nn.Module) -> None:
        lora_checkpoints.write_checkpoint_meta_of(staging, self.run, module)

    def before_resume(self, path: Path, module: torch.nn.Module) -> None:
        lora_checkpoints.check_resume(path, self.run, module)


class NonFinitePolicy(Callback):
    """Non-finite is never saved as good. A non-finite update (loss or gradient norm; ZeRO-3 has
    skipped it on every rank alike) is reported; ``limit`` in a row end the run (NonFiniteError,
    naming the last good checkpoint); a save due at a non-finite update waits for the next finite
    one; a run whose last update was non-finite writes no final checkpoint and ends with the same
    error. So every checkpoint is a finite one, and keep-last pruning keeps it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def after_update(self, trainer: Trainer, step: int, final: bool) -> None:
        state = trainer.state
        if state.nonfinite_consecutive:
            trainer.tracker.print(
                f"update {step}: non-finite loss/gradient, update skipped "
                f"({state.nonfinite_consecutive} in a row, {state.nonfinite_total} total)"
            )
        if state.nonfinite_consecutive >= self.limit:
            raise NonFiniteError(
                f"{state.nonfinite_consecutive} consecutive non-finite updates (limit "
                f"train.max_consecutive_nonfinite={self.limit}) at update {step}; "
                + trainer.checkpointer.last_good_advice()
            )
        if state.nonfinite_consecutive and final:
            trainer.save_pending = False
            raise NonFiniteError(
                f"the last update ({step}) was non-finite: no checkpoint written from it; "
                + trainer.checkpointer.last_good_advice()
            )

    def can_save(self, trainer: Trainer, step: int) -> bool:
        if trainer.state.nonfinite_consecutive == 0:
            return True
        trainer.tracker.print(
            f"update {step} was non-finite: its checkpoint waits for the next finite update"
        )
        return False


class StopHandling(Callback):
    """SIGTERM/SIGINT or a lost launcher (lifecycle.py): looked at before the first update (agreed
    over the ranks), voted on after each update and after each save, and answered after a finite
    update with what ``train.save_on_signal`` asks for (full, model, none), then ``Stopped`` (exit
    128 + the signal number).

    A stop that arrived while a periodic save was written is answered by that save, in every mode:
    the loop stops right after it, without another update or a second save, which would only spend
    the launcher's grace period (30 s) on work the next run trains again. ``full``: the save is
    the full checkpoint the mode asks for. ``model``: the full checkpoint of the same update holds
    the weights (export reads it) and also resumes, so a weights-only save of it adds nothing.
    ``none``: the mode asks to write nothing more; what was already on disk is kept."""

    def __init__(self, save_on_signal: str) -> None:
        self.choice = save_on_signal

    def on_start(self, trainer: Trainer) -> None:
        lifecycle.stop_setup_if_asked(
            "setting up (before the first update)", lambda: self._restart_advice(trainer)
        )
        stop_request.set_phase("training")

    @staticmethod
    def _restart_advice(trainer: Trainer) -> str:
        """What to run after a stop before the first update: the run continues from the checkpoint it
        loaded, if any; otherwise it starts again (an --overwrite_output_dir has already deleted the
        earlier run by then: never advise a checkpoint that is not there)."""
        if trainer.last_good is not None:
            return f"run the same command again to continue from {trainer.last_good}"
        return "run the same command again to start"

    def wants_stop(self, trainer: Trainer) -> bool:
        return lifecycle.stop_reason() is not None

    def on_stop(self, trainer: Trainer, step: int) -> None:
        reason = lifecycle.stop_reason() or "another rank was asked to stop"
        code = lifecycle.exit_code() or 128 + signal.SIGTERM
        last = trainer.last_good  # this run's newest full checkpoint (or the one it resumed from)
        if last is not None and ckpt.step_of(last) == step:  # the stop came while it was written
            export = (
                f" (it holds the weights, so no weights-only save was written: python launch/export.py "
                f"{trainer.last_good} DIR)"
                if self.choice == "model"
                else ""
            )
            raise Stopped(
                f"stopped after update {step} ({reason}, while its checkpoint was written); checkpoint "
                f"{trainer.last_good} is complete: continue with --resume auto{export}",
                code,
            )
        if self.choice == "full":
            trainer.save()
            raise Stopped(
                f"stopped after update {step} ({reason}); checkpoint {trainer.last_good} is complete: "
                f"continue with --resume auto",
                code,
            )
        if self.choice == "model":
            weights = trainer.save_weights()
            raise Stopped(
                f"stopped after update {step} ({reason}); model weights only in {weights} "
                f"(train.save_on_signal model: export them with python launch/export.py {weights} DIR); "
                f"--resume auto continues from the last full checkpoint, {trainer.last_good or 'none yet'}",
                code,
            )
        raise Stopped(
            f"stopped after update {step} ({reason}); nothing saved (train.save_on_signal none): "
            f"--resume auto continues from the last checkpoint, {trainer.last_good or 'none yet'}",
            code,
        )


class TestFaults(Callback):
    """The faults of ``faults.Faults`` at their points of the loop and of the save."""

    __test__ = False  # not a pytest class

    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def micro_loss(self, trainer: Trainer, update: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if update in self.faults.nan_updates else loss

    def after_steps(self, trainer: Trainer, update: int) -> None:
        if update == self.faults.stop_in_update:
            lifecycle.request_stop("received SIGTERM (test fault)", 128 + signal.SIGTERM)

    def before_commit(self, step: int) -> None:
        if self.faults.kill_in_save == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.faults.pause_in_save == step:
            time.sleep(self.faults.pause_s)

    def on_end(self, trainer: Trainer) -> None:
        if self.faults.probe_logits is not None:
            self._probe_logits(trainer, Path(self.faults.probe_logits))

    @staticmethod
    def _probe_logits(trainer: Trainer, path: Path) -> None:
        """Logits of the engine (all heads, eval mode) on the first examples, saved by rank 0, to
        compare with an exported-and-reloaded model (tests/dist)."""
        batch = trainer.task.probe_batch()
        if "positions" in batch:
            raise RuntimeError(
                "the logits probe compares position-free forwards; run it without left padding"
            )
        engine = trainer.engine
        engine.eval()
        with torch.no_grad():
            logits = engine(batch["input_ids"].to(engine.device), valid=batch["valid"].to(engine.device))
        engine.train()
        state = eng.consolidated_state_dict(engine)  # collective; the trained weights (LoRA tests)
        if trainer.rank == 0:
            torch.save(
                {
                    "input_ids": batch["input_ids"],
                    "valid": batch["valid"],
                    "logits": logits.float().cpu(),
                    "state": state,
                },
                path,
            )
