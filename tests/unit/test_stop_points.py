"""Where a stop request ends a run, on the real run assembly, Trainer and checkpointer with the
stand-in engine and task of test_callbacks.py (one process, no DeepSpeed), and on 2 gloo processes
for the agreement over the ranks:

- a SIGTERM or Ctrl-C while the model, the engine or the resumed checkpoint loads stops the job
  before --overwrite_output_dir deletes the earlier run and before an older-step resume sets the
  newer checkpoints aside (or truncates the history), and says truthfully what is left;
- a stop that arrives while a periodic save is written ends the run right after that save;
- a resume on another world size never redraws a noise key the checkpoint's run drew.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_callbacks import _Engine, _Model, _Task

from mdlmpe_ds import stop_request
from mdlmpe_ds.config.cli import build_config
from mdlmpe_ds.distributed import process_group
from mdlmpe_ds.runs import assembly
from mdlmpe_ds.training import checkpoint as ckpt
from mdlmpe_ds.training import lifecycle
from mdlmpe_ds.training import trainer as trainer_module
from mdlmpe_ds.training.callback import Callback, Stopped
from mdlmpe_ds.training.callbacks import callbacks_for
from mdlmpe_ds.training.checkpointer import Checkpointer
from mdlmpe_ds.training.faults import NO_FAULTS
from mdlmpe_ds.training.trainer import Trainer, TrainerState

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_stop_request():
    stop_request.reset()
    yield
    stop_request.reset()


def sigterm() -> None:
    """What the SIGTERM handler records (lifecycle._on_signal), without a signal."""
    lifecycle.request_stop("received SIGTERM", 128 + signal.SIGTERM)


def earlier_run(out: Path, steps=(4, 8)) -> dict[str, bytes]:
    """An output_dir as a finished run leaves it: complete checkpoints, 8 logged updates, TensorBoard.
    Returns every file's bytes, to compare with after the stopped job."""
    for step in steps:
        step_dir = ckpt.step_dir(out, step)
        step_dir.mkdir(parents=True)
        ckpt.write_meta(step_dir, step, 1, {}, {}, "tok", "fp")
        (step_dir / ckpt.COMPLETE).write_text("")
    (ckpt.checkpoints_root(out) / "latest").write_text(f"step_{max(steps):06d}\n")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 9)))
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1").write_bytes(b"earlier")
    return files_of(out)


