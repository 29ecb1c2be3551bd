"""Never lose a run, part two, on 2 CPU ranks with the shipped ds_configs/zero3.json: a resume with a
new lr really trains with it (and a new corruption is refused by name), `--resume auto` with every
checkpoint damaged refuses instead of starting over, a non-finite update is never saved as good,
and a stopped run's model-only save (train.save_on_signal model) holds the trained weights.

The runs start from the shared straight run's checkpoints (tests/dist/conftest.py) where they can.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from sft_runs import (
    BASE_ARGS,
    alive,
    check,
    descendants,
    launch,
    launch_module,
    metrics,
    start_as_user,
    tensorboard_steps,
)

from mdlmpe_ds.training import checkpoint as ckpt

pytestmark = pytest.mark.dist

N = 8  # updates of BASE_ARGS; checkpoints at 4 and 8


def copy_run(straight, out, steps=(4, 8)) -> None:
    out.mkdir(parents=True)
    for step in steps:
        name = f"step_{step:06d}"
        shutil.copytree(straight / "checkpoints" / name, out / "checkpoints" / name)
    shutil.copy(straight / "metrics.jsonl", out / "metrics.jsonl")
    shutil.copytree(straight / "tensorboard", out / "tensorboard")


def test_resume_applies_a_new_lr_and_refuses_a_new_corruption(sft_straight, sft_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mdlmpe_ds.distributed.engine import warmup_cosine

    out = tmp_path / "lr"
    copy_run(sft_straight, out, steps=(4,))
    args = [*sft_data, *BASE_ARGS, "--output_dir", str(out), "--resume", "auto"]
    history = (out / "metrics.jsonl").read_text()
    refused = launch([*args, "--corruption", "spans"])
    assert refused.returncode != 0 and "train.corruption: iid -> spans" in refused.stderr, refused.stderr[
        -3000:
    ]
    assert "--allow_config_change train.corruption" in refused.stderr
    assert (out / "metrics.jsonl").read_text() == history  # nothing trained

    resumed = launch([*args, "--lr", "1e-3"])
    check(resumed, "resume with a new lr")
    assert "changed on resume: optim.lr 0.003 -> 0.001 (applied)" in resumed.stdout + resumed.stderr
    rows, factor = metrics(out), warmup_cosine(2, N, True, 0.1)  # BASE_ARGS: warmup 2, cosine over 8
    for step in range(5, N + 1):  # update index step - 1 of the same schedule at the new peak
        assert rows[step]["train/lr"] == pytest.approx(1e-3 * factor(step - 1), rel=1e-12), step
    assert rows[4]["train/lr"] == pytest.approx(3e-3 * factor(3), rel=1e-12)
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    lrs = {e.step: e.value for e in acc.Scalars("train/lr")}
    assert lrs[5] == pytest.approx(1e-3 * factor(4), rel=1e-6)  # TensorBoard stores float32
    saved = json.loads((out / "checkpoints" / f"step_{N:06d}" / "config.json").read_text())
    assert saved["run_config"]["optim"]["lr"] == 1e-3


def test_resume_auto_with_every_checkpoint_damaged_refuses_and_keeps_the_history(
    sft_straight, sft_data, tmp_path
):
    out = tmp_path / "damaged"
    copy_run(sft_straight, out)
    shards = []
    for step in (4, 8):
        shard = next((out / "checkpoints" / f"step_{step:06d}" / "ds").glob("*optim_states.pt"))
        with open(shard, "r+b") as fh:
            fh.truncate(shard.stat().st_size // 2)
        shards.append(shard)
    history = (out / "metrics.jsonl").read_text()
    events = {p.name: p.stat().st_size for p in (out / "tensorboard").iterdir()}
    proc = launch([*sft_data, *BASE_ARGS, "--output_dir", str(out), "--resume", "auto"])
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "none can be resumed from" in proc.stderr and "Not starting over" in proc.stderr, proc.stderr[
        -3000:
    ]
    assert all(str(shard) in proc.stderr for shard in shards)
    assert (out / "metrics.jsonl").read_text() == history
    assert {p.name: p.stat().st_size for p in (out / "tensorboard").iterdir()} == events
    assert tensorboard_steps(out) == list(range(1, N + 1))
    assert all(shard.stat().st_size > 0 for shard in shards)  # the damaged checkpoints are kept


def test_a_non_finite_update_is_never_saved_as_good(sft_data, tmp_path):
    """NaN at updates 2 and 4 (1-based) of 4, a save due every 2, keep_last 1: the save due at 2
    waits for the finite update 3; the last update is non-finite, so no final checkpoint is written
    and the run fails naming update 3's checkpoint as the last good one."""
    out = tmp_path / "nan_last"
    args = [*sft_data, *BASE_ARGS, "--output_dir", str(out), "--max_steps", "4", "--save_every", "2"]
    proc = launch([*args, "--keep_last", "1"], faults={"nan_updates": [1, 3]})
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "the last update (4) was non-finite: no checkpoint written" in proc.stderr, proc.stderr[-3000:]
    assert f"last good checkpoint: {out / 'checkpoints' / 'step_000003'}" in proc.stderr
    assert "update 2 was non-finite: its checkpoint waits for the next finite update" in proc.stdout
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["step_000003"]
    assert "done:" not in proc.stdout


