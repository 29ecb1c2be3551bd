"""Never lose a run, without a process group: non-finite numbers refused by validation, `--resume
auto` that never starts over silently, a missing manifest as damage, superseded checkpoints named,
one run per output_dir (a lock held by a live process), a full disk named, and a stop polled in
data setup (a real SIGINT while tokenising)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mdlmpe_ds import run_lock, stop_request
from mdlmpe_ds.config.cli import build_config
from mdlmpe_ds.training import checkpoint as ckpt
from mdlmpe_ds.training import checkpointer

REPO = Path(__file__).resolve().parents[2]


def save(out: Path, step: int) -> Path:
    staging = ckpt.staging_dir(out, step)
    (staging / "ds").mkdir(parents=True)
    (staging / "ds" / "rank0_optim_states.pt").write_bytes(b"x" * 3000 + bytes([step]))
    ckpt.write_meta(staging, step, 2, {}, {"hidden_size": 8}, "tok", "fp-a")
    final = ckpt.step_dir(out, step)
    checkpointer.finalize(staging, final)
    return final


@pytest.mark.parametrize(
    "args, key",
    [
        (["--lr", "inf"], "optim.lr"),
        (["--lr", "nan"], "optim.lr"),
        (["--clip", "inf"], "optim.clip"),
        (["--betas", "[NaN, 0.95]"], "optim.betas"),
        (["--model.mdlmpe.tau_max", "nan"], "model.mdlmpe.tau_max"),
        (["--orphan_grace_s", "inf"], "train.orphan_grace_s"),
        (["--attention.pair_buffer_gib", "inf"], "attention.pair_buffer_gib"),
    ],
)
def test_non_finite_numbers_are_refused_by_name(args, key):
    with pytest.raises(ValueError, match=rf"{key}=.* must be a finite number"):
        build_config(None, args)


def test_resume_auto_refuses_when_every_checkpoint_is_damaged(tmp_path):
    four, eight = save(tmp_path, 4), save(tmp_path, 8)
    for step in (four, eight):
        shard = step / "ds" / "rank0_optim_states.pt"
        shard.write_bytes(shard.read_bytes()[:100])
    (ckpt.checkpoints_root(tmp_path) / "step_000012").mkdir()  # an old interrupted save
    with pytest.raises(FileNotFoundError) as err:
        ckpt.resolve_resume("auto", tmp_path, log=lambda _: None)
    text = str(err.value)
    for name in ("step_000004", "step_000008"):
        assert f"{name}: {tmp_path}" in text and "truncated" in text
    assert "step_000012: no COMPLETE marker" in text and "Not starting over" in text
    assert four.is_dir() and eight.is_dir()
    assert ckpt.resolve_resume("auto", tmp_path / "empty") is None  # nothing there: a fresh start


def test_a_missing_manifest_is_damage_unless_the_checkpoint_predates_manifests(tmp_path):
    path = save(tmp_path, 2)
    (path / ckpt.MANIFEST).unlink()
    assert any("MANIFEST.json is missing" in p for p in ckpt.verify(path))
    with pytest.raises(FileNotFoundError, match=r"MANIFEST\.json is missing"):
        ckpt.resolve_resume("auto", tmp_path, log=lambda _: None)
    meta = json.loads((path / "config.json").read_text())
    del meta["format"]  # as versions before manifests wrote it
    (path / "config.json").write_text(json.dumps(meta))
    assert ckpt.verify(path) == [] and ckpt.resolve_resume("auto", tmp_path) == path


def test_resuming_a_superseded_checkpoint_says_what_it_is(tmp_path):
    four, _ = save(tmp_path, 4), save(tmp_path, 8)
    (moved,) = ckpt.supersede_newer(tmp_path, four)
    with pytest.raises(ValueError) as err:
        ckpt.resolve_resume(str(moved), tmp_path)
    text = str(err.value)
    assert "is a superseded checkpoint" in text and "no complete checkpoint found" not in text
    assert f"mv {moved} {ckpt.checkpoints_root(tmp_path) / 'step_000008'}" in text


# ------------------------------------------------------------------------------------ the run lock
def _holder(tmp_path: Path) -> subprocess.Popen:
    """Another live process that holds tmp_path's lock."""
    code = f"from mdlmpe_ds import run_lock; run_lock.acquire({str(tmp_path)!r}); print('held', flush=True)\n"
    code += "import time; time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_into_a_locked_output_dir_refuses_and_deletes_nothing(tmp_path):
    from mdlmpe_ds.runs.common import prepare_output_dir

    save(tmp_path, 4)
    (ckpt.staging_dir(tmp_path, 8) / "ds").mkdir(parents=True)  # the other run is saving update 8
    other = _holder(tmp_path)
    try:
        run = build_config(None, ["--output_dir", str(tmp_path)])
        with pytest.raises(run_lock.RunDirectoryInUse) as err:
            prepare_output_dir("auto", run)
        text = str(err.value)
        assert f"pid {other.pid} on host {socket.gethostname()}" in text and run_lock.LOCK in text
        assert ckpt.staging_dir(tmp_path, 8).is_dir()  # the other run's save is untouched
    finally:
        other.kill()
        other.wait()
    # its process is gone: the lock is stale, taken over with a warning
    warnings = []
    assert run_lock.acquire(tmp_path, log=warnings.append) == tmp_path / run_lock.LOCK
    try:
        assert "taking over the stale lock" in warnings[0] and f"pid {other.pid}" in warnings[0]
        assert json.loads((tmp_path / run_lock.LOCK).read_text())["pid"] == os.getpid()
    finally:
        run_lock.release()
    assert not (tmp_path / run_lock.LOCK).exists()


