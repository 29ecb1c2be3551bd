"""What a resume may change (mdlmpe_ds/training/resume_changes.py): every run-config key has a decision; a
refused change is refused naming the key (or forced), any other change is logged, and the applied
optimizer keys really reach the optimizer after DeepSpeed-style state restoring; docs/resume.md
shows the code's table."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from mdlmpe_ds.config.cli import build_config
from mdlmpe_ds.config.run import RunConfig
from mdlmpe_ds.training import resume_changes as rc

REPO = Path(__file__).resolve().parents[2]
ALL_KEYS = sorted(rc.flat(RunConfig().to_dict()))


def _other(value):
    """A different value of the same kind (validity does not matter to the comparison)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 0.5 + 0.25
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [v * 0.5 for v in value]
    return 7  # None


def _set(tree: dict, key: str, value) -> None:
    *path, last = key.split(".")
    for part in path:
        tree = tree[part]
    tree[last] = value


@pytest.mark.parametrize("key", ALL_KEYS)
def test_every_key_is_applied_or_refused(key, tmp_path):
    """Fails when a run-config key is added without a decision in RESUME_CHANGES."""
    assert key in rc.RESUME_CHANGES, f"{key}: add it to resume_changes.RESUME_CHANGES (and docs/resume.md)"
    saved = RunConfig().to_dict()
    now = copy.deepcopy(saved)
    _set(now, key, _other(rc.flat(saved)[key]))
    kind = rc.RESUME_CHANGES[key][0]
    if kind == rc.REFUSED:
        with pytest.raises(ValueError, match=rf"(?s){key}:.*may not change|may not change.*{key}:"):
            rc.check_resume_config(saved, now, set(), tmp_path)
        if key not in rc.NEVER_FORCED:
            lines = rc.check_resume_config(saved, now, {key}, tmp_path)
            assert lines == [lines[0]] and key in lines[0] and "forced" in lines[0]
    else:
        lines = rc.check_resume_config(saved, now, set(), tmp_path)
        # (a model directory also changes the default lr, reported as its own line)
        (line,) = [x for x in lines if x.startswith(f"changed on resume: {key} ")]
        assert line.endswith(f"({kind})")


def test_the_table_has_no_stale_keys():
    assert sorted(rc.RESUME_CHANGES) == ALL_KEYS


def test_docs_show_the_code_table():
    doc = (REPO / "docs" / "resume.md").read_text()
    assert rc.markdown_table() in doc, "docs/resume.md: paste resume_changes.markdown_table() again"


def test_unchanged_and_unrecorded_keys_are_not_changes(tmp_path):
    saved = RunConfig().to_dict()
    assert rc.check_resume_config(saved, RunConfig().to_dict(), set(), tmp_path) == []
    older = copy.deepcopy(saved)
    del older["train"]["corruption"]  # a checkpoint written before the key existed
    now = RunConfig().to_dict()
    now["train"]["corruption"] = "spans"
    assert rc.check_resume_config(older, now, set(), tmp_path) == []
    # the default lr (None) is the preset's 3e-3: giving it explicitly is no change
    explicit = build_config(None, ["--lr", "3e-3"]).to_dict()
    assert rc.check_resume_config(saved, explicit, set(), tmp_path) == []


def test_corruption_change_is_refused_by_name_and_can_be_forced(tmp_path):
    saved = RunConfig().to_dict()
    now = build_config(None, ["--corruption", "spans"]).to_dict()
    with pytest.raises(ValueError) as err:
        rc.check_resume_config(saved, now, set(), tmp_path / "step_000004")
    text = str(err.value)
    assert "train.corruption: iid -> spans" in text and "--allow_config_change train.corruption" in text
    allowed = rc.parse_allowed(["corruption,lr", "train.seed"])
    assert allowed == {"train.corruption", "optim.lr", "train.seed"}
    assert rc.check_resume_config(saved, now, allowed, tmp_path) == [
        "changed on resume: train.corruption iid -> spans (forced by --allow_config_change)"
    ]
    with pytest.raises(ValueError, match="unknown key 'corruptoin'"):
        rc.parse_allowed(["corruptoin"])


def test_lr_change_is_logged_with_both_values(tmp_path):
    saved = build_config(None, ["--lr", "3e-3"]).to_dict()
    now = build_config(None, ["--lr", "1e-4"]).to_dict()
    assert rc.check_resume_config(saved, now, set(), tmp_path) == [
        "changed on resume: optim.lr 0.003 -> 0.0001 (applied)"
    ]


