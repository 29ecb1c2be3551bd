"""Checkpoint safety without a process group: atomic swap and its recovery, manifest verification,
superseded continuations, history truncation, data fingerprints, the fresh-run guard, signals and the
launcher watchdog, and the parameter dtype that DeepSpeed's zero.Init must not change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mdlmpe_ds.data.fingerprint import Fingerprint
from mdlmpe_ds.training import checkpoint as ckpt
from mdlmpe_ds.training import checkpointer
from mdlmpe_ds.training.tracking import truncate_history

REPO = Path(__file__).resolve().parents[2]


def save(out: Path, step: int, payload: bytes = b"x" * 3000, shards: int = 2) -> Path:
    """A checkpoint as Trainer.save writes it: files into step_N.saving, then finalize."""
    staging = ckpt.staging_dir(out, step)
    (staging / "ds").mkdir(parents=True)
    for r in range(shards):
        (staging / "ds" / f"rank{r}_optim_states.pt").write_bytes(payload + bytes([step, r]))
    ckpt.write_meta(staging, step, 2, {}, {"hidden_size": 8}, "tok", "fp-a")
    final = ckpt.step_dir(out, step)
    checkpointer.finalize(staging, final)
    return final


def test_finalize_swaps_a_resaved_step_in_atomically(tmp_path):
    first = save(tmp_path, 6, b"old" * 1000)
    second = save(tmp_path, 6, b"new" * 1000)
    assert first == second and ckpt.is_complete(second)
    assert (second / "ds" / "rank0_optim_states.pt").read_bytes().startswith(b"new")
    assert sorted(p.name for p in ckpt.checkpoints_root(tmp_path).iterdir()) == ["latest", "step_000006"]
    assert ckpt.verify(second) == []
    manifest = json.loads((second / ckpt.MANIFEST).read_text())["files"]
    assert set(manifest) == {"config.json", "ds/rank0_optim_states.pt", "ds/rank1_optim_states.pt"}


def test_recover_interrupted_saves_and_swaps(tmp_path):
    root = ckpt.checkpoints_root(tmp_path)
    save(tmp_path, 2)
    # (a) killed while writing: never resumed from, removed.
    (ckpt.staging_dir(tmp_path, 4) / "ds").mkdir(parents=True)
    # (b) killed between the two renames of a re-save of 6: the new copy is complete, the old aside.
    save(tmp_path, 6, b"old" * 100)
    os.rename(ckpt.step_dir(tmp_path, 6), root / f"step_000006{ckpt.REPLACED}")
    newer = save(tmp_path, 8, b"new" * 100)
    os.rename(newer, ckpt.staging_dir(tmp_path, 6))  # a complete staging dir standing in for step 6
    # (c) only the old copy of step 10 remains (the new one vanished): it is restored.
    save(tmp_path, 10)
    os.rename(ckpt.step_dir(tmp_path, 10), root / f"step_000010{ckpt.REPLACED}")
    actions = ckpt.recover_interrupted(tmp_path)
    assert any("removed the interrupted save" in a and "step_000004" in a for a in actions)
    assert any("completed the interrupted swap" in a and "step_000006" in a for a in actions)
    assert any("restored" in a and "step_000010" in a for a in actions)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_000002", "step_000006", "step_000010"]
    assert (ckpt.step_dir(tmp_path, 6) / "ds" / "rank0_optim_states.pt").read_bytes().startswith(b"new")
    assert ckpt.recover_interrupted(tmp_path) == []  # idempotent


def test_damaged_newest_checkpoint_is_skipped_by_name(tmp_path):
    save(tmp_path, 2)
    newest = save(tmp_path, 4)
    shard = newest / "ds" / "rank1_optim_states.pt"
    with open(shard, "r+b") as fh:
        fh.truncate(100)
    problems = ckpt.verify(newest)
    assert len(problems) == 1 and str(shard) in problems[0] and "truncated" in problems[0]
    logged = []
    assert ckpt.resolve_resume("auto", tmp_path, log=logged.append).name == "step_000002"
    assert "skipping damaged checkpoint" in logged[0] and shard.name in logged[0]
    with pytest.raises(ValueError, match=r"damaged.*rank1_optim_states\.pt"):
        ckpt.resolve_resume(str(newest), tmp_path)
    # Export and evaluation resolve checkpoints the same way.
    with pytest.raises(ValueError, match=r"damaged.*rank1_optim_states\.pt"):
        ckpt.resolve_checkpoint(newest)
    assert ckpt.resolve_checkpoint(tmp_path, log=logged.append).name == "step_000002"


def test_same_size_corruption_fails_the_checksum(tmp_path):
    path = save(tmp_path, 2, payload=os.urandom(3 << 20))  # > 3 sampled MiB: head, middle, tail
    shard = path / "ds" / "rank0_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert any("checksum" in p and shard.name in p for p in ckpt.verify(path))


def test_resuming_an_older_step_sets_newer_ones_aside(tmp_path):
    four, _ = save(tmp_path, 4), save(tmp_path, 8)
    moved = ckpt.supersede_newer(tmp_path, four)
    assert [p.parent.name for p in moved] == [ckpt.SUPERSEDED] and moved[0].name.startswith("step_000008-")
    assert ckpt.newest_complete(tmp_path) == four
    assert (ckpt.checkpoints_root(tmp_path) / "latest").read_text().strip() == "step_000004"


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path):
    two, four = save(tmp_path, 2), save(tmp_path, 4)
    assert checkpointer.prune(tmp_path, keep_last=1, keep=two) == []  # the newer one is the one kept by count
    assert two.is_dir() and four.is_dir()
    assert checkpointer.prune(tmp_path, keep_last=1, keep=four) == [two]


def test_fresh_run_into_a_run_directory_is_refused(tmp_path):
    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.runs.common import clear_overwritten, prepare_output_dir

    save(tmp_path, 2)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    run = build_config(None, ["--output_dir", str(tmp_path)])
    with pytest.raises(FileExistsError, match=r"step_000002.*--resume auto.*--overwrite_output_dir true"):
        prepare_output_dir(None, run)
    prepare_output_dir("auto", run)  # resuming is fine
    overwrite = build_config(None, ["--output_dir", str(tmp_path), "--overwrite_output_dir", "true"])
    prepare_output_dir(None, overwrite, dry_run=True)  # a dry run deletes nothing
    assert ckpt.step_dir(tmp_path, 2).is_dir()
    prepare_output_dir(None, overwrite)  # nor does the check: a typo later must not cost the run
    assert ckpt.step_dir(tmp_path, 2).is_dir() and (tmp_path / "metrics.jsonl").exists()
    clear_overwritten(None, overwrite)  # once the data, model and engine are ready
    assert not ckpt.checkpoints_root(tmp_path).exists() and not (tmp_path / "metrics.jsonl").exists()


def test_a_history_without_checkpoints_is_a_run_and_so_is_a_foreign_resume(tmp_path):
    """A run whose checkpoints were deleted (after its export) keeps its only record in
    metrics.jsonl and tensorboard/: a fresh run there is refused, not truncating it. Resuming
    another directory's checkpoint into a directory that holds a run would mix two histories: refused
    too; into an empty one, fine."""
    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.runs.common import earlier_run, prepare_output_dir, starts_new_history

    out, other = tmp_path / "out", tmp_path / "other"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    run = build_config(None, ["--output_dir", str(out)])
    with pytest.raises(FileExistsError, match=r"already holds a run \(metrics.jsonl\)"):
        prepare_output_dir(None, run)
    (out / "metrics.jsonl").write_text("")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1").write_bytes(b"x")
    assert earlier_run(out) == ["tensorboard/"]
    foreign = str(save(other, 8))
    assert starts_new_history(foreign, out) and not starts_new_history("auto", out)
    assert not starts_new_history(str(out / "checkpoints" / "step_000004"), out)
    with pytest.raises(
        FileExistsError, match=r"tensorboard/\), and --resume .*step_000008 is a checkpoint outside it"
    ):
        prepare_output_dir(foreign, run)
    empty = build_config(None, ["--output_dir", str(tmp_path / "empty")])
    prepare_output_dir(foreign, empty)


def _weights_save(out: Path, step: int) -> Path:
    """A weights-only save as train.save_on_signal model leaves it (weights_only.py)."""
    folder = out / "weights" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    (folder / "WEIGHTS.json").write_text("{}")
    return folder


def test_resume_auto_without_a_checkpoint_sets_the_earlier_records_aside(tmp_path, caplog):
    """--resume auto is the one command a requeued job repeats: where output_dir holds no
    checkpoint (deleted after an export, or a job killed before its first save) it starts a new
    run, but the earlier run's history and weights-only saves move to earlier_runs/, whole, and
    only once the new run is ready; with --overwrite_output_dir they are deleted, weights/ too."""
    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.runs.common import clear_overwritten, earlier_run, prepare_output_dir

    out = tmp_path / "out"
    out.mkdir()
    history = "".join(json.dumps({"step": s}) + "\n" for s in range(1, 9))
    (out / "metrics.jsonl").write_text(history)
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1").write_bytes(b"curve")
    _weights_save(out, 8)
    assert earlier_run(out) == ["metrics.jsonl", "tensorboard/", "weights/"]
    run = build_config(None, ["--output_dir", str(out)])
    with caplog.at_level("WARNING"):
        prepare_output_dir("auto", run)
    assert "holds no checkpoint to continue from" in caplog.text and "earlier_runs" in caplog.text
    assert (out / "metrics.jsonl").read_text() == history  # untouched until the run is ready
    clear_overwritten("auto", run)
    (moved,) = (out / "earlier_runs").iterdir()
    assert (moved / "metrics.jsonl").read_text() == history
    assert (moved / "tensorboard" / "events.out.tfevents.1").read_bytes() == b"curve"
    assert (moved / "weights" / "step_000008" / "WEIGHTS.json").is_file()
    assert earlier_run(out) == []  # the new run writes a history of its own

    again = tmp_path / "again"
    (again / "tensorboard").mkdir(parents=True)
    (again / "tensorboard" / "events.out.tfevents.2").write_bytes(b"curve")
    _weights_save(again, 3)
    overwrite = build_config(None, ["--output_dir", str(again), "--overwrite_output_dir", "true"])
    prepare_output_dir("auto", overwrite)
    clear_overwritten("auto", overwrite)
    assert earlier_run(again) == [] and not (again / "weights").exists()
    assert not (again / "earlier_runs").exists()


def test_overwrite_deletes_the_earlier_runs_weights_only_saves(tmp_path):
    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.runs.common import clear_overwritten, earlier_run, prepare_output_dir

    _weights_save(tmp_path, 6)
    run = build_config(None, ["--output_dir", str(tmp_path)])
    with pytest.raises(FileExistsError, match=r"already holds a run \(weights/\)"):
        prepare_output_dir(None, run)
    overwrite = build_config(None, ["--output_dir", str(tmp_path), "--overwrite_output_dir", "true"])
    save(tmp_path, 3)
    prepare_output_dir(None, overwrite)
    clear_overwritten(None, overwrite)
    assert earlier_run(tmp_path) == [] and not (tmp_path / "weights").exists()


def test_an_epochs_run_resumed_on_another_batch_size_keeps_its_plan(tmp_path):
    """1 -> 2 ranks halved the updates left (it ended at 62% of its epoch), 2 -> 1 doubled them
    past the epoch: the remaining updates are converted to the new update size, and the plan is
    carried, so a second resume on the new size ends where the first said."""
    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.runs.common import per_update_change, resumed_total

    args = ["--output_dir", str(tmp_path), "--epochs", "1", "--grad_accum", "2", "--micro_batch_size", "2"]
    run = build_config(None, args)

    def saved(step, world, total, grad_accum=2, **train):
        config = {"train": {"epochs": 1.0, "max_steps": None, "grad_accum": grad_accum, **train}}
        return ckpt.SavedRun(tmp_path, step, world, config, {}, None, "fp", {}, total)

    # 64 sequences, 32 micro-batches: 16 updates on 1 rank, 8 on 2.
    assert resumed_total(run, 16, None, 2, "fp") == (8, None)  # a fresh run
    total, note = resumed_total(run, 16, saved(10, 1, 16), 2, "fp")
    assert total == 13 and "update 10 of 16" in note and "ends at update 13" in note
    assert resumed_total(run, 16, saved(12, 2, 13), 2, "fp") == (13, None)  # the plan carried
    assert resumed_total(run, 32, saved(4, 2, 8), 1, "fp")[0] == 12  # 2 -> 1: 4 left become 8
    assert resumed_total(run, 16, saved(10, 1, None), 2, "fp")[0] == 13  # an older checkpoint
    assert resumed_total(run, 16, saved(4, 2, 8), 2, "fp") == (8, None)  # nothing changed
    four = build_config(None, [*args[:-4], "--grad_accum", "4", "--micro_batch_size", "2"])
    assert resumed_total(four, 16, saved(4, 2, 8), 2, "fp")[0] == 6  # grad_accum 2 -> 4
    # A changed length, a max_steps run or other data count from scratch.
    assert resumed_total(run, 16, saved(10, 1, 16, epochs=2.0), 2, "fp") == (8, None)
    assert resumed_total(run, 16, saved(10, 1, 16), 2, "other data") == (8, None)
    steps = build_config(None, [*args, "--max_steps", "20"])
    assert resumed_total(steps, 16, saved(10, 1, 16), 2, "fp") == (20, None)
    # The resume says the global batch changed, and what that does to the run's length.
    note = per_update_change(steps, 1, 2, 2)
    assert "holds 8 sequences" in note and "held 4" in note and "keeps its total updates" in note
    assert "converts its remaining updates" in per_update_change(run, 2, 2, 1)
    assert per_update_change(four, 2, 2, 1) is None  # 2 ranks x 2 = 1 rank x 4: as many sequences


def test_history_keeps_each_update_once(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": s} for s in (1, 2, 3, 4, 5, 6)]
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 7, "train/lo')  # torn
    truncate_history(metrics, 4)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    truncate_history(metrics, 0)
    assert metrics.read_text() == ""


def test_data_fingerprint_is_content_sensitive_and_checked(tmp_path):
    def fp(tokens, prompt_lens=(2, 1)):
        return Fingerprint().array("tokens", tokens).array("prompt_lens", list(prompt_lens)).hexdigest()

    a = fp([5, 6, 7, 8])
    assert a == fp([5, 6, 7, 8]) and a != fp([5, 6, 8, 7]) and a != fp([5, 6, 7, 8], (1, 2))
    saved = ckpt.SavedRun(tmp_path, 4, 2, {}, {}, None, a)
    assert ckpt.check_same_data(saved, a, allow_change=False) is None
    with pytest.raises(ValueError, match=r"other data.*--allow_data_change true"):
        ckpt.check_same_data(saved, fp([1]), allow_change=False)
    assert "warning" in ckpt.check_same_data(saved, fp([1]), allow_change=True)
    old = ckpt.SavedRun(tmp_path, 4, 2, {}, {}, None, None)  # written before fingerprints existed
    assert ckpt.check_same_data(old, a, allow_change=False) is None


def test_fp16_ds_config_is_refused_by_name(tmp_path):
    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.distributed.engine import prepare_ds_config

    cfg = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    cfg["fp16"] = {"enabled": True}
    path = tmp_path / "fp16.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"fp16\.json: fp16 is not supported"):
        prepare_ds_config(path, build_config(None, []), world=2)


def test_dry_run_checks_the_batch_against_the_ranks_the_run_will_have(monkeypatch):
    from mdlmpe_ds.runs import launching

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv(launching.CPU_RANKS_ENV, raising=False)
    assert launching.dry_run_world_size() == 2  # CPU-only: the re-launch's default
    monkeypatch.setenv("WORLD_SIZE", "1")  # what the deepspeed launcher sets for one CPU "device"
    assert launching.dry_run_world_size() == 2
    monkeypatch.setenv(launching.CPU_RANKS_ENV, "1")
    assert launching.dry_run_world_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert launching.dry_run_world_size() == 8


def _python(code: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **env},
        cwd=REPO,
    )


def test_signals_request_a_graceful_stop_and_repeats_are_harmless():
    proc = _python(
        """
        import os, signal
        from mdlmpe_ds.training import lifecycle
        lifecycle.install(grace_s=30)
        for _ in range(3):  # the deepspeed launcher, torchrun and a scheduler each pass one on
            os.kill(os.getpid(), signal.SIGTERM)
        print("alive", lifecycle.stop_reason(), lifecycle.exit_code())
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "alive received SIGTERM 143" in proc.stdout