def files_of(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


class _ResumableSampler:
    def state_dict(self):
        return {"position": 0}

    def load_state_dict(self, state, data_changed=False):
        return []


class _ResumableTask(_Task):
    sampler = _ResumableSampler()


def stand_in_assembly(monkeypatch, resume_from: Path | None, stop_while: str) -> None:
    """assemble_and_train's inputs, data, engine and (for a resume) checkpoint load, stood in; a
    SIGTERM arrives while ``stop_while`` ("build": the engine build; "load": the checkpoint load)."""

    def build_engine(*args, **kwargs):
        if stop_while == "build":
            sigterm()
        return _Engine(), None

    def load(self, engine, path):
        if stop_while == "load":
            sigterm()
        self.last_good = path
        return {"trainer": asdict(TrainerState(step=4, micro_step=8))}, 1

    inputs = assembly.RunInputs(None, "tok", "chat.jsonl", None, _Model())
    monkeypatch.setattr(assembly, "run_inputs", lambda run, kind: inputs)
    monkeypatch.setattr(assembly, "eng", SimpleNamespace(prepare_ds_config=lambda *a: {}))
    monkeypatch.setattr(assembly, "prepare_resume", lambda *a, **k: resume_from)
    monkeypatch.setattr(assembly, "check_resume_data", lambda *a, **k: None)
    monkeypatch.setattr(assembly, "resumed_total", lambda *a, **k: (8, None))
    monkeypatch.setattr(assembly, "build_engine", build_engine)
    monkeypatch.setattr(assembly, "recorded_tokenizer", lambda *a: "tok")
    monkeypatch.setattr(assembly, "resolution", lambda *a: {})
    monkeypatch.setattr(Checkpointer, "resume", load)
    monkeypatch.setattr(trainer_module.eng, "apply_optim_settings", lambda *a: None)


KIND = assembly.RunKind(
    sources=lambda local: ("tok", "chat.jsonl"),
    load_data=lambda run, inputs: assembly.RunData([0] * 8, "fp", [0] * 8, None),
    make_task=lambda run, inputs, data: _ResumableTask(),
)


def test_a_stop_during_the_build_leaves_the_run_that_overwrite_would_delete(monkeypatch, tmp_path):
    """scancel while an 8B model loads, on a job with --overwrite_output_dir true: the earlier run
    was deleted, and the message advised --resume auto from a checkpoint that was gone."""
    out = tmp_path / "run"
    before = earlier_run(out)
    stand_in_assembly(monkeypatch, None, stop_while="build")
    run = build_config(None, ["--output_dir", str(out), "--overwrite_output_dir", "true"])
    with pytest.raises(stop_request.StoppedDuringSetup) as err:
        assembly.assemble_and_train(KIND, run, "ds.json")
    assert err.value.exit_code == 143
    assert files_of(out) == before  # checkpoints, metrics.jsonl, TensorBoard: all as they were
    message = str(err.value)
    assert "stopped while setting up (before the first update) (received SIGTERM)" in message
    assert f"the earlier run in {out} is intact" in message and "run the same command again" in message


def test_a_stop_during_an_older_step_resume_sets_nothing_aside(monkeypatch, tmp_path):
    """A cancelled --resume step_4 (SIGTERM while the checkpoint loads) moved step_8 to superseded/
    and cut metrics.jsonl to 4 updates: the next --resume auto went back to step 4."""
    out = tmp_path / "run"
    before = earlier_run(out)
    four = ckpt.step_dir(out, 4)
    stand_in_assembly(monkeypatch, four, stop_while="load")
    run = build_config(None, ["--output_dir", str(out)])
    with pytest.raises(stop_request.StoppedDuringSetup) as err:
        assembly.assemble_and_train(KIND, run, "ds.json", resume=str(four))
    assert files_of(out) == before and not (ckpt.checkpoints_root(out) / ckpt.SUPERSEDED).exists()
    assert ckpt.newest_complete(out) == ckpt.step_dir(out, 8)
    assert f"--resume auto to continue from the newest, {ckpt.step_dir(out, 8)}" in str(err.value)


def test_a_stop_before_the_first_update_names_only_what_exists(tmp_path):
    """A stop just after setup, in a new run: nothing to continue from, so no --resume advice."""
    run = build_config(None, ["--output_dir", str(tmp_path / "new")])
    trainer = Trainer(run, _Engine(), _Model(), _Task(), 4, None, "tok", "fp", callbacks_for(run, _Model()))
    sigterm()
    with pytest.raises(stop_request.StoppedDuringSetup) as err:
        trainer.train()
    assert str(err.value).endswith("nothing to save; run the same command again to start")
    assert "--resume auto" not in str(err.value)


def test_the_setup_stop_is_agreed_over_the_ranks(tmp_path):
    """Two gloo processes; only rank 1 got the SIGTERM. Rank 0, which does the deleting, must stop
    too: a check of its own flag alone would delete the earlier run and then hang or diverge."""
    out = tmp_path / "run"
    before = earlier_run(out)
    script = tmp_path / "ranks.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import socket, torch.distributed as dist, torch.multiprocessing as mp

            def worker(rank, port):
                url = f"tcp://127.0.0.1:{{port}}"
                dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2)
                from mdlmpe_ds.config.cli import build_config
                from mdlmpe_ds.runs.assembly import change_output_dir
                from mdlmpe_ds.stop_request import StoppedDuringSetup
                from mdlmpe_ds.training import lifecycle
                run = build_config(None, ["--output_dir", {str(out)!r}, "--overwrite_output_dir", "true"])
                if rank == 1:
                    lifecycle.request_stop("received SIGTERM", 143)
                answer = open({str(tmp_path)!r} + f"/rank{{rank}}.txt", "w")  # not one shared pipe
                try:
                    change_output_dir(None, None, run)
                    print(rank, "went on", file=answer)
                except StoppedDuringSetup as err:
                    print(rank, "stopped", err.exit_code, err, file=answer)
                answer.close()
                dist.destroy_process_group()

            if __name__ == "__main__":
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                mp.spawn(worker, args=(port,), nprocs=2)
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text().strip() for r in (0, 1)]
    assert [line.split()[:3] for line in lines] == [["0", "stopped", "143"], ["1", "stopped", "143"]]
    assert "(another rank was asked to stop)" in lines[0] and "(received SIGTERM)" in lines[1]
    assert files_of(out) == before