def test_a_lock_from_another_host_is_stale_only_without_heartbeat(tmp_path):
    lock = tmp_path / run_lock.LOCK
    lock.write_text(json.dumps({"host": "node-17", "pid": 4242, "started": time.time()}))
    with pytest.raises(run_lock.RunDirectoryInUse, match="pid 4242 on host node-17"):
        run_lock.acquire(tmp_path)
    old = time.time() - run_lock.STALE_AFTER_S - 10
    os.utime(lock, (old, old))
    warnings = []
    run_lock.acquire(tmp_path, log=warnings.append)
    run_lock.release()
    assert "has not refreshed it" in warnings[0]


def test_a_requeued_job_takes_over_its_own_earlier_attempts_lock(tmp_path, monkeypatch):
    """Slurm requeues keep SLURM_JOB_ID and count SLURM_RESTART_COUNT: a lock that attempt 0 of
    this job left on another node with a fresh heartbeat (SIGKILLed there) is taken over by attempt
    1; another job's, or the same attempt's, still refuses."""
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7001")
    assert run_lock.job_attempt() == {"job": "SLURM_JOB_ID=7001", "attempt": 0}
    run_lock.acquire(tmp_path)
    recorded = json.loads((tmp_path / run_lock.LOCK).read_text())
    run_lock.release()
    assert recorded["job"] == "SLURM_JOB_ID=7001" and recorded["attempt"] == 0
    lock = tmp_path / run_lock.LOCK
    earlier = {
        "host": "node-17",
        "pid": 4242,
        "started": time.time(),
        "job": "SLURM_JOB_ID=7001",
        "attempt": 0,
    }
    for job, attempt in (("SLURM_JOB_ID=7002", 0), ("SLURM_JOB_ID=7001", 1)):
        lock.write_text(json.dumps({**earlier, "job": job, "attempt": attempt}))
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        with pytest.raises(run_lock.RunDirectoryInUse, match="pid 4242 on host node-17"):
            run_lock.acquire(tmp_path)  # another job; or this job's own attempt 1, maybe alive
    lock.write_text(json.dumps(earlier))
    warnings = []
    run_lock.acquire(tmp_path, log=warnings.append)
    run_lock.release()
    assert "was attempt 0 of this job (SLURM_JOB_ID=7001), which ended before this attempt 1" in warnings[0]
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's static default: no identity
    assert run_lock.job_attempt() == {}


