"""LoRA (mdlmpe_ds/lora/adapters.py) without a process group: the --lora spec, which modules peft wraps and
which parameters train, the merge maths against the adapter-wrapped model, the peft adapter
directory, the checkpoint key check, and the memory plan of a dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mdlmpe_ds.attention import AttentionImpl
from mdlmpe_ds.lora import adapters as lora
from mdlmpe_ds.lora import base as lora_base
from mdlmpe_ds.lora import checkpoints as lora_checkpoints
from mdlmpe_ds.lora import export as lora_export
from mdlmpe_ds.lora import spec as lora_spec
from mdlmpe_ds.lora.spec import LoraSpec
from mdlmpe_ds.models.presets import preset
from mdlmpe_ds.models.transformer import DiffusionLM

REPO = Path(__file__).resolve().parents[2]
ALL = ("q", "k", "v", "o", "gate", "up", "down")


def _tiny(family: str = "llada", encoding: str = "mdlmpe") -> DiffusionLM:
    torch.manual_seed(0)
    cfg = preset(
        f"{family}-tiny",
        position_encoding=encoding,
        max_seq_len=32,
        mdlmpe={"max_seq_len": 32},
    )
    return DiffusionLM(cfg, impl=AttentionImpl(backend="reference"))


def _randomize(model: torch.nn.Module, seed: int = 1) -> None:
    """Non-zero adapters (B starts at 0) and non-zero MDLMPE residuals, so merges are not trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=gen))


# ------------------------------------------------------------------------------------ the spec
def test_parse_full_form_defaults_and_round_trip():
    spec = lora_spec.parse("r=16,alpha=32,dropout=0.05,targets=q,k,v,o,gate,up,down")
    assert spec == LoraSpec(16, 32.0, 0.05, ALL)
    assert spec.scale == 2.0
    assert lora_spec.parse(spec.text()) == spec
    assert lora_spec.parse("r=8") == LoraSpec(8, 32.0, 0.05, ALL)
    assert lora_spec.parse("targets=all,r=4").targets == ALL
    # order and spelling do not matter: canonical order, LLaDA's upstream names and the module names
    assert lora_spec.parse("targets=down,q").targets == ("q", "down")
    assert lora_spec.parse("targets=attn_out,ff_proj,ff_out,up_proj").targets == ("o", "gate", "up", "down")
    assert lora_spec.parse("targets=q_proj,o_proj,gate_proj").targets == ("q", "o", "gate")


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("rank=4", "'rank'"),
        ("r=4,targets=q,qkv", "'qkv'"),
        ("r=0", "r=0"),
        ("dropout=1.0", "dropout=1.0"),
        ("alpha=-1", "alpha=-1"),
        ("r=4,16", "'16'"),
        ("r=4,r=8", "'r' given twice"),
        ("r=four", "bad number"),
    ],
)
def test_parse_errors_name_the_bad_part(text, named):
    with pytest.raises(ValueError, match="--lora") as err:
        lora_spec.parse(text)
    assert named in str(err.value)


def test_config_key_and_config_file_section(tmp_path):
    from mdlmpe_ds.config.cli import build_config, from_mapping

    run = build_config(None, ["--lora", "r=4,targets=v,q"])
    assert run.model.lora == "r=4,alpha=32,dropout=0.05,targets=q,v"
    assert lora.spec_of(run) == LoraSpec(4, 32.0, 0.05, ("q", "v"))
    assert lora.spec_of(build_config(None, [])) is None
    file = tmp_path / "run.json"
    file.write_text(json.dumps({"model": {"lora": {"r": 8, "alpha": 16, "targets": ["q", "down"]}}}))
    assert build_config(str(file), []).model.lora == "r=8,alpha=16,dropout=0.05,targets=q,down"
    with pytest.raises(ValueError, match="unknown key 'rnak'"):
        from_mapping({"model": {"lora": {"rnak": 8}}})
    with pytest.raises(ValueError, match=r"model.lora.*unknown LoRA target 'x'"):
        build_config(None, ["--lora", "targets=x"])


