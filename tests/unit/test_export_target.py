"""Where an export may go and how it replaces an earlier one (mdlmpe_ds/hub/export_target.py): no
stale file of an earlier export survives, files are readable by others, and a target that is a
checkpoint, a run or someone's folder is refused by name. The same through launch/export.py on a
real ZeRO-3 checkpoint: tests/dist/test_sft_resume.py."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from transformers import AutoModel

from mdlmpe_ds.hub.export import finish_export
from mdlmpe_ds.hub.export_target import ExportTargetError, check_target, staged
from mdlmpe_ds.models import DiffusionLM, load_pretrained, preset, save_pretrained


def _model(seed: int) -> DiffusionLM:
    torch.manual_seed(seed)
    return DiffusionLM(preset("llada-tiny", position_encoding="mdlmpe")).eval()


def _export(model, out, tokenizer_dir, max_shard_bytes=5 * 1024**3):
    """What launch/export.py does with a consolidated state: staged save + remote code + tokenizer."""
    with staged(out) as stage:
        save_pretrained(model, stage, model.config, max_shard_bytes=max_shard_bytes)
        finish_export(stage, model.config.family, tokenizer_dir)


def test_sharded_export_over_a_single_file_one_loads_the_new_weights_everywhere(tmp_path, qwen_tokenizer_dir):
    """Before: the single-file model.safetensors of the first export stayed next to the new shards,
    so transformers loaded the old weights and hf_io the new ones."""
    out = tmp_path / "export"
    old, new = _model(0), _model(1)
    _export(old, out, qwen_tokenizer_dir)
    assert (out / "model.safetensors").is_file()
    _export(new, out, qwen_tokenizer_dir, max_shard_bytes=64 * 1024)  # sharded now
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]  # no staging left
    ids = torch.randint(0, new.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[:, 3:7] = new.config.mask_token_id
    theirs = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    ours = load_pretrained(out).eval()
    with torch.no_grad():
        want = new(ids)
        torch.testing.assert_close(ours(ids), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs(ids).logits, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(old(ids), want)  # the two exports really differ


def test_exported_files_are_readable_by_others(tmp_path, qwen_tokenizer_dir):
    out = tmp_path / "export"
    old_mask = os.umask(0o022)
    try:
        _export(_model(0), out, qwen_tokenizer_dir)
    finally:
        os.umask(old_mask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes and all(mode == 0o644 for mode in modes.values()), {k: oct(v) for k, v in modes.items()}
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_a_failed_export_leaves_the_earlier_one_untouched(tmp_path, qwen_tokenizer_dir):
    out = tmp_path / "export"
    _export(_model(0), out, qwen_tokenizer_dir)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RuntimeError, match="disk full"), staged(out) as stage:
        (stage / "config.json").write_text("{}")
        raise RuntimeError("disk full")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_debris_of_an_export_killed_on_this_host_is_removed(tmp_path, qwen_tokenizer_dir):
    """A SIGKILLed export leaves its staging (or set-aside) directory; the next export removes those
    of dead processes on this host and keeps those of live ones (another export in progress)."""
    import socket
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    host = socket.gethostname()
    left = tmp_path / f".export.exporting-{host}-{int(dead.stdout)}"
    aside = tmp_path / f".export.replaced-{host}-{int(dead.stdout)}"
    live = tmp_path / f".export.exporting-{host}-{os.getppid()}"
    for path in (left, aside, live):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"partial")
    _export(_model(0), tmp_path / "export", qwen_tokenizer_dir)
    assert not left.exists() and not aside.exists() and live.is_dir()


def _run(tmp_path):
    """A run directory as training leaves it: checkpoints/step_N with COMPLETE and ds/."""
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000004"
    (step / "ds").mkdir(parents=True)
    (step / "COMPLETE").write_text("step_000004\n")
    (step / "config.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step_000004\n")
    (run / "metrics.jsonl").write_text("")
    return run, step


@pytest.mark.parametrize(
    ("where", "message"),
    [
        (lambda run, step: step, "is the checkpoint being exported"),
        (lambda run, step: step / "export", "inside the checkpoint being exported"),
        (lambda run, step: run / "checkpoints", "holds the checkpoint being exported"),
        (lambda run, step: run, "holds the checkpoint being exported"),
        (lambda run, step: run.parent, "holds the checkpoint being exported"),
        (lambda run, step: run / "checkpoints" / "export", "inside the checkpoints folder"),
    ],
)
def test_an_export_into_its_checkpoint_or_run_is_refused_by_name(tmp_path, where, message):
    run, step = _run(tmp_path)
    target = where(run, step)
    with pytest.raises(ExportTargetError, match=message) as err:
        check_target(target, step)
    assert str(target.resolve()) in str(err.value)
    assert (step / "config.json").read_text() == "{}"


def test_other_runs_checkpoints_and_foreign_files_are_refused(tmp_path):
    run, step = _run(tmp_path)
    other, other_step = _run(tmp_path / "other")
    with pytest.raises(ExportTargetError, match="inside the checkpoint"):
        check_target(other_step / "export", step)
    with pytest.raises(ExportTargetError, match="a training run's output_dir"):
        check_target(other, step)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "results.md").write_text("mine")
    with pytest.raises(ExportTargetError, match=r"holds files an export does not write \(results\.md\)"):
        check_target(notes, step)
    # A new folder inside the run (the README's outputs/run/export) and an earlier export are fine.
    assert check_target(run / "export", step) == (run / "export").resolve()
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    for name in ("config.json", "model.safetensors", "modeling_mdlmpe.py", "tokenizer.json"):
        (earlier / name).write_text("x")
    assert check_target(earlier, step) == earlier.resolve()


def test_a_re_export_keeps_the_users_model_card(tmp_path, qwen_tokenizer_dir):
    """README.md and generation_config.json are names an export target may hold, but the export
    writes neither: the whole-directory swap deleted a model card the user had added. It is
    carried over now; the export's own files are replaced as before."""
    out = tmp_path / "export"
    _export(_model(0), out, qwen_tokenizer_dir)
    (out / "README.md").write_text("# my model card\n")
    (out / "generation_config.json").write_text('{"max_new_tokens": 64}\n')
    weights = (out / "model.safetensors").read_bytes() if (out / "model.safetensors").exists() else None
    _export(_model(1), out, qwen_tokenizer_dir)
    assert (out / "README.md").read_text() == "# my model card\n"
    assert (out / "generation_config.json").read_text() == '{"max_new_tokens": 64}\n'
    if weights is not None:
        assert (out / "model.safetensors").read_bytes() != weights  # the new export's weights


