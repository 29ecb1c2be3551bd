"""The universal copy of a checkpoint (a resume on another world size) is written like a checkpoint
and verified before DeepSpeed reads it, without a process group: DeepSpeed's converter is replaced
by a fake that writes a copy's layout, so a conversion killed at any point, the unsealed copy of an
older version and a truncated file are each caught at resume, naming the file and the command to
rebuild. The real converter runs in tests/dist/test_sft_faults.py (its copy is checked for the seal).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from mdlmpe_ds.config.cli import build_config
from mdlmpe_ds.distributed import engine as eng
from mdlmpe_ds.runs import common
from mdlmpe_ds.training import checkpoint as ckpt
from mdlmpe_ds.training import checkpointer

REPO = Path(__file__).resolve().parents[2]
MODEL = {"hidden_size": 8}
REAL_SEAL = checkpointer.seal


class Killed(BaseException):
    """Stands for SIGKILL: nothing catches it, so the disk is left as a kill leaves it."""


def fake_convert(src: Path, dst: Path, kill_after: int | None = None) -> None:
    """What DeepSpeed's ds_to_universal writes (its scratch tmp/, the per-parameter zero/ files,
    the model states; latest_universal beside ``dst``), killed after ``kill_after`` files if set."""
    files = [
        "tmp/fragment.pt",
        "zero/embed.weight/fp32.pt",
        "zero/embed.weight/exp_avg.pt",
        "zero/optimizer_state.pt",
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
    ]
    for i, rel in enumerate(files):
        if i == kill_after:
            raise Killed
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        (dst / rel).write_bytes(bytes([i]) * 4000)
    shutil.rmtree(dst / "tmp")
    (dst.parent / "latest_universal").write_text(dst.name)


def killed_midway(src: Path, dst: Path) -> None:
    fake_convert(src, dst, kill_after=2)


def killed_before_seal(staging: Path, marker: str) -> None:
    raise Killed


def killed_after_seal(staging: Path, marker: str) -> None:
    REAL_SEAL(staging, marker)
    raise Killed


def convert_command(step: Path) -> int:
    """``python launch/convert_checkpoint.py to-universal STEP``, the command the errors name."""
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", REPO / "launch" / "convert_checkpoint.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["to-universal", str(step)])


def run_config(out: Path):
    return build_config(None, ["--output_dir", str(out)])


def two_rank_checkpoint(out: Path) -> Path:
    """A complete 2-rank checkpoint of ``run_config(out)``, as the trainer commits one."""
    staging = ckpt.staging_dir(out, 4)
    (staging / "ds").mkdir(parents=True)
    for r in range(2):
        (staging / "ds" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"x" * 3000)
    ckpt.write_meta(staging, 4, 2, run_config(out).to_dict(), MODEL, "tok", "fp-a")
    final = ckpt.step_dir(out, 4)
    checkpointer.finalize(staging, final)
    return final


def resume_on_one_rank(out: Path) -> dict:
    """``--resume auto`` on one rank up to the engine (prepare_resume); returns its ds config."""
    ds_config: dict = {"bf16": {"enabled": False}}
    common.prepare_resume("auto", run_config(out), SimpleNamespace(to_dict=lambda: MODEL), ds_config, True)
    return ds_config


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize(
    "kill",
    [("ds_to_universal", killed_midway), ("seal", killed_before_seal), ("seal", killed_after_seal)],
    ids=["converting", "before-seal", "after-seal"],
)
def test_a_killed_conversion_leaves_no_copy_and_the_next_one_succeeds(tmp_path, monkeypatch, kill):
    """Killed while DeepSpeed writes, after it has written everything but before the seal, or
    sealed but not yet renamed into place: no ``ds_universal`` (the resume names the interrupted
    conversion and the command), and that command removes the debris and writes a sealed copy."""
    step = two_rank_checkpoint(tmp_path)
    monkeypatch.setattr(eng, "ds_to_universal", fake_convert)
    where, killed = kill
    with monkeypatch.context() as patch:
        patch.setattr(eng if where == "ds_to_universal" else checkpointer, where, killed)
        with pytest.raises(Killed):
            checkpointer.write_universal(step)
    assert not (step / ckpt.DS_UNIVERSAL_TAG).exists()
    with pytest.raises(RuntimeError) as err:
        resume_on_one_rank(tmp_path)
    assert "ds_universal was interrupted" in str(err.value)
    assert f"Rebuild it with\n  python launch/convert_checkpoint.py to-universal {step}" in str(err.value)

    assert convert_command(step) == 0
    copy = step / ckpt.DS_UNIVERSAL_TAG
    assert ckpt.universal_problems(step) == [] and ckpt.is_complete(copy) and not (copy / "tmp").exists()
    assert sorted(p.name for p in step.iterdir() if "universal" in p.name) == [ckpt.DS_UNIVERSAL_TAG]
    assert resume_on_one_rank(tmp_path)["checkpoint"] == {"load_universal": True}


def test_a_truncated_or_unsealed_copy_is_named_at_resume(tmp_path, monkeypatch):
    """DeepSpeed's loader fails on a truncated file without naming it ("PytorchStreamReader failed
    ... central directory"), and on a partial copy with a bare AssertionError: the resume names
    the file (or the missing seal of a copy written in place by an older version) and the command,
    which replaces the copy."""
    step = two_rank_checkpoint(tmp_path)
    monkeypatch.setattr(eng, "ds_to_universal", fake_convert)
    copy = checkpointer.write_universal(step)
    fp32 = copy / "zero" / "embed.weight" / "fp32.pt"
    fp32.write_bytes(fp32.read_bytes()[:100])
    with pytest.raises(RuntimeError) as err:
        resume_on_one_rank(tmp_path)
    text = str(err.value)
    assert f"{fp32} has 100 bytes, 4000 when saved (truncated or rewritten)" in text
    assert "written by 2 ranks but this run has 1" in text and f"to-universal {step}\n" in text

    (copy / ckpt.COMPLETE).unlink()  # an unsealed copy: how an older version (or a kill) left it
    with pytest.raises(RuntimeError, match=rf"{ckpt.COMPLETE} is missing: an interrupted conversion"):
        resume_on_one_rank(tmp_path)
    assert convert_command(step) == 0
    assert ckpt.universal_problems(step) == [] and fp32.stat().st_size == 4000
    resume_on_one_rank(tmp_path)


def test_without_a_copy_the_resume_says_how_to_convert(tmp_path):
    step = two_rank_checkpoint(tmp_path)
    assert ckpt.universal_problems(step) is None
    with pytest.raises(RuntimeError, match=r"(?s)Convert it once with\n  python launch/convert_checkpoint"):
        resume_on_one_rank(tmp_path)


def test_the_command_refuses_a_damaged_checkpoint_before_converting(tmp_path, monkeypatch, capsys):
    """The command verifies the checkpoint (write_universal converts what it is given): a truncated
    shard is named, the exit status is 2, and nothing is converted or left behind."""
    step = two_rank_checkpoint(tmp_path)
    monkeypatch.setattr(eng, "ds_to_universal", fake_convert)
    shard = step / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(b"x" * 10)
    assert convert_command(step) == 2
    assert shard.name in capsys.readouterr().err
    assert not [p for p in step.iterdir() if "universal" in p.name]