def test_a_full_checkpoint_resumed_with_lora_says_what_it_is(tmp_path):
    saved = RunConfig().to_dict()
    now = build_config(None, ["--lora", "r=4,alpha=8"]).to_dict()
    with pytest.raises(ValueError) as err:
        rc.check_resume_config(saved, now, {"model.lora"}, tmp_path / "step_000004")
    text = str(err.value)
    assert "is a full fine-tune checkpoint" in text and "without --lora" in text
    assert "is a LoRA checkpoint" not in text and "--allow_config_change" not in text
    with pytest.raises(ValueError, match=r"it is a LoRA checkpoint: resume it with --lora r=4"):
        rc.check_resume_config(now, saved, set(), tmp_path)


def test_a_lora_resume_names_the_setting_that_differs(tmp_path):
    """r 4 -> 8 or dropout 0.05 -> 0.1 both said "a LoRA and a full fine-tune checkpoint hold
    different parameters; cannot be forced", though both runs are LoRA. r and targets decide the
    adapters' shapes (never forced); alpha and dropout do not, so --allow_config_change forces them."""
    saved = build_config(None, ["--lora", "r=4,alpha=8,dropout=0.05,targets=q,v"]).to_dict()
    rank = build_config(None, ["--lora", "r=8,alpha=8,dropout=0.05,targets=q,v"]).to_dict()
    with pytest.raises(ValueError) as err:
        rc.check_resume_config(saved, rank, {"model.lora"}, tmp_path)
    text = str(err.value)
    assert "the LoRA settings differ: r 4 -> 8" in text and "cannot be forced" in text
    assert "full fine-tune" not in text and "--allow_config_change" not in text
    drop = build_config(None, ["--lora", "r=4,alpha=8,dropout=0.1,targets=q,v"]).to_dict()
    with pytest.raises(ValueError) as err:
        rc.check_resume_config(saved, drop, set(), tmp_path)
    text = str(err.value)
    assert "dropout 0.05 -> 0.1" in text and "--allow_config_change model.lora" in text
    assert "cannot be forced" not in text
    lines = rc.check_resume_config(saved, drop, {"model.lora"}, tmp_path)
    assert lines and "forced by --allow_config_change" in lines[0]


@pytest.mark.parametrize(
    "flag, key, told",
    [
        ("--micro_batch_size", "train.micro_batch_size", "--allow_config_change train.grad_accum"),
        ("--seed", "train.seed", "resume with --seed 1234"),
    ],
)
def test_a_forced_sampler_key_is_refused_before_the_engine(tmp_path, flag, key, told):
    """--allow_config_change train.micro_batch_size was logged as forced, and the sampler then
    refused the position once the engine was built (minutes on a large model). Refused up front,
    as a key that cannot be forced, naming what to do instead."""
    saved = build_config(None, ["--micro_batch_size", "2"]).to_dict()
    now = copy.deepcopy(saved)
    _set(now, key, rc.flat(saved)[key] * 2)
    with pytest.raises(ValueError) as err:
        rc.check_resume_config(saved, now, {key}, tmp_path / "step_000004")
    text = str(err.value)
    assert f"{key}: " in text and "cannot be forced" in text and told in text
    assert f"--allow_config_change {key}" not in text
    if key == "train.micro_batch_size":
        assert "resume with --micro_batch_size 2" in text


def test_every_sampler_order_key_of_the_run_config_is_never_forced():
    """The sampler refuses a position saved under another value of these (load_state_dict), so a
    forced change would only fail after the engine is built."""
    from mdlmpe_ds.data.sampler import _ORDER_KEYS

    run_keys = {f"train.{k}" for k in _ORDER_KEYS} & set(rc.RESUME_CHANGES)
    assert run_keys == {"train.micro_batch_size", "train.seed"}
    assert run_keys <= set(rc.NEVER_FORCED)


class _Engine:
    """The two attributes apply_optim_settings uses, as DeepSpeed exposes them."""

    def __init__(self, optimizer, scheduler):
        self.optimizer, self.lr_scheduler = optimizer, scheduler


def _engine_for(run: RunConfig, total: int, state=None) -> _Engine:
    from mdlmpe_ds.distributed.engine import _lr_factor

    params = [torch.nn.Parameter(torch.ones(3))]
    o = run.optim
    opt = torch.optim.AdamW(params, lr=run.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor(run, total))
    if state is not None:  # what DeepSpeed's load_checkpoint restores
        opt.load_state_dict(state[0])
        sched.load_state_dict(state[1])
    return _Engine(opt, sched)