# ------------------------------------------------------------------------------ a stop during a save
class _SigtermInSave(Callback):
    """A SIGTERM that arrives while update ``step``'s checkpoint is written (rank 0 is between the
    shards and COMPLETE)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def before_commit(self, step: int) -> None:
        if step == self.step:
            sigterm()


@pytest.mark.parametrize("save_on_signal", ["full", "model", "none"])
def test_a_stop_during_a_periodic_save_stops_right_after_it(tmp_path, save_on_signal):
    """The periodic save of update 2 is the stop's save: no update 3 and no second save (which, on a
    large model, the launcher's 30 s grace would cut short), whatever train.save_on_signal says."""
    run = build_config(
        None, ["--output_dir", str(tmp_path), "--save_every", "2", "--save_on_signal", save_on_signal]
    )
    hooks = [_SigtermInSave(2), *callbacks_for(run, _Model(), NO_FAULTS)]
    trainer = Trainer(run, _Engine(), _Model(), _Task(), 4, None, "tok", "fp", callbacks=hooks)
    with pytest.raises(Stopped) as err:
        trainer.train()
    assert err.value.exit_code == 143 and trainer.state.step == 2
    assert trainer.engine.saved == ["step_000002.saving"]  # one save, the periodic one
    assert not (tmp_path / "weights").exists()
    step2 = ckpt.step_dir(tmp_path, 2)
    assert str(err.value).startswith(
        f"stopped after update 2 (received SIGTERM, while its checkpoint was written); checkpoint {step2} "
        "is complete: continue with --resume auto"
    )
    if save_on_signal == "model":  # where the weights are, for the user who asked for weights
        assert str(err.value).endswith(f"python launch/export.py {step2} DIR)")
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]


# ------------------------------------------------------------------- noise keys on another world size
@pytest.mark.parametrize(("saved_world", "world"), [(1, 2), (2, 1), (2, 3)])
def test_a_resume_on_another_world_size_never_redraws_a_noise_key(monkeypatch, tmp_path, saved_world, world):
    """The SFT noise key is (seed, rank, micro_step) (docs/data.md section 5). 1 -> 2 ranks at 8
    micro-steps started rank 0 at 8 * 1 // 2 = 4: keys (seed, 0, 4..7) the 1-rank run had drawn."""
    saved = 8
    monkeypatch.setattr(process_group, "world_size", lambda: world)
    monkeypatch.setattr(trainer_module.eng, "apply_optim_settings", lambda *a: None)
    state = asdict(TrainerState(step=4, micro_step=saved))
    monkeypatch.setattr(Checkpointer, "resume", lambda self, engine, path: ({"trainer": state}, saved_world))
    run = build_config(None, ["--output_dir", str(tmp_path)])
    trainer = Trainer(run, _Engine(), _Model(), _ResumableTask(), 8, tmp_path / "step_000004", "tok", "fp")
    start = trainer.state.micro_step
    drawn = {(rank, m) for rank in range(saved_world) for m in range(saved)}
    next_draws = {(rank, m) for rank in range(world) for m in range(start, start + 16)}
    assert not drawn & next_draws, sorted(drawn & next_draws)[:4]
    assert start == max(saved, saved * saved_world // world)