# ------------------------------------------------------------------------------------ injection
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_only_the_target_projections_are_wrapped_and_mdlmpe_trains_in_full(family):
    model = _tiny(family)
    before = {n: p.numel() for n, p in model.named_parameters()}
    mdlmpe = set(model.mdlmpe_parameter_names())
    assert mdlmpe  # phase MLPs, W_p, b_p, gate
    lora.inject(model, lora_spec.parse("r=2,targets=q,v,down"))
    wrapped = sorted(n for n, m in model.named_modules() if hasattr(m, "lora_A"))
    layers = model.config.num_layers
    assert wrapped == sorted(
        f"layers.{i}.{path}"
        for i in range(layers)
        for path in ("attn.q_proj", "attn.v_proj", "mlp.down_proj")
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapters = {n for n in trainable if lora.is_adapter_name(n)}
    assert trainable == adapters | mdlmpe and len(adapters) == 2 * len(wrapped)
    frozen = {lora.base_name(n) for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == set(before) - mdlmpe  # every backbone parameter, none lost or added
    counts = lora.parameter_counts(model)
    assert counts["frozen"] == sum(before[n] for n in frozen)
    assert counts["mdlmpe"] == sum(before[n] for n in mdlmpe)
    assert counts["trainable"] == counts["adapter"] + counts["mdlmpe"]
    assert counts["adapter"] == lora.adapter_parameter_count(
        model.config, lora_spec.parse("r=2,targets=q,v,down")
    )


def test_reset_adapters_is_deterministic_and_starts_at_the_base():
    outputs = []
    for _ in range(2):
        model = _tiny()
        plain = _tiny()
        lora.inject(model, lora_spec.parse("r=4"))
        lora.reset_adapters(model, seed=7)
        a = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_A." in n}
        assert all(float(t.abs().sum()) > 0 for t in a.values())
        assert all(float(p.detach().abs().sum()) == 0 for n, p in model.named_parameters() if ".lora_B." in n)
        outputs.append(a)
        ids = torch.randint(0, 100, (2, 12))
        with torch.no_grad():  # B = 0: the adapted model is the base
            torch.testing.assert_close(model.eval()(ids), plain.eval()(ids), rtol=0, atol=0)
    assert all(torch.equal(outputs[0][n], outputs[1][n]) for n in outputs[0])


# ------------------------------------------------------------------------------------ export maths
def _trained(spec: LoraSpec, family: str = "llada") -> tuple[DiffusionLM, dict[str, torch.Tensor]]:
    """A tiny adapter-wrapped model with non-zero adapters and MDLMPE, and its state dict."""
    model = _tiny(family)
    lora.inject(model, spec)
    _randomize(model)
    return model.eval(), {n: p.detach().clone() for n, p in model.named_parameters()}


def test_merge_is_w_plus_scaled_ba_and_gives_the_adapter_models_logits():
    spec = lora_spec.parse("r=4,alpha=12,dropout=0.1")
    model, state = _trained(spec)
    base, adapters, mdlmpe = lora_export.split_state(state)
    merged = lora_export.merge(base, adapters, mdlmpe, spec)
    a, b = adapters["layers.1.mlp.up_proj"]
    torch.testing.assert_close(
        merged["layers.1.mlp.up_proj.weight"] - base["layers.1.mlp.up_proj.weight"], (b @ a) * 3.0
    )
    assert torch.equal(merged["lm_head.weight"], base["lm_head.weight"])  # not adapted: as is
    plain = _tiny()
    plain.load_state_dict(merged, strict=True)
    ids = torch.randint(0, 100, (2, 16))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 12:] = False
    with torch.no_grad():  # eval: dropout off, so the wrapped and merged models are one function
        torch.testing.assert_close(
            plain.eval()(ids, valid=valid), model(ids, valid=valid), rtol=1e-5, atol=1e-5
        )


def test_adapter_directory_loads_with_peft(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    spec = lora_spec.parse("r=4,alpha=8,targets=q,k,o,gate")
    model, state = _trained(spec)
    base, adapters, mdlmpe = lora_export.split_state(state)
    files = lora_export.write_adapter_dir(
        tmp_path / "adapter", adapters, mdlmpe, spec, base_model="some/base"
    )
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, "some/base")
    assert [f.name for f in files] == [
        "adapter_config.json",
        "adapter_model.safetensors",
        lora_spec.MDLMPE_FILE,
    ]
    fresh = _tiny()
    with torch.no_grad():  # the base, then the trained MDLMPE weights from the adapter directory
        fresh.load_state_dict(
            {**base, **load_file(str(tmp_path / "adapter" / lora_spec.MDLMPE_FILE))}, strict=True
        )
    wrapped = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ids), model(ids), rtol=0, atol=0)


