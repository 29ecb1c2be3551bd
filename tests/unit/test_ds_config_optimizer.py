"""The ds config's optimizer and clipping against the training config (distributed/engine.py:
prepare_ds_config): DeepSpeed spellings that would train another algorithm than AdamW are refused by
key and value, and clipping can be turned off (0, as DeepSpeed's gradient_clipping and HF's
max_grad_norm mean it) from both sides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mdlmpe_ds.config.cli import build_config
from mdlmpe_ds.distributed.engine import prepare_ds_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED = json.loads((REPO / "ds_configs" / "zero3_cpu_test.json").read_text())


def _ds(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**SHIPPED, **changes}))
    return path


@pytest.mark.parametrize(
    "optimizer, told",
    [
        # DeepSpeed trains torch.optim.Adam (L2 decay) here: the probe's loss differed at update 2
        ({"type": "Adam", "params": {"adam_w_mode": False}}, "trains Adam with L2 weight decay"),
        ({"type": "adam", "params": {"adam_w_mode": False, "torch_adam": True}}, "trains Adam with L2"),
        # DeepSpeed ignores it under AdamW, but the user asked for Adam
        ({"type": "AdamW", "params": {"adam_w_mode": False}}, "contradicts optimizer.type 'AdamW'"),
        # a string is read by its truthiness: "false" would train AdamW while saying false
        ({"type": "Adam", "params": {"adam_w_mode": "false"}}, "must be true or false"),
        ({"type": "AdamW", "params": {"amsgrad": True}}, "trains AMSGrad"),
        ({"type": "Adam", "params": {"bias_correction": False}}, "without bias correction"),
    ],
)
def test_an_optimizer_other_than_adamw_is_refused_by_key_and_value(tmp_path, optimizer, told):
    key, value = next((k, v) for k, v in optimizer["params"].items() if k != "torch_adam")
    with pytest.raises(ValueError) as err:
        prepare_ds_config(_ds(tmp_path, optimizer=optimizer), build_config(None, []), world=2)
    text = str(err.value)
    assert f"ds.json: optimizer.params.{key}={json.dumps(value)}" in text and told in text
    assert "remove the key or set it to" in text


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_adamw_spellings_pass(tmp_path, kind):
    optimizer = {"type": kind, "params": {"adam_w_mode": True, "amsgrad": False, "torch_adam": True}}
    ds = prepare_ds_config(_ds(tmp_path, optimizer=optimizer), build_config(None, []), world=2)
    assert ds["optimizer"]["params"]["adam_w_mode"] is True


def test_clipping_can_be_turned_off(tmp_path):
    """gradient_clipping 0 (DeepSpeed's "off") was told to "make them agree" with optim.clip, which
    had to be > 0: no value could agree. ZeRO-3 computes the grad norm (logged, and a non-finite
    one skips the step) whatever the clip: stage3.py's step() clips only when clip_grad > 0."""
    off = build_config(None, ["--clip", "0"])
    assert off.optim.clip == 0
    assert prepare_ds_config(_ds(tmp_path, gradient_clipping=0), off, world=2)["gradient_clipping"] == 0
    assert (
        prepare_ds_config(REPO / "ds_configs" / "zero3.json", build_config(None, []), 2)["gradient_clipping"]
        == 1
    )
    with pytest.raises(ValueError) as err:
        prepare_ds_config(_ds(tmp_path, gradient_clipping=0), build_config(None, []), world=2)
    assert "gradient_clipping=0" in str(err.value) and "--clip 0" in str(err.value)
    with pytest.raises(ValueError, match=r"optim\.clip=-1\.0 must be >= 0 \(0 turns gradient clipping off\)"):
        build_config(None, ["--clip", "-1"])