def test_an_export_over_the_runs_own_base_is_refused(tmp_path):
    """A LoRA run trained from an export directory, exported back into that directory: the swap
    replaced the base with the merged model, and the run could then be neither exported as an
    adapter nor resumed. The run's model and tokenizer directories (and folders inside or around
    them) are refused; a hub id is not a directory and is skipped."""
    run, step = _run(tmp_path)
    base = tmp_path / "base"
    base.mkdir()
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ):  # an earlier export: allowed otherwise
        (base / name).write_text("x")
    inputs = (str(base), "GSAI-ML/LLaDA-8B-Instruct")
    for target, word in ((base, "is"), (base / "sub", "overlaps"), (tmp_path, "overlaps")):
        with pytest.raises(ExportTargetError, match=rf"{word} the run's input directory {base.resolve()}"):
            check_target(target, step, inputs)
    assert check_target(run / "export", step, inputs) == (run / "export").resolve()


def test_an_export_of_another_kind_is_not_replaced(tmp_path):
    """An --adapter-only export over the merged export (or over the --base-only base it loads onto)
    deleted it silently; each kind now records itself, and an unmarked earlier export is told apart
    by its files."""
    from mdlmpe_ds.hub.export_target import EXPORT_MARKER, existing_kind, write_marker

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    merged, adapter, legacy = run / "export", run / "adapter", run / "old"
    for folder, kind in ((merged, "merged"), (adapter, "adapter")):
        folder.mkdir()
        write_marker(folder, kind, step, 4)
    legacy.mkdir()
    (legacy / "adapter_config.json").write_text("{}")
    assert (existing_kind(merged), existing_kind(adapter), existing_kind(legacy)) == (
        "merged",
        "adapter",
        "adapter",
    )
    assert json.loads((merged / EXPORT_MARKER).read_text())["step"] == 4
    with pytest.raises(
        ExportTargetError, match=r"holds a merged model export; writing a peft adapter \(--adapter-only\)"
    ):
        check_target(merged, step, kind="adapter")
    with pytest.raises(ExportTargetError, match="holds a peft adapter export; writing a --base-only base"):
        check_target(legacy, step, kind="base")
    with pytest.raises(ExportTargetError, match="holds a merged model export"):
        check_target(merged, step, kind="base")
    assert check_target(merged, step, kind="merged") == merged.resolve()  # a re-export of the same kind
    assert check_target(run / "new", step, kind="adapter") == (run / "new").resolve()
    unmarked = run / "older"
    unmarked.mkdir()
    (unmarked / "config.json").write_text("{}")  # a model export from before markers: merged or base
    assert check_target(unmarked, step, kind="base") == unmarked.resolve()
    with pytest.raises(ExportTargetError, match="holds a model export"):
        check_target(unmarked, step, kind="adapter")