_NO_MDLMPE_DS = """
import sys
sys.modules["mdlmpe_ds"] = None  # this process cannot import the project
import torch
from peft import PeftModel
from transformers import AutoModel

base, adapter, ids, out = sys.argv[1:5]
model = PeftModel.from_pretrained(AutoModel.from_pretrained(base, trust_remote_code=True), adapter).eval()
with torch.no_grad():
    torch.save(model(torch.load(ids), aligned=True).logits, out)
"""


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_adapter_export_loads_with_peft_onto_the_base_export_without_mdlmpe_ds(tmp_path, family):
    """The ecosystem's way: PeftModel.from_pretrained(AutoModel.from_pretrained(BASE, trust_remote_code=True),
    ADAPTER) in a process that cannot import mdlmpe_ds gives the trained model's logits. BASE is the
    base with the trained MDLMPE weights (export --base-only); the adapter names the exported
    model's modules and the base's hub id and revision."""
    import subprocess
    import sys

    from mdlmpe_ds.hub.export import finish_export
    from mdlmpe_ds.models.hf_io import save_pretrained

    spec = lora_spec.parse("r=4,alpha=8,targets=q,k,o,gate,down")
    model, state = _trained(spec, family)
    base, adapters, mdlmpe = lora_export.split_state(state)
    base_export = tmp_path / "base"
    save_pretrained(lora_export.merge(base, {}, mdlmpe, spec), base_export, model.config)
    finish_export(base_export, family, None)
    lora_export.write_adapter_dir(
        tmp_path / "adapter", adapters, mdlmpe, spec, "org/base-model", family=family, revision="v1"
    )
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("org/base-model", "v1")
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    ids[:, 5:9] = model.config.mask_token_id
    torch.save(ids, tmp_path / "ids.pt")
    script = tmp_path / "load.py"
    script.write_text(_NO_MDLMPE_DS)
    args = [str(base_export), str(tmp_path / "adapter"), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")]
    proc = subprocess.run(
        [sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        want = model(ids)
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), want, rtol=1e-5, atol=1e-5)


def test_split_state_refuses_half_an_adapter():
    _, state = _trained(lora_spec.parse("r=2,targets=q"))
    del state["layers.0.attn.q_proj.lora_B.default.weight"]
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q_proj is incomplete"):
        lora_export.split_state(state)


# ------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_key_check(tmp_path):
    spec = lora_spec.parse("r=4,targets=q,v")
    model = _tiny()
    lora.inject(model, spec)
    names = lora_checkpoints.trainable_names(model)
    lora_checkpoints.write_checkpoint_meta(tmp_path, spec, names)
    lora_checkpoints.check_checkpoint(tmp_path, spec, names)  # same: passes
    # alpha and dropout leave the adapters' shapes alone (a forced resume may change them)
    lora_checkpoints.check_checkpoint(
        tmp_path, lora_spec.parse("r=4,alpha=64,dropout=0.2,targets=q,v"), names
    )
    with pytest.raises(ValueError, match=r"checkpoint trained --lora r=4.*this run has --lora r=8"):
        lora_checkpoints.check_checkpoint(tmp_path, lora_spec.parse("r=8,targets=q,v"), names)
    with pytest.raises(ValueError, match=r"missing.*layers.0.attn.k_proj.lora_A"):
        lora_checkpoints.check_checkpoint(
            tmp_path, spec, [*names, "layers.0.attn.k_proj.lora_A.default.weight"]
        )
    with pytest.raises(ValueError, match=r"unexpected.*embed.mdlmpe"):
        lora_checkpoints.check_checkpoint(
            tmp_path, spec, [n for n in names if not n.startswith("embed.mdlmpe")]
        )
    with pytest.raises(ValueError, match=r"LoRA checkpoint.*full fine-tune: resume it with --lora r=4"):
        lora_checkpoints.check_checkpoint(tmp_path, None, [])
    with pytest.raises(ValueError, match="full fine-tune checkpoint"):
        lora_checkpoints.check_checkpoint(tmp_path / "missing", spec, names)


def test_find_base_file_names_where_it_looked(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    config = {"train": {"output_dir": str(tmp_path / "elsewhere")}, "model": {}}
    with pytest.raises(FileNotFoundError, match=r"lora_base.safetensors"):
        lora_base.find_base_file(step, config)
    (tmp_path / "run" / lora_spec.BASE_FILE).write_bytes(b"x")
    assert lora_base.find_base_file(step, config) == tmp_path / "run" / lora_spec.BASE_FILE


def _preset_lora_checkpoint(tmp_path, base=None):
    """A preset LoRA run's layout: output_dir/lora_base.safetensors and a step directory whose
    lora.json records ``base`` (the identity of the base it was trained on)."""
    from safetensors.torch import save_file

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    tensors = {n: p.detach().clone() for n, p in _tiny().named_parameters() if not lora.is_mdlmpe_name(n)}
    save_file(tensors, str(run / lora_spec.BASE_FILE), metadata={"format": "pt"})
    spec = lora_spec.parse("r=4,targets=q,v")
    lora_checkpoints.write_checkpoint_meta(step, spec, [], base)
    config = {"train": {"output_dir": str(run)}, "model": {"model_name_or_path": None}}
    return run, step, config, tensors


def test_base_identity_is_checked_when_the_base_is_read_again(tmp_path):
    run, step, config, tensors = _preset_lora_checkpoint(tmp_path)
    identity = lora_base.base_identity(run / lora_spec.BASE_FILE)
    lora_checkpoints.write_checkpoint_meta(step, lora_spec.parse("r=4,targets=q,v"), [], identity)
    assert lora_base.recorded_base_identity(step) == identity and identity["kind"] == "file"
    assert sorted(lora_export.read_base(step, config)) == sorted(tensors)  # the same base: read
    from safetensors.torch import save_file

    other = {n: t + 1 for n, t in tensors.items()}  # another run's base: same names and shapes
    save_file(other, str(run / lora_spec.BASE_FILE), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"lora_base\.safetensors: not the base this LoRA checkpoint was trained on"
    ):
        lora_export.read_base(step, config)
    # a checkpoint from before identities were recorded is read as it is
    lora_checkpoints.write_checkpoint_meta(step, lora_spec.parse("r=4,targets=q,v"), [])
    assert sorted(lora_export.read_base(step, config)) == sorted(tensors)


def test_a_pretrained_directory_base_is_identified_by_sampled_digests(tmp_path):
    from mdlmpe_ds.models.hf_io import save_pretrained

    model = _tiny()
    save_pretrained(model, tmp_path / "base", model.config)
    identity = lora_base.base_identity(tmp_path / "base")
    assert identity["kind"] == "directory" and set(identity["files"]) == {"config.json", "model.safetensors"}
    save_pretrained(DiffusionLM(model.config), tmp_path / "base", model.config)  # another init
    assert lora_base.base_identity(tmp_path / "base") != identity


def test_a_truncated_base_file_is_named(tmp_path):
    run, step, config, _ = _preset_lora_checkpoint(tmp_path)
    file = run / lora_spec.BASE_FILE
    with open(file, "r+b") as fh:
        fh.truncate(file.stat().st_size // 2)
    with pytest.raises(ValueError, match=rf"{file}: the LoRA run's frozen base cannot be read .*truncated"):
        lora_export.read_base(step, config)


# ------------------------------------------------------------------------------------ dry run
def test_dry_run_counts_trainable_and_frozen_and_plans_less_optimizer_memory(capsys, monkeypatch):
    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.distributed import engine as eng
    from mdlmpe_ds.runs.common import build_engine

    monkeypatch.setenv("WORLD_SIZE", "8")
    results = {}
    for name, extra in (("full", []), ("lora", ["--lora", "r=16,alpha=32,dropout=0.05"])):
        run = build_config(
            None, ["--micro_batch_size", "1", "--max_len", "64", "--precision", "bf16", *extra]
        )
        cfg = preset("llada-tiny", position_encoding="mdlmpe", max_seq_len=64, mdlmpe={"max_seq_len": 64})
        ds = eng.prepare_ds_config(REPO / "ds_configs" / "zero3.json", run, world=8)
        _, built = build_engine(run, cfg, ds, total=3, n_examples=10, dry_run=True)
        results[name] = (built, built["plan"])  # the plan is logged, and returned
    built, out = results["lora"]
    params = built["params"]
    assert "LoRA r=16,alpha=32,dropout=0.05,targets=q,k,v,o,gate,up,down: trainable" in out
    assert params["trainable"] == params["adapter"] + params["mdlmpe"]
    assert params["frozen"] == params["backbone"]
    assert f"{params['trainable']:,} trainable" in out  # in the optimizer/gradient lines of the plan
    # gradients and optimizer states of the trainable parameters only: a smaller plan in total
    assert built["memory_gib"] < results["full"][0]["memory_gib"]


def test_memory_plan_of_llada_8b_with_lora():
    """The numbers of docs/gpu.md: LoRA r=16 on all seven projections of LLaDA-8B, 8 GPUs, bf16."""
    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.distributed import engine as eng
    from mdlmpe_ds.training.memory_plan import plan_memory

    run = build_config(None, ["--micro_batch_size", "1", "--max_len", "2048", "--precision", "bf16"])
    ds = eng.prepare_ds_config(REPO / "ds_configs" / "zero3.json", run, world=8)
    cfg = preset("llada-8b", max_seq_len=2048, mdlmpe={"max_seq_len": 2048})
    spec = lora_spec.parse("r=16,alpha=32,dropout=0.05")
    adapters = lora.adapter_parameter_count(cfg, spec)
    with torch.device("meta"):
        mdlmpe = DiffusionLM(cfg).num_mdlmpe_parameters()
    full = plan_memory(cfg, ds, 8, 1, 2048)
    with_lora = plan_memory(cfg, ds, 8, 1, 2048, trainable_params=adapters + mdlmpe, extra_params=adapters)
    ratio = with_lora.item("optimizer states (ZeRO-3 shard)") / full.item("optimizer states (ZeRO-3 shard)")
    assert ratio < 0.01  # ~42M of ~8B parameters trained
    assert with_lora.total < full.total
    assert with_lora.item("parameters (ZeRO-3 shard)") > full.item("parameters (ZeRO-3 shard)")


def test_a_run_resumed_from_another_runs_checkpoint_keeps_its_own_base(tmp_path):
    """A preset LoRA run resumed from another directory's checkpoint got no base file of its own:
    once that directory was moved, it could be neither resumed nor exported. ``adopt_base`` copies
    it atomically (no temporary left), once; the lookup names each place it looked once."""
    source = tmp_path / "a" / lora_spec.BASE_FILE
    source.parent.mkdir()
    source.write_bytes(b"base" * 1000)
    identity = lora_base.base_identity(source)
    copy = lora_base.adopt_base(source, tmp_path / "b", identity)
    assert copy == tmp_path / "b" / lora_spec.BASE_FILE and copy.read_bytes() == source.read_bytes()
    assert not list((tmp_path / "b").glob("*.tmp"))
    assert lora_base.adopt_base(source, tmp_path / "b", identity) is None
    assert lora_base.adopt_base(source, tmp_path / "a", identity) is None  # its own run: nothing to copy
    copy.write_bytes(b"stale" * 800)  # a leftover of another base, even of the same size: replaced
    assert lora_base.adopt_base(source, tmp_path / "b", identity) == copy
    assert copy.read_bytes() == source.read_bytes()
    step = tmp_path / "c" / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as err:
        lora_base.find_base_file(step, {"train": {"output_dir": str(tmp_path / "c")}})
    assert str(err.value).count(str(tmp_path / "c" / lora_spec.BASE_FILE)) == 1


def test_a_partial_edit_of_a_pretrained_base_is_caught_and_old_records_still_match(tmp_path):
    """A probe changed 2,000 embedding rows in the middle of a shard, between the head/middle/tail
    samples, and the resume accepted the base. The spread digest sees an edit spanning one of its
    steps; a checkpoint recorded before it existed (size and crc32 only) is compared on those."""
    from mdlmpe_ds.data.store_integrity import sampled_content_hash
    from mdlmpe_ds.models.hf_io import save_pretrained
    from mdlmpe_ds.training import checkpoint as ckpt

    model = _tiny()
    base = tmp_path / "base"
    save_pretrained(model, base, model.config)
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    identity = lora_base.base_identity(base)
    lora_checkpoints.write_checkpoint_meta(step, lora_spec.parse("r=4,targets=q,v"), [], identity)
    assert lora_base.check_base_identity(step, base) == identity
    old = {
        **identity,
        "files": {n: {k: v for k, v in f.items() if k != "spread"} for n, f in identity["files"].items()},
    }
    old_step = tmp_path / "old" / "checkpoints" / "step_000002"
    old_step.mkdir(parents=True)
    lora_checkpoints.write_checkpoint_meta(old_step, lora_spec.parse("r=4,targets=q,v"), [], old)
    assert lora_base.check_base_identity(old_step, base) == old  # a record from before: still matches
    shard = base / "model.safetensors"
    data = bytearray(shard.read_bytes())
    at = int(len(data) * 0.3)  # away from the head, middle and tail samples of a large shard
    data[at : at + 8] = bytes(8 - i for i in range(8))
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not the base this LoRA checkpoint was trained on"):
        lora_base.check_base_identity(step, base)
    # a large shard: an edit between the head/middle/tail samples changes the spread digest only,
    # and the identity check (base_identity, as resume and export run it) refuses the base
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text("{}")
    shard, blob = big / "model.safetensors", bytearray(8 * 2**20)
    shard.write_bytes(bytes(blob))
    big_step = tmp_path / "big_run" / "checkpoints" / "step_000002"
    big_step.mkdir(parents=True)
    recorded = lora_base.base_identity(big)
    lora_checkpoints.write_checkpoint_meta(big_step, lora_spec.parse("r=4,targets=q,v"), [], recorded)
    spread = (lora_base.SPREAD_CHUNKS, lora_base.SPREAD_BYTES)
    before = (ckpt.sampled_crc32(shard), sampled_content_hash(shard, *spread))
    step_bytes = (len(blob) - lora_base.SPREAD_BYTES) / (lora_base.SPREAD_CHUNKS - 1)
    at = int(0.3 * len(blob))
    blob[at : at + int(step_bytes) + 1] = b"\x01" * (int(step_bytes) + 1)
    shard.write_bytes(bytes(blob))
    after = (ckpt.sampled_crc32(shard), sampled_content_hash(shard, *spread))
    assert after[0] == before[0] and after[1] != before[1]
    with pytest.raises(ValueError, match="not the base this LoRA checkpoint was trained on"):
        lora_base.check_base_identity(big_step, big)


def test_a_moved_pretrained_base_is_named_as_the_lora_runs_base(tmp_path, monkeypatch):
    """Exporting a LoRA run whose base folder had moved gave the hub resolver's bare error, with no
    word that it is the run's frozen base, needed to merge the adapters."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub id is looked up in the cache only
    step = tmp_path / "run" / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    for gone in (str(tmp_path / "models" / "base"), "org-that/does-not-exist"):
        config = {"model": {"model_name_or_path": gone, "revision": None}}
        with pytest.raises(
            FileNotFoundError, match=r"is a LoRA checkpoint: its adapters are merged onto"
        ) as err:
            lora_base.base_source(step, config)
        assert repr(gone) in str(err.value) and "Put the base back" in str(err.value)