def test_save_on_signal_model_writes_the_trained_weights(sft_straight, sft_data, tmp_path):
    """A stop during update 4 with train.save_on_signal model: no checkpoint, the weights of update
    4 only, equal to the straight run's update-4 checkpoint, exported like a checkpoint."""
    from mdlmpe_ds.training import weights_only
    from mdlmpe_ds.distributed.engine import fp32_state_dict_from_checkpoint

    out = tmp_path / "model_only"
    args = [*sft_data, *BASE_ARGS, "--output_dir", str(out), "--save_on_signal", "model"]
    proc = launch(args, faults={"stop_in_update": 3})
    assert proc.returncode != 0 and "stopped after update 4" in proc.stderr, proc.stderr[-3000:]
    weights = out / "weights" / "step_000004"
    assert f"model weights only in {weights}" in proc.stderr
    assert not (out / "checkpoints" / "step_000004").exists()
    state = weights_only.load(weights)
    reference = fp32_state_dict_from_checkpoint(sft_straight / "checkpoints" / "step_000004")
    assert sorted(state) == sorted(reference)
    for name, tensor in reference.items():
        assert state[name].reshape(tensor.shape).equal(tensor), name
    exported = launch_module("export").export(str(weights), str(tmp_path / "export"))
    assert (exported / "config.json").is_file()


def _catches_sigterm(pid: int) -> bool:
    """Whether ``pid`` has a SIGTERM handler installed (lifecycle.install ran)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(status.split("SigCgt:")[1].split()[0], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_sigterm_during_data_setup_stops_the_job_promptly(sft_data, tmp_path):
    """The README's command tokenising a large chat file: SIGTERM to the job (a preemption) ends
    every process within seconds, with the reason, instead of tokenising on until the launcher's
    SIGKILL 30 s later."""
    rows = [
        {"messages": [{"role": "user", "content": "what is the answer " * 10},
                      {"role": "assistant", "content": f"the answer is {i} " * 20}]}
        for i in range(150000)
    ]  # fmt: skip
    chat = tmp_path / "large.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "setup_stop"
    log = tmp_path / "setup_stop.log"
    tokenizer = sft_data[sft_data.index("--tokenizer") : sft_data.index("--tokenizer") + 2]
    proc = start_as_user([*tokenizer, "--dataset", str(chat), *BASE_ARGS, "--output_dir", str(out)], log)
    try:
        deadline = time.monotonic() + 120
        while True:  # both ranks have their signal handlers: setup has begun
            ranks = [p for p in descendants(proc.pid) if _is_worker(p) and _catches_sigterm(p)]
            if len(ranks) >= 2 or time.monotonic() > deadline or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert len(ranks) >= 2, log.read_text()[-3000:]
        time.sleep(3.0)  # into the tokenising (150k rows take far longer)
        job = descendants(proc.pid)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=60)
        while alive(job) and time.monotonic() - sent < 60:
            time.sleep(0.1)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc != 0 and not alive(job), text[-3000:]
    assert f"stopped while tokenising {chat}" in text and "nothing to save" in text, text[-3000:]
    assert took < 20, (took, text[-3000:])  # the launchers' SIGKILL comes at 30 s
    assert not (out / "checkpoints").exists()


def _is_worker(pid: int) -> bool:
    """A training rank under torchrun (not the re-launching rank above it, nor torchrun)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    cmd = _cmd(pid)
    return (
        "launch/sft.py" in cmd and "torch.distributed.run" not in cmd and b"MDLMPE_DS_CPU_RANKS=1" in environ
    )


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().decode(errors="replace").replace("\0", " ")
    except OSError:
        return ""
