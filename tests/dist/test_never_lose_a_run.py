"""Never lose a run, on the user's path: the shipped ds_configs/zero3.json, 2 CPU ranks through the
real DeepSpeed engine, and (for signals and orphans) the README's own `deepspeed launch/sft.py`
command. Every history is compared with one straight run made in this test session.

- SIGKILL of the whole job at random points in training and inside a save, twice in one run;
- a re-save over an existing step, killed half-way (the newer checkpoint is set aside, never
  resumed into), and a fresh run refused on an output_dir that holds checkpoints;
- a truncated optimizer shard in the newest checkpoint (skipped by name, the older one used);
- a same-size dataset swap on resume (refused);
- SIGTERM to the job or to the top launcher only (checkpoint, non-zero exit, exact resume; the
  job's run requeued with its command as written, as a scheduler does);
- kill -9 of the launcher's process group (no rank outlives it).
"""

from __future__ import annotations

import json
import os
import random
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
    launch_and_kill_when,
    metrics,
    start_as_user,
    tensorboard_steps,
    wait_until,
)

pytestmark = pytest.mark.dist

N = 8  # updates of BASE_ARGS; checkpoints at 4 and 8


def same_history(straight, out) -> None:
    """Every logged update of ``out`` equals the straight run's, bit for bit; each appears once."""
    a, b = metrics(straight), metrics(out)
    assert sorted(b) == list(range(1, N + 1))
    for step in range(1, N + 1):
        for key in ("train/loss", "train/lr", "train/grad_norm", "mdlmpe/active_head_fraction"):
            assert a[step][key] == b[step][key], f"update {step} {key}: {a[step][key]!r} vs {b[step][key]!r}"
    assert tensorboard_steps(out) == list(range(1, N + 1))


def copy_run(straight, out, steps=(4, 8)) -> None:
    """A copy of the straight run's output_dir holding the given checkpoints (and its logs)."""
    out.mkdir(parents=True)
    for step in steps:
        name = f"step_{step:06d}"
        shutil.copytree(straight / "checkpoints" / name, out / "checkpoints" / name)
    (out / "checkpoints" / "latest").write_text(f"step_{max(steps):06d}\n")
    shutil.copy(straight / "metrics.jsonl", out / "metrics.jsonl")
    shutil.copytree(straight / "tensorboard", out / "tensorboard")