def test_watchdog_stops_a_process_whose_launcher_died(tmp_path):
    """A python 'launcher' starts a worker in a session of its own (as torchrun does) and is then
    SIGKILLed: the worker notices, requests the stop, and exits after the grace period."""
    marker = tmp_path / "worker.txt"
    proc = _python(
        f"""
        import os, signal, subprocess, sys, time
        worker = '''
        import time, sys
        from mdlmpe_ds.training import lifecycle
        chain = lifecycle.install(grace_s=1.0, interval_s=0.1)
        open({str(marker)!r}, "w").write(str(len(chain)))
        while True:
            time.sleep(0.05)
            if lifecycle.stop_reason():
                open({str(marker)!r}, "a").write(" " + lifecycle.stop_reason())
        '''
        launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], start_new_session=True); "
            "print(p.pid, flush=True); time.sleep(60)", worker], stdout=subprocess.PIPE, text=True)
        pid = int(launcher.stdout.readline())
        while not os.path.exists({str(marker)!r}):
            time.sleep(0.05)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                print("worker gone")
                break
            if open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                print("worker gone")
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            print("worker survived")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "worker gone" in proc.stdout, proc.stdout + proc.stderr
    text = marker.read_text()
    assert int(text.split()[0]) >= 2  # the launcher and this test's python are watched
    assert "launcher process" in text and "exited" in text


def test_fp32_parameters_stay_fp32_on_a_cpu_without_fp16():
    """DeepSpeed 0.19.8's zero.Init gave bf16 parameters to an fp32 run on a CPU accelerator without
    fp16 support (operator precedence in _set_dtype). Forced here so that it fails on any machine."""
    proc = _python(
        """
        import os, torch
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: False
        from mdlmpe_ds.distributed import engine
        from mdlmpe_ds.config.cli import build_config
        from mdlmpe_ds.models import DiffusionLM, preset
        run = build_config(None, ["--precision", "fp32", "--micro_batch_size", "1"])
        ds = engine.prepare_ds_config("ds_configs/zero3.json", run, world=1)
        with engine.distributed_session(1.0):
            config = preset("llada-tiny", position_encoding="mdlmpe")
            model = engine.build_model(lambda: DiffusionLM(config), ds)
            print(sorted({str(p.dtype) for p in model.parameters()}))
            try:
                engine.check_param_dtypes(model, torch.bfloat16)
            except RuntimeError as err:
                print("check works:", "torch.bfloat16" in str(err))
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "['torch.float32']" in proc.stdout, proc.stdout
    assert "check works: True" in proc.stdout


def test_resume_hint_drops_flags_a_resume_must_not_repeat():
    from mdlmpe_ds.runs.launching import resume_command

    rest = ["--max_len", "64", "--overwrite_output_dir", "true", "--resume=step_4", "--output_dir", "o d"]
    assert resume_command("launch/sft.py", "ds_configs/zero3.json", rest) == (
        "deepspeed launch/sft.py --deepspeed ds_configs/zero3.json --max_len 64 --output_dir 'o d' "
        "--resume auto"
    )
    # The run's --config file is part of the run; --stop_at repeated would stop again at once.
    rest = ["--stop_at", "2", "--lr", "1e-4", "--train.stop_at=3"]
    assert resume_command("launch/sft.py", "z.json", rest, config="run.yaml") == (
        "deepspeed launch/sft.py --deepspeed z.json --config run.yaml --lr 1e-4 --resume auto"
    )


def test_outcome_line_counts_the_updates_reached():
    from mdlmpe_ds.runs.launching import outcome

    one = [{"loss": 1.5}]
    assert outcome({"step": 2, "total_updates": 4, "history": one * 2}, 2) == (
        "stopped at update 2 of 4 (--stop_at 2), final loss 1.5000"
    )
    assert (
        outcome({"step": 4, "total_updates": 4, "history": one}, None) == "done: 4 updates, final loss 1.5000"
    )
    assert outcome({"step": 2, "total_updates": 4, "history": []}, 2).startswith(
        "nothing trained: the run is at update 2 of 4 and --stop_at is 2"
    )


def test_ranks_holding_other_data_fail_fast_naming_it(tmp_path):
    """Two gloo ranks compare the data digest (the one the checkpoint stores): equal passes, a
    different one raises on every rank with every rank's digest."""
    script = tmp_path / "ranks.py"
    script.write_text(
        textwrap.dedent(
            """
            import socket, torch.distributed as dist, torch.multiprocessing as mp
            from mdlmpe_ds.data.fingerprint import Fingerprint

            def worker(rank, port, same):
                url = f"tcp://127.0.0.1:{port}"
                dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2)
                from mdlmpe_ds.runs.common import assert_same_on_all_ranks
                digest = Fingerprint().array("tokens", [1, 2, 3 if same or rank == 0 else 4]).hexdigest()
                try:
                    assert_same_on_all_ranks(digest, "chat.jsonl: the ranks built different SFT datasets")
                    print(rank, "same", flush=True)
                except RuntimeError as err:
                    print(rank, "raised:", err, flush=True)
                dist.destroy_process_group()

            if __name__ == "__main__":
                for same in (True, False):
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", 0))
                        port = s.getsockname()[1]
                    mp.spawn(worker, args=(port, same), nprocs=2)
            """
        )
    )
    proc = _python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout  # the two ranks' lines may interleave
    assert out.count("same") == 2 and out.count("raised:") == 2, out
    assert out.count("the ranks built different SFT datasets (fingerprints ['") == 2, out


def test_a_restarted_job_resumes_instead_of_refusing_or_overwriting(monkeypatch):
    """torchrun's elastic restarts and Slurm's requeue re-run the command as written: without
    --resume it continues as --resume auto (an explicit --resume is kept); a first start, a count of
    0 or an unreadable value changes nothing."""
    from mdlmpe_ds.runs.launching import RESTART_ENV, resume_on_restart

    for name in RESTART_ENV:
        monkeypatch.delenv(name, raising=False)
    assert resume_on_restart(None) == (None, None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "x")
    assert resume_on_restart(None) == (None, None)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    resume, why = resume_on_restart(None)
    assert resume == "auto" and why.startswith("SLURM_RESTART_COUNT=2: the job was started again")
    assert resume_on_restart("outputs/run/checkpoints/step_000004") == (
        "outputs/run/checkpoints/step_000004",
        None,
    )
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_on_restart(None)[1].startswith("TORCHELASTIC_RESTART_COUNT=1:")


def test_a_zombie_launcher_counts_as_gone():
    """A SIGKILLed launcher stays a zombie until its parent reaps it; /proc still lists it, so the
    ranks' watchdog took it for alive and noticed ~2 s (6 updates) late. A zombie is not live."""
    import signal
    import subprocess
    import sys
    import time

    from mdlmpe_ds.training import lifecycle

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert lifecycle._stat(child.pid) is not None
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while "Z" not in Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]:
            assert time.monotonic() < deadline, "the child did not become a zombie"
            time.sleep(0.05)
        assert lifecycle._stat(child.pid) is None  # not reaped yet, and already gone
    finally:
        child.kill()
        child.wait()