def test_applied_optim_keys_reach_the_optimizer_after_a_restore():
    """DeepSpeed restores the saved param groups and base lrs: without apply_optim_settings the
    resumed run keeps the old lr, betas and weight decay (the silent case)."""
    from mdlmpe_ds.distributed.engine import _lr_factor, apply_optim_settings

    old = build_config(None, ["--lr", "3e-3", "--warmup_steps", "2", "--max_steps", "8"])
    first = _engine_for(old, 8)
    for _ in range(4):
        first.optimizer.step()
        first.lr_scheduler.step()
    state = (first.optimizer.state_dict(), first.lr_scheduler.state_dict())
    new = build_config(
        None, ["--lr", "1e-4", "--warmup_steps", "2", "--max_steps", "8", "--betas", "[0.8, 0.9]",
               "--weight_decay", "0.2", "--min_lr_ratio", "0.5"],
    )  # fmt: skip
    resumed = _engine_for(new, 8, state)
    assert resumed.optimizer.param_groups[0]["lr"] == first.optimizer.param_groups[0]["lr"]  # restored: old
    apply_optim_settings(resumed, new, 8)
    group = resumed.optimizer.param_groups[0]
    assert group["lr"] == 1e-4 * _lr_factor(new, 8)(4)
    assert group["betas"] == (0.8, 0.9) and group["weight_decay"] == 0.2
    resumed.optimizer.step()
    resumed.lr_scheduler.step()
    assert resumed.optimizer.param_groups[0]["lr"] == 1e-4 * _lr_factor(new, 8)(5)
    # unchanged settings: the same numbers as the restored state
    same = _engine_for(old, 8, state)
    before = same.optimizer.param_groups[0]["lr"]
    apply_optim_settings(same, old, 8)
    assert same.optimizer.param_groups[0]["lr"] == before


@pytest.mark.parametrize(
    "saved, recorded, now, resolved_now, refused",
    [
        ("auto", "bf16", "auto", "fp32", True),  # a GPU checkpoint resumed on a CPU (or bf16 off)
        ("auto", "bf16", "bf16", "bf16", False),  # what the refusal says to do
        ("bf16", None, "auto", "bf16", False),  # an explicit value is its own resolution
        ("auto", None, "auto", "fp32", False),  # a checkpoint from before the record: as before
        ("auto", None, "bf16", "bf16", True),  # ... compared as written, as before
    ],
)
def test_precision_is_compared_as_resolved(tmp_path, saved, recorded, now, resolved_now, refused):
    before = build_config(None, ["--precision", saved]).to_dict()
    after = build_config(None, ["--precision", now]).to_dict()
    resolved = ({"train.precision": recorded}, {"train.precision": resolved_now})
    if not refused:
        assert rc.check_resume_config(before, after, set(), tmp_path, resolved) == []
        return
    with pytest.raises(ValueError, match=r"train\.precision") as err:
        rc.check_resume_config(before, after, {"train.precision"}, tmp_path, resolved)
    assert "cannot be forced" in str(err.value) and "--allow_config_change" not in str(err.value)


class _SavingEngine:
    """What Checkpointer.save asks of DeepSpeed's engine: its shards (the names DeepSpeed gives
    them in bf16) and whether it runs in bf16."""

    module = None

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        shards = Path(save_dir) / tag
        shards.mkdir()
        (shards / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 100)

    def bfloat16_enabled(self) -> bool:
        return True


def test_an_auto_precision_that_resolved_otherwise_is_refused_at_resume(tmp_path, monkeypatch):
    """precision auto is bf16 on a GPU with ds_configs/zero3.json and fp32 on a CPU. The checkpoint
    records what it ran in, and a resume where auto means the other precision is refused before the
    engine exists, naming both (else DeepSpeed fails on a missing zero_pp_rank_0_..._optim_states.pt:
    a bf16 run wrote bf16_zero_pp_rank_*)."""
    from types import SimpleNamespace

    from mdlmpe_ds.runs.common import prepare_resume
    from mdlmpe_ds.training.checkpointer import Checkpointer, RunMeta

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = build_config(None, ["--output_dir", str(tmp_path)])
    assert run.train.precision == "auto"
    model = SimpleNamespace(to_dict=lambda: {"hidden_size": 8})
    saver = Checkpointer(tmp_path, 2, RunMeta(run, model, "tok"), say=lambda _: None)
    step = saver.save(_SavingEngine(), 4, lambda: {})
    with pytest.raises(ValueError) as err:
        prepare_resume("auto", run, model, {"bf16": {"enabled": False}}, dry_run=True)
    text = str(err.value)
    assert "train.precision: auto (resolved to bf16) -> auto (resolved to fp32)" in text
    assert "cannot be forced: resume with --precision bf16" in text and str(step) in text
    assert prepare_resume("auto", run, model, {"bf16": {"enabled": True}}, dry_run=True) == step