def test_sigkill_at_random_points_then_resume_auto(sft_straight, sft_data, tmp_path):
    """Two hard kills of the whole job in one run -- in training at a random update past the first
    checkpoint, then inside the final save -- each followed by `--resume auto`."""
    rng = random.Random(os.environ.get("PYTEST_SEED", "15"))
    out = tmp_path / "killed"
    args = [*sft_data, *BASE_ARGS, "--output_dir", str(out)]
    kill_after = rng.randint(5, 7)

    def in_training() -> bool:
        done = (out / "checkpoints" / "step_000004" / "COMPLETE").exists()
        return done and (out / "metrics.jsonl").exists() and max(_steps(out), default=0) >= kill_after

    launch_and_kill_when(args, in_training)
    assert not (out / "checkpoints" / "step_000008").exists()

    def in_save() -> bool:  # update 8's shards are written; rank 0 holds before the swap
        return (out / "checkpoints" / "step_000008.saving" / "trainer_state_rank1.pt").is_file()

    launch_and_kill_when([*args, "--resume", "auto"], in_save, faults={"pause_in_save": 8})
    ckpts = out / "checkpoints"
    assert not (ckpts / "step_000008").exists()  # never a half-written step_N
    # the shards went to the staging directory, and `latest` moves only after COMPLETE
    assert (ckpts / "step_000008.saving" / "ds").is_dir()
    assert (ckpts / "latest").read_text().strip() == "step_000004"
    resumed = launch([*args, "--resume", "auto"])
    check(resumed, "resume after two kills")
    assert "resumed from" in resumed.stdout and "step_000004" in resumed.stdout
    assert "removed the interrupted save" in resumed.stdout
    same_history(sft_straight, out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000004", "step_000008"]


def _steps(out) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def test_resave_over_existing_step_is_atomic(sft_straight, sft_data, tmp_path):
    """Resuming from step 4 while step 8 exists: 8 is set aside; the re-save of 8 is killed after
    its shards; `--resume auto` then continues from 4 (never the set-aside or half-written 8).
    Before that, two commands that fail must cost nothing: a resume of step 4 that is refused
    (another --max_len) leaves step 8 where it was, and --overwrite_output_dir true with a
    misspelt dataset deletes nothing."""
    out = tmp_path / "resave"
    copy_run(sft_straight, out)
    args = [*sft_data, *BASE_ARGS, "--output_dir", str(out)]
    # Without --resume, a run refuses an output_dir that holds checkpoints.
    fresh = launch(args)
    assert fresh.returncode != 0 and "already holds a run (step_000004, step_000008" in fresh.stderr
    assert "--overwrite_output_dir true" in fresh.stderr
    four = str(out / "checkpoints" / "step_000004")
    refused = launch([*args, "--max_len", "64", "--resume", four])
    assert refused.returncode != 0 and "max_seq_len" in refused.stderr
    typo = launch([*args, "--dataset", str(tmp_path / "chat_typo.jsonl"), "--overwrite_output_dir", "true"])
    assert typo.returncode != 0 and "chat_typo.jsonl" in typo.stderr
    ckpts = out / "checkpoints"
    assert (ckpts / "step_000008" / "COMPLETE").is_file() and not (ckpts / "superseded").exists()
    assert (ckpts / "latest").read_text().strip() == "step_000008" and _steps(out) == list(range(1, 9))
    killed = launch([*args, "--resume", four], faults={"kill_in_save": 8})
    assert killed.returncode != 0
    assert not (ckpts / "step_000008").exists() and (ckpts / "step_000008.saving").is_dir()
    assert [p.name.split("-")[0] for p in (ckpts / "superseded").iterdir()] == ["step_000008"]
    resumed = launch([*args, "--resume", "auto"])
    check(resumed, "resume after the killed re-save")
    assert "resumed from" in resumed.stdout and "step_000004" in resumed.stdout
    same_history(sft_straight, out)
    assert (ckpts / "step_000008" / "COMPLETE").is_file()


def test_corrupt_newest_checkpoint_falls_back_by_name(sft_straight, sft_data, tmp_path):
    out = tmp_path / "corrupt"
    copy_run(sft_straight, out)
    shard = next((out / "checkpoints" / "step_000008" / "ds").glob("*optim_states.pt"))
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    resumed = launch([*sft_data, *BASE_ARGS, "--output_dir", str(out), "--resume", "auto"])
    check(resumed, "resume past a damaged checkpoint")
    assert "skipping damaged checkpoint" in resumed.stdout and shard.name in resumed.stdout
    assert "resumed from" in resumed.stdout and "step_000004" in resumed.stdout
    same_history(sft_straight, out)


def test_resume_on_a_same_size_dataset_swap_is_refused(sft_straight, sft_data, tmp_path):
    out = tmp_path / "swap"
    copy_run(sft_straight, out, steps=(4,))
    original = sft_data[sft_data.index("--dataset") + 1]
    rows = [json.loads(line) for line in Path(original).read_text().splitlines()]
    for row in rows:
        for message in row["messages"]:
            if message["role"] == "assistant":
                message["content"] = " ".join(reversed(message["content"].split()))
    swapped = tmp_path / "swapped.jsonl"
    swapped.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert len(swapped.read_text().splitlines()) == len(Path(original).read_text().splitlines())
    args = [*sft_data, *BASE_ARGS, "--output_dir", str(out), "--resume", "auto", "--dataset", str(swapped)]
    proc = launch(args)
    assert proc.returncode != 0 and "trained on other data" in proc.stderr, proc.stderr[-2000:]
    assert "--allow_data_change true" in proc.stderr
    assert max(metrics(out)) == N  # nothing was trained or logged


@pytest.mark.parametrize("target", ["job", "top_launcher"])
def test_sigterm_saves_then_resume_equals_straight(sft_straight, sft_data, tmp_path, target):
    """SIGTERM to the job's launcher group (a preemption; the launchers pass it on to the ranks) or
    to the top `deepspeed` process alone (the ranks see their launcher gone): the ranks agree on one
    last update, save it, and exit non-zero; the run then continues and repeats the straight run.
    job: the scheduler requeues it, re-running the command as written, --overwrite_output_dir true
    included (as `make demo` passes it), with SLURM_RESTART_COUNT=1: it resumes (before, it deleted
    the saved checkpoints and history and trained from update 1). top_launcher: `--resume auto`."""
    out = tmp_path / target
    args = [*sft_data, *BASE_ARGS, "--output_dir", str(out)]
    if target == "job":
        args += ["--overwrite_output_dir", "true"]
    log = tmp_path / f"{target}.log"
    proc = start_as_user(args, log)
    try:
        wait_until(lambda: (out / "metrics.jsonl").exists() and max(_steps(out), default=0) >= 2, proc, log)
        job = descendants(proc.pid)
        if target == "job":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=120)
        deadline = time.monotonic() + 90
        while alive(job) and time.monotonic() < deadline:  # the ranks save, then exit
            time.sleep(0.2)
        assert not alive(job), f"still running: {alive(job)}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc != 0 and "stopped after update" in text, text[-3000:]
    last = int(text.split("stopped after update ")[1].split()[0])
    assert 2 <= last < N and (out / "checkpoints" / f"step_{last:06d}" / "COMPLETE").is_file()
    assert max(metrics(out)) == last
    if target == "job":
        resumed = launch(args, {"SLURM_RESTART_COUNT": "1"})
        assert "SLURM_RESTART_COUNT=1: the job was started again, so it continues as --resume auto" in resumed.stderr
        assert "removed the earlier run" not in resumed.stderr + resumed.stdout
    else:
        resumed = launch([*args, "--resume", "auto"])
    check(resumed, f"resume after SIGTERM to the {target}")
    assert f"resumed from {out / 'checkpoints' / f'step_{last:06d}'} (update {last}/{N})" in resumed.stdout
    same_history(sft_straight, out)


def test_no_rank_outlives_a_killed_launcher_group(sft_data, tmp_path):
    out = tmp_path / "orphans"
    log = tmp_path / "orphans.log"
    proc = start_as_user([*sft_data, *BASE_ARGS, "--max_steps", "200", "--output_dir", str(out)], log)
    try:
        wait_until(lambda: (out / "metrics.jsonl").exists() and max(_steps(out), default=0) >= 2, proc, log)
        job = descendants(proc.pid)
        ranks = [pid for pid in job if "launch/sft.py" in _cmd(pid) and "LOCAL_RANK" in _environ(pid)]
        assert len(ranks) >= 2, [(pid, _cmd(pid)) for pid in job]
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group; torchrun's ranks are not in it
    finally:
        proc.wait()
    deadline = time.monotonic() + 30
    while alive(ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = alive(ranks)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"ranks {survivors} outlived their launcher by 30 s:\n{log.read_text()[-3000:]}"


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().decode(errors="replace").replace("\0", " ")
    except OSError:
        return ""


def _environ(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return ""
