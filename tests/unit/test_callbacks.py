"""The loop's callbacks (mdlmpe_ds/training/callback.py, callbacks.py) on a real Trainer and checkpointer
with a stand-in engine and task (no DeepSpeed, one process): the hooks run at their points, a
non-finite update defers the save due at it, a stop saves and raises ``Stopped``. The same
behaviour on the real 2-rank engine is tests/dist/test_sft_faults.py and test_sft_resume.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mdlmpe_ds import stop_request
from mdlmpe_ds.config.cli import build_config
from mdlmpe_ds.diffusion.losses import T_BUCKETS, LossStats
from mdlmpe_ds.tasks import Micro
from mdlmpe_ds.training import checkpoint as ckpt
from mdlmpe_ds.training.callback import Callback, NonFiniteError, Stopped
from mdlmpe_ds.training.callbacks import callbacks_for
from mdlmpe_ds.training.faults import NO_FAULTS, Faults
from mdlmpe_ds.training.trainer import Trainer


class _Model:
    position_encoding = "rope"
    num_kv_heads = 2

    def to_dict(self) -> dict:
        return {"family": "stand-in", "position_encoding": "rope"}


class _Engine:
    """What the loop and the checkpointer call on a DeepSpeed engine."""

    def __init__(self) -> None:
        self.module = torch.nn.Linear(2, 2)
        self.saved: list[str] = []

    def get_lr(self):
        return [0.1]

    def backward(self, loss):
        pass

    def step(self):
        pass

    def was_step_applied(self):
        return True

    def get_global_grad_norm(self):
        return 1.0

    def train(self):
        pass

    def save_checkpoint(self, path, tag, save_latest):
        (Path(path) / tag).mkdir()
        (Path(path) / tag / "shard.pt").write_bytes(b"x")
        self.saved.append(Path(path).name)

    def bfloat16_enabled(self):  # recorded with the checkpoint (what precision "auto" ran in)
        return False


class _Sampler:
    def state_dict(self):
        return {"position": 0}


class _Task:
    sampler = _Sampler()
    evaluation_stopped = False

    def batches(self):
        while True:
            yield {}

    def micro(self, engine, batch, micro_step, rank):
        stats = LossStats(
            torch.tensor(1.0), torch.tensor(1.0), torch.zeros(T_BUCKETS), torch.zeros(T_BUCKETS)
        )
        return Micro(torch.tensor(2.0), stats, tokens=8, samples=1)

    def periodic_metrics(self, engine, step, total_updates, say):
        return {}


class _Recorder(Callback):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_start(self, trainer):
        self.calls.append(("start",))

    def before_update(self, trainer, update):
        self.calls.append(("before", update))
        return {"probe/update": float(update)}

    def on_metrics(self, trainer, step, metrics):
        assert metrics["probe/update"] == step - 1  # the update's own scalars came back
        return {}

    def on_end(self, trainer):
        self.calls.append(("end",))


def _trainer(tmp_path, faults=NO_FAULTS, extra=(), *flags) -> Trainer:
    run = build_config(None, ["--output_dir", str(tmp_path), "--save_every", "2", *flags])
    hooks = [*callbacks_for(run, _Model(), faults), *extra]
    return Trainer(run, _Engine(), _Model(), _Task(), 4, None, "tok", "fp", callbacks=hooks)


def test_hooks_run_at_their_points_and_checkpoints_follow_save_every(tmp_path):
    recorder = _Recorder()
    summary = _trainer(tmp_path, Faults(), [recorder]).train()
    assert recorder.calls == [("start",), *[("before", n) for n in range(4)], ("end",)]
    assert [h["active_head_fraction"] for h in summary["history"]] == [0.0] * 4  # not MDLMPE
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_000002", "step_000004"]
    meta = json.loads((ckpt.step_dir(tmp_path, 4) / "config.json").read_text())
    assert meta["tokenizer"] == "tok" and meta["data_fingerprint"] == "fp" and meta["step"] == 4


def test_a_save_due_at_a_nonfinite_update_waits_for_the_next_finite_one(tmp_path):
    trainer = _trainer(tmp_path, Faults(nan_updates=frozenset({1})))
    trainer.train()
    assert trainer.engine.saved == ["step_000003.saving", "step_000004.saving"]
    assert trainer.state.nonfinite_total == 1


def test_a_run_ending_on_a_nonfinite_update_raises_and_names_the_last_good_checkpoint(tmp_path):
    with pytest.raises(NonFiniteError, match="step_000002"):
        _trainer(tmp_path, Faults(nan_updates=frozenset({3}))).train()


def test_a_stop_saves_then_raises_stopped(tmp_path):
    stop_request.reset()
    try:
        with pytest.raises(Stopped) as err:
            _trainer(tmp_path, Faults(stop_in_update=0)).train()
    finally:
        stop_request.reset()
    assert err.value.exit_code == 143 and "step_000001" in str(err.value)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_000001"]