# ------------------------------------------------------------------------------------ full disk
def test_a_full_disk_during_a_save_is_named(tmp_path, monkeypatch):
    import torch

    final = ckpt.step_dir(tmp_path, 6)
    staging = ckpt.staging_dir(tmp_path, 6)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(OSError) as err, checkpointer.disk_full_named(final, ckpt.step_dir(tmp_path, 4)):
        ckpt.write_trainer_state(staging, 0, {"x": 1})
    text = str(err.value)
    assert err.value.errno == errno.ENOSPC
    assert f"No space left on device while saving checkpoint {final}" in text and "step_000004" in text

    # torch's own writer hides the errno: decided by the free space left
    def torch_writer(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed "
                           "writing file data/0: file write failed")  # fmt: skip

    monkeypatch.setattr(torch, "save", torch_writer)
    Usage = type("Usage", (), {"free": 1024})
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: Usage())
    with (
        pytest.raises(OSError, match="No space left on device while saving checkpoint"),
        checkpointer.disk_full_named(final, None),
    ):
        ckpt.write_trainer_state(staging, 0, {"x": 1})
    Usage.free = 10 * 2**30  # plenty of space: another failure keeps its type, with a note naming the save
    with (
        pytest.raises(RuntimeError, match="file write failed") as err,
        checkpointer.disk_full_named(final, None),
    ):
        ckpt.write_trainer_state(staging, 0, {"x": 1})
    assert f"while saving checkpoint {final}" in "".join(err.value.__notes__)
    assert not list(tmp_path.glob(".space_probe*")), "the probe write was left behind"

    # a quota leaves the disk's free space as it was: the probe write beside the checkpoint decides
    real_write = checkpointer.os.write
    probed = []

    def over_quota(fd, data):
        probed.append(len(data))
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(checkpointer.os, "write", over_quota)
    with pytest.raises(OSError) as err, checkpointer.disk_full_named(final, ckpt.step_dir(tmp_path, 4)):
        ckpt.write_trainer_state(staging, 0, {"x": 1})
    monkeypatch.setattr(checkpointer.os, "write", real_write)
    assert probed == [checkpointer.SPACE_PROBE_BYTES]
    assert err.value.errno == errno.EDQUOT
    assert f"Disk quota exceeded while saving checkpoint {final}" in str(err.value)
    assert "raise the quota" in str(err.value) and "step_000004" in str(err.value)
    assert not list(tmp_path.glob(".space_probe*"))


def test_a_really_full_filesystem_is_named_through_torchs_writer(tmp_path):
    """The same on a real 1 MiB tmpfs (where this machine lets a test mount one): torch's writer
    fails without an errno, and the probe write names the cause."""
    import subprocess

    import torch

    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        final = ckpt.step_dir(mount, 2)
        staging = ckpt.staging_dir(mount, 2)
        staging.mkdir(parents=True)
        with pytest.raises(OSError) as err, checkpointer.disk_full_named(final, None):
            ckpt.write_trainer_state(staging, 0, {"weights": torch.zeros(2**20)})  # 4 MiB
        assert err.value.errno == errno.ENOSPC
        assert f"No space left on device while saving checkpoint {final}" in str(err.value)
        assert isinstance(err.value.__cause__, RuntimeError | OSError)
        assert not list(mount.glob(".space_probe*"))
    finally:
        err = None  # the traceback holds torch's open file: lazy unmount, once it is dropped
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


# ------------------------------------------------------------------------------------ stop in setup
def test_a_stop_request_ends_sft_tokenising(tmp_path):
    from transformers import AutoTokenizer

    from mdlmpe_ds.data.sft_encode import build_sft_dataset

    sys.path.insert(0, str(REPO / "tests" / "dist"))
    from sft_fixtures import make_chat, make_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(make_tokenizer(tmp_path / "tok")))
    chat = make_chat(tmp_path / "chat.jsonl")
    stop_request.reset()
    stop_request.request_stop("received SIGTERM", 143)
    try:
        with pytest.raises(stop_request.StoppedDuringSetup, match=rf"tokenising {chat} \(row 0\)") as err:
            build_sft_dataset(str(chat), tokenizer, "llada", 48)
        assert err.value.exit_code == 143 and "nothing to save" in str(err.value)
        stop_request.set_phase("training")  # in the loop a stop finishes the update instead
        build_sft_dataset(str(chat), tokenizer, "llada", 48)
    finally:
        stop_request.reset()


