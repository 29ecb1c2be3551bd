"""LoRA SFT on 2 CPU ranks through the real DeepSpeed ZeRO-3 engine with the shipped
ds_configs/zero3.json: only adapters and MDLMPE train (the backbone comes out bitwise unchanged),
checkpoints leave the frozen base out, the loss falls, straight == interrupted bit for bit (fp32 with
the head schedule and gradient checkpointing; bf16 with block diffusion and no checkpointing), and
both exports reproduce the engine's logits.

Cost: 8 launches of ~15-40 s on 2 cores (one LoRA straight run shared by the module).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from sft_runs import BASE_ARGS, check, launch, launch_module, metrics

pytestmark = pytest.mark.dist

N = 8
LORA = ["--lora", "r=4,alpha=8,dropout=0.05,targets=q,k,v,o,gate,up,down"]


@pytest.fixture(scope="module")
def lora_straight(tmp_path_factory, sft_data):
    """8 LoRA updates straight through (checkpoints at 4 and 8), the engine's probe logits and its
    consolidated weights saved at the end."""
    out = tmp_path_factory.mktemp("lora_straight")
    proc = launch(
        [*sft_data, *BASE_ARGS, *LORA, "--output_dir", str(out)],
        faults={"probe_logits": str(out / "probe.pt")},
    )
    check(proc, "LoRA straight run")
    assert "LoRA r=4,alpha=8,dropout=0.05,targets=q,k,v,o,gate,up,down: trainable" in proc.stdout
    return out


def _same_history(a: dict[int, dict], b: dict[int, dict], steps) -> None:
    for step in steps:
        for key in ("train/loss", "train/lr", "train/grad_norm", "mdlmpe/active_head_fraction"):
            assert a[step][key] == b[step][key], (
                f"update {step}: {key} straight {a[step][key]!r} vs {b[step][key]!r}"
            )


def test_only_adapters_and_mdlmpe_change(lora_straight):
    from safetensors.torch import load_file

    from mdlmpe_ds.lora.adapters import base_name, is_adapter_name, is_mdlmpe_name
    from mdlmpe_ds.lora.spec import BASE_FILE

    state = torch.load(lora_straight / "probe.pt", weights_only=False)["state"]  # after 8 updates
    base = load_file(str(lora_straight / BASE_FILE))  # the backbone as built, before any update
    backbone = {base_name(n): t for n, t in state.items() if not (is_adapter_name(n) or is_mdlmpe_name(n))}
    buffers = {n for n in backbone if n.endswith(".active_kv")}  # the head mask, not a parameter
    assert sorted(set(backbone) - buffers) == sorted(base)
    changed = [n for n in base if not torch.equal(backbone[n], base[n])]
    assert not changed, f"frozen backbone parameters changed: {changed[:5]}"
    # B starts at 0 and the phase MLPs' output layers and W_p's bias start at 0 (docs/method.md): all moved.
    b = [n for n in state if ".lora_B." in n]
    assert len(b) == 2 * 7 and all(float(state[n].abs().sum()) > 0 for n in b)
    zero_init = [n for n in state if is_mdlmpe_name(n) and (".fc2." in n or n.endswith("proj.bias"))]
    assert zero_init and all(float(state[n].abs().sum()) > 0 for n in zero_init), zero_init


def test_checkpoints_hold_adapters_and_mdlmpe_only(lora_straight):
    step = lora_straight / "checkpoints" / f"step_{N:06d}"
    saved = json.loads((step / "lora.json").read_text())
    assert saved["lora"]["r"] == 4 and saved["trainable"]
    for rank in (0, 1):
        model_states = torch.load(
            step / "ds" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", weights_only=False
        )
        assert model_states["frozen_param_fragments"] is None  # the frozen base is not written again
        assert sorted(model_states["module"]) == sorted(saved["trainable"])


def test_loss_falls_on_chat_data(lora_straight):
    nll = [metrics(lora_straight)[s]["train/nll"] for s in range(1, N + 1)]
    # seen: 4.72 over the first three updates, 4.38 over the last three (frozen random LM head)
    assert sum(nll[-3:]) / 3 < sum(nll[:3]) / 3 - 0.15, nll


def test_straight_equals_interrupted(lora_straight, sft_data, tmp_path):
    """The straight run's update-4 checkpoint (the save a --stop_at 4 run makes: the same code at the
    same update; a LoRA --stop_at run and its resume: test_lora_on_a_pretrained_directory_...) copied
    into a fresh output_dir and resumed there in new processes repeats updates 5-8 bit for bit."""
    out = tmp_path / "interrupted"
    args = [*sft_data, *BASE_ARGS, *LORA, "--output_dir", str(out)]
    half = f"step_{N // 2:06d}"
    shutil.copytree(lora_straight / "checkpoints" / half, out / "checkpoints" / half)
    resumed = launch([*args, "--resume", "auto"])
    check(resumed, "LoRA resumed half")
    assert "resumed from" in resumed.stdout and half in resumed.stdout
    _same_history(metrics(lora_straight), metrics(out, first=N // 2 + 1), range(N // 2 + 1, N + 1))
    # the head schedule ran (0 -> all heads) and the default gradient checkpointing was on
    fractions = [metrics(lora_straight)[s]["mdlmpe/active_head_fraction"] for s in range(1, N // 2 + 1)]
    fractions += [
        metrics(out, first=N // 2 + 1)[s]["mdlmpe/active_head_fraction"] for s in range(N // 2 + 1, N + 1)
    ]
    assert fractions[0] == 0.0 and fractions[-1] == 1.0
    # a full fine-tune cannot resume a LoRA checkpoint: the error says how to continue it
    wrong = launch([*sft_data, *BASE_ARGS, "--output_dir", str(out), "--resume", "auto"])
    assert wrong.returncode != 0 and "resume it with --lora r=4,alpha=8" in wrong.stdout + wrong.stderr


def test_a_forced_change_of_lora_alpha_resumes_and_trains(lora_straight, sft_data, tmp_path):
    """Another alpha leaves the adapter tensors as they are: refused by default, naming the setting,
    and --allow_config_change model.lora forces it (r or targets cannot be forced: the adapters
    would not load). The forced run loads the checkpoint and trains on."""
    out, half = tmp_path / "alpha", "step_000004"
    shutil.copytree(lora_straight / "checkpoints" / half, out / "checkpoints" / half)
    args = [*sft_data, *BASE_ARGS, "--lora", "r=4,alpha=16,dropout=0.05,targets=q,k,v,o,gate,up,down"]
    args += ["--output_dir", str(out), "--resume", "auto"]
    refused = launch(args)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "the LoRA settings differ: alpha 8.0 -> 16.0" in said, said[-3000:]
    assert "--allow_config_change model.lora" in said
    forced = launch([*args, "--allow_config_change", "model.lora", "--stop_at", "5"])
    check(forced, "LoRA resumed with another alpha, forced")
    assert "(forced by --allow_config_change)" in forced.stdout + forced.stderr
    assert sorted(metrics(out, first=5)) == [5]  # the forced run trained update 5


def test_bf16_block_diffusion_without_checkpointing_resumes_exactly(sft_data, tmp_path):
    """bf16, block diffusion and no gradient checkpointing: the run resumed from the update-2
    checkpoint (copied into a fresh output_dir, so the preset's base is found through the run config)
    repeats the straight run bit for bit."""
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    args = [
        *sft_data, *BASE_ARGS, *LORA, "--precision", "bf16", "--block_size", "4",
        "--gradient_checkpointing", "false", "--max_steps", "4", "--save_every", "2",
    ]  # fmt: skip
    full, out = tmp_path / "bf16_straight", tmp_path / "bf16_resumed"
    check(launch([*args, "--output_dir", str(full)]), "LoRA bf16 block straight run")
    shutil.copytree(full / "checkpoints" / "step_000002", out / "checkpoints" / "step_000002")
    resumed = launch([*args, "--output_dir", str(out), "--resume", "auto"])
    check(resumed, "LoRA bf16 block resumed run")
    assert (
        out / "checkpoints" / "step_000002" / "ds" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    ).is_file()
    _same_history(metrics(full), metrics(out, first=3), range(3, 5))


def test_merged_export_and_adapter_export_give_the_engines_logits(lora_straight, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from mdlmpe_ds.lora.spec import BASE_FILE, MDLMPE_FILE
    from mdlmpe_ds.models.hf_io import load_pretrained
    from mdlmpe_ds.models.transformer import DiffusionLM

    export = launch_module("export")
    probe = torch.load(lora_straight / "probe.pt", weights_only=False)
    merged = export.export(lora_straight / "checkpoints" / "latest", tmp_path / "merged")  # --merge: default
    model = load_pretrained(merged).eval()  # the full fine-tune's format
    with torch.no_grad():
        logits = model(probe["input_ids"], valid=probe["valid"]).float()
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)

    latest = lora_straight / "checkpoints" / "latest"
    adapter = export.export(latest, tmp_path / "adapter", adapter_only=True)
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    # staged and swapped in like the merged export: readable by others (safetensors writes 0600)
    assert {oct(p.stat().st_mode & 0o777) for p in adapter.iterdir()} == {"0o644"}
    # the adapter onto the base export, as transformers + peft load them (export --base-only)
    from transformers import AutoModel

    base = export.export(latest, tmp_path / "base", base_only=True)
    wrapped = PeftModel.from_pretrained(AutoModel.from_pretrained(base, trust_remote_code=True), str(adapter))
    with torch.no_grad():
        out = wrapped.eval()(probe["input_ids"], attention_mask=probe["valid"].long(), aligned=True)
    torch.testing.assert_close(out.logits.float(), probe["logits"], rtol=1e-5, atol=1e-5)
    # each export records its kind; one kind is never written over another (it would delete it)
    from mdlmpe_ds.hub.export_target import EXPORT_MARKER, ExportTargetError

    kinds = {d.name: json.loads((d / EXPORT_MARKER).read_text())["kind"] for d in (merged, adapter, base)}
    assert kinds == {"merged": "merged", "adapter": "adapter", "base": "base"}
    before = sorted(p.name for p in base.iterdir())
    for target, flags in ((base, {"adapter_only": True}), (adapter, {}), (merged, {"base_only": True})):
        with pytest.raises(ExportTargetError, match="export; writing"):
            export.export(latest, target, **flags)
    assert sorted(p.name for p in base.iterdir()) == before
    # mdlmpe.safetensors: the same MDLMPE weights under our names, for our own DiffusionLM
    plain = DiffusionLM(model.config)
    shapes = {n: p.shape for n, p in plain.named_parameters()}
    weights = {**load_file(str(lora_straight / BASE_FILE)), **load_file(str(adapter / MDLMPE_FILE))}
    plain.load_state_dict({n: t.reshape(shapes[n]) for n, t in weights.items()}, strict=True)


def test_lora_on_a_pretrained_directory_resumes_and_exports_from_the_base_name(
    sft_straight, sft_data, tmp_path
):
    """The base is a Hugging Face-format directory (the full fine-tune's export): nothing of it is
    copied into the run; the resumed half and the export read it again from model_name_or_path, and
    the merged export (and the evaluation loader on the run itself) give the engine's logits."""
    from mdlmpe_ds.evaluation.loading import load_model
    from mdlmpe_ds.lora.spec import BASE_FILE
    from mdlmpe_ds.models.hf_io import load_pretrained

    export = launch_module("export")
    base = export.export(sft_straight / "checkpoints" / "latest", tmp_path / "base")
    out = tmp_path / "lora_on_pretrained"
    args = [*sft_data[2:], *BASE_ARGS, *LORA, "--model_name_or_path", str(base), "--output_dir", str(out)]
    check(launch([*args, "--stop_at", str(N // 2)]), "LoRA on a pretrained directory, first half")
    resumed = launch([*args, "--resume", "auto"], faults={"probe_logits": str(out / "probe.pt")})
    check(resumed, "LoRA on a pretrained directory, resumed half")
    assert "resumed from" in resumed.stdout and not (out / BASE_FILE).exists()
    probe = torch.load(out / "probe.pt", weights_only=False)
    merged = load_pretrained(export.export(out, tmp_path / "merged")).eval()
    from_run, _ = load_model(out)
    for model in (merged, from_run):
        with torch.no_grad():
            logits = model(probe["input_ids"], valid=probe["valid"]).float()
        torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)
    # the backbone is the pretrained directory's, bit for bit, after training
    before = load_pretrained(base)
    state = probe["state"]
    for name, param in before.named_parameters():
        trained = state.get(name, state.get(name.replace(".weight", ".base_layer.weight")))
        if ".phase." not in name and not name.startswith("embed.mdlmpe."):
            assert torch.equal(trained, param.detach()), name


def test_a_copied_run_refuses_a_base_path_reused_by_another_run(lora_straight, sft_data, tmp_path):
    """Each LoRA checkpoint records the SHA-256 of the base it was trained on. A run copied without
    lora_base.safetensors falls back to the base in its recorded output_dir; once another run has
    written another base there, resume, export and evaluation refuse, naming the file (before, the
    resume trained on the other base: different losses)."""
    from safetensors.torch import load_file, save_file

    from mdlmpe_ds.data.fingerprint import file_sha256
    from mdlmpe_ds.evaluation.loading import load_model
    from mdlmpe_ds.lora.spec import BASE_FILE

    step = lora_straight / "checkpoints" / "step_000004"
    recorded = lora_straight / BASE_FILE
    saved = json.loads((step / "lora.json").read_text())["base"]
    assert saved == {"kind": "file", "sha256": file_sha256(recorded)}
    copied = tmp_path / "copied"
    shutil.copytree(step, copied / "checkpoints" / step.name)
    export = launch_module("export")
    original = recorded.read_bytes()
    try:
        # another run in the recorded output_dir: another initial base, same names and shapes
        gen = torch.Generator().manual_seed(1)
        base = load_file(str(recorded))
        other = {k: torch.randn(v.shape, generator=gen).to(v.dtype) * 0.02 for k, v in base.items()}
        save_file(other, str(recorded), metadata={"format": "pt"})
        want = f"{recorded}: not the base this LoRA checkpoint was trained on"
        resumed = launch([*sft_data, *BASE_ARGS, *LORA, "--output_dir", str(copied), "--resume", "auto"])
        assert resumed.returncode != 0 and want in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
        assert f"copy the run's own {BASE_FILE}" in resumed.stdout + resumed.stderr
        assert not (copied / "metrics.jsonl").exists() or not metrics(copied)  # nothing trained
        with pytest.raises(ValueError, match=want):
            export.export(copied, tmp_path / "merged")
        with pytest.raises(ValueError, match=want):
            load_model(copied)
    finally:
        recorded.write_bytes(original)
    assert export.export(copied, tmp_path / "merged").is_dir()  # the recorded base back: it exports