def test_ctrl_c_while_tokenising_stops_promptly(tmp_path):
    """A real SIGINT to a process tokenising a large chat file (a few seconds of work): it stops at
    once with 130 and says that nothing was trained, instead of tokenising on."""
    rows = [
        {"messages": [{"role": "user", "content": f"question {i} " * 20},
                      {"role": "assistant", "content": f"answer {i} " * 40}]}
        for i in range(40000)
    ]  # fmt: skip
    chat = tmp_path / "big.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPO / "tests" / "dist")!r})
        from transformers import AutoTokenizer
        from sft_fixtures import make_tokenizer
        from mdlmpe_ds.training import lifecycle
        from mdlmpe_ds.data.sft_encode import build_sft_dataset
        from mdlmpe_ds.stop_request import StoppedDuringSetup
        from pathlib import Path
        tok = AutoTokenizer.from_pretrained(str(make_tokenizer(Path({str(tmp_path / "tok")!r}))))
        lifecycle.install(grace_s=30)
        print("tokenising", flush=True)
        start = time.monotonic()
        try:
            build_sft_dataset({str(chat)!r}, tok, "llada", 48)
        except StoppedDuringSetup as err:
            print(f"stopped after {{time.monotonic() - start:.1f}} s: {{err}}", flush=True)
            sys.exit(err.exit_code)
        print(f"finished after {{time.monotonic() - start:.1f}} s", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "tokenising"
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    assert proc.returncode == 130, out + err[-3000:]
    assert "stopped after" in out and "nothing to save" in out and took < 10, (took, out)
    assert "stopping the setup (no update trained yet: nothing to save)" in err
    assert "finishing the current update" not in err


def test_a_stop_request_abandons_a_pretraining_validation():
    """A SIGTERM during a long validation: the next forward sees it (agreed over the ranks), the
    validation is abandoned and the task tells the trainer to save now."""
    import torch

    from mdlmpe_ds.config.run import TrainConfig
    from mdlmpe_ds.tasks.pretrain import PretrainTask

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls, self.head = 0, torch.nn.Linear(1, 16)

        def forward(self, ids, valid=None):
            self.calls += 1
            return torch.zeros(*ids.shape, 16)  # [B, L, V]

    config = type("Config", (), {"family": "llada", "mask_token_id": 15})()
    windows = [{"input_ids": torch.arange(8).reshape(1, 8) % 15, "valid": torch.ones(1, 8, dtype=torch.bool)}]
    task = PretrainTask(TrainConfig(eval_samples=2), config, validation=windows * 4)
    said, model = [], Model()
    assert "val/ppl" in task.periodic_metrics(model, 10, 10, said.append) and not task.evaluation_stopped
    assert model.calls == 8  # 4 windows x 2 draws
    stop_request.reset()
    stop_request.set_phase("training")
    stop_request.request_stop("received SIGTERM", 143)
    try:
        assert task.periodic_metrics(model, 10, 10, said.append) == {}
        assert task.evaluation_stopped and model.calls == 8  # no forward after the request
        assert said[-1] == "update 10: validation abandoned (received SIGTERM)"
    finally:
        stop_request.reset()


def test_no_checkpoint_names_what_the_directory_is_instead(tmp_path):
    """A peft adapter export or a run stopped with a weights-only save, passed to generate, evaluate
    or export, got only "no complete checkpoint found"."""
    from mdlmpe_ds.training.checkpoint import resolve_checkpoint

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(
        FileNotFoundError, match=r"no complete checkpoint found \(it is a peft adapter export"
    ):
        resolve_checkpoint(adapter)
    run = tmp_path / "run"
    (run / "weights" / "step_000005").mkdir(parents=True)
    (run / "weights" / "step_000005" / "WEIGHTS.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"weights-only save of a stopped run is at .*step_000005"):
        resolve_checkpoint(run)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint found$"):
        resolve_checkpoint(tmp_path / "empty")
