"""2-process ZeRO-3 SFT runs on the CPU through the real DeepSpeed engine: straight == interrupted
(fp32 and bf16, bitwise; fp32 resumed with gradient checkpointing off from a checkpoint laid out as
older versions wrote it), the head schedule, TensorBoard, and export -> load -> same logits. SIGKILL
during training and during a save (the staging directory, `latest` left on the last complete
checkpoint, the interrupted save removed on resume): test_never_lose_a_run.py.

Why bitwise holds: every input of an update is fixed (checkpointed engine/sampler/RNG state, noise
keyed by (seed, rank, micro-step)); 2-rank gloo sums are a + b, order-free; and every process runs
with OMP_NUM_THREADS=1 (sft_runs.env). The intra-op thread count is the one thing that moved the
losses (~1e-8 relative with 2 threads vs 1: CPU kernels add per-thread partial sums).

One fp32 straight run (8 updates) is shared by the fp32 comparisons. Cost: 4 launches of ~15-40 s
each on 2 shared cores.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from sft_runs import BASE_ARGS, check, launch, launch_module, metrics

pytestmark = pytest.mark.dist

N = 8  # updates
H_KV = 4  # llada-tiny KV heads
RUN_TIME_KEYS = {"gradient_checkpointing", "recompute_mdlmpe_attention"}


@pytest.fixture
def data(sft_data):
    return sft_data


@pytest.fixture
def straight(sft_straight):
    return sft_straight


def _same_history(a: dict[int, dict], b: dict[int, dict], steps) -> None:
    assert sorted(a) == sorted(b) == list(steps)
    for step in steps:
        for key in ("train/loss", "train/lr", "mdlmpe/active_head_fraction", "train/grad_norm"):
            # On CPU with gloo the resumed run repeats the straight run bit for bit (module docstring).
            assert a[step][key] == b[step][key], (
                f"update {step}: {key} straight {a[step][key]!r} vs {b[step][key]!r}"
            )


def _model_config(step_dir: Path) -> dict:
    return json.loads((step_dir / "config.json").read_text())["model_config"]


def _as_older_versions_wrote_it(step_dir: Path) -> None:
    """Put the run's checkpointing switches back into the checkpoint's model config, where older
    versions stored them (they are run-time choices now), and write its manifest to match."""
    from mdlmpe_ds.training import checkpoint as ckpt

    meta = json.loads((step_dir / "config.json").read_text())
    meta["model_config"].update(gradient_checkpointing=True, recompute_mdlmpe_attention=False)
    (step_dir / "config.json").write_text(json.dumps(meta, indent=2))
    (step_dir / ckpt.MANIFEST).write_text(json.dumps({"files": ckpt.manifest_of(step_dir)}, indent=1))


def test_straight_equals_interrupted(straight, data, tmp_path):
    """The second half resumes with gradient checkpointing off: a run-time choice, not the model's,
    that changes no number (backward recomputes the same layer forward), from the checkpoint
    rewritten as an older version stored it (checkpointing keys in its model config)."""
    out = tmp_path / "interrupted"
    first = launch([*data, *BASE_ARGS, "--output_dir", str(out), "--stop_at", str(N // 2)])
    check(first, "first half")
    assert max(metrics(out)) == N // 2
    half = out / "checkpoints" / f"step_{N // 2:06d}"
    assert not RUN_TIME_KEYS & set(_model_config(half))
    _as_older_versions_wrote_it(half)
    resume = ["--resume", "auto", "--gradient_checkpointing", "false"]
    second = launch([*data, *BASE_ARGS, "--output_dir", str(out), *resume])
    check(second, "resumed half")
    assert half.name in second.stdout and "resumed from" in second.stdout
    _same_history(metrics(straight), metrics(out), range(1, N + 1))
    assert not RUN_TIME_KEYS & set(_model_config(out / "checkpoints" / f"step_{N:06d}"))


def _bf16_unsupported() -> str | None:
    """DeepSpeed's CPU accelerator (0.19.8) runs bf16 ZeRO-3 (gloo all-gathers and reduce-scatters
    bf16); a GPU without bf16 does not."""
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return f"{torch.cuda.get_device_name()} does not support bf16"
    return None


def test_bf16_straight_equals_interrupted(straight, data, tmp_path):
    """bf16 weights and activations (fp32 master weights and Adam state in DeepSpeed's bf16
    optimizer): a resumed run repeats the straight one exactly. Tolerance: none -- bf16 rounding is
    as deterministic as fp32's for the same inputs, and every input is checkpointed (observed: max
    |loss difference| 0 over 8 updates, grad norms equal too; a real divergence shows at ~1e-3).

    Two launches, not three: the interrupted run is the straight run's own update-4 checkpoint
    (saved by the same code as a --stop_at save) copied into a fresh output_dir and resumed there
    with --resume auto in new processes."""
    reason = _bf16_unsupported()
    if reason:
        pytest.skip(reason)
    args = [*data, *BASE_ARGS, "--precision", "bf16"]
    full, out = tmp_path / "bf16_straight", tmp_path / "bf16_interrupted"
    check(launch([*args, "--output_dir", str(full)]), "bf16 straight run")
    half = f"step_{N // 2:06d}"
    shutil.copytree(full / "checkpoints" / half, out / "checkpoints" / half)
    resumed = launch([*args, "--output_dir", str(out), "--resume", "auto"])
    check(resumed, "bf16 resumed half")
    assert half in resumed.stdout and "resumed from" in resumed.stdout
    # DeepSpeed really trained in bf16: its bf16 optimizer wrote the shards, the losses are not fp32's.
    assert (out / "checkpoints" / half / "ds" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    bf16, fp32 = metrics(full), metrics(straight)
    assert all(bf16[step]["train/loss"] != fp32[step]["train/loss"] for step in range(1, N + 1))
    assert sorted(metrics(out, first=N // 2 + 1)) == list(range(N // 2 + 1, N + 1))
    _same_history(
        {k: v for k, v in bf16.items() if k > N // 2},
        metrics(out, first=N // 2 + 1),
        range(N // 2 + 1, N + 1),
    )


def test_numerics_differences_are_named():
    """A checkpoint written with another intra-op thread count is flagged on resume (CPU)."""
    from mdlmpe_ds.training.checkpointer import numerics_differences, numerics_state

    assert numerics_differences(numerics_state()) == []
    assert numerics_differences(None) == []  # checkpoints from before the field
    other = {**numerics_state(), "intra_op_threads": torch.get_num_threads() + 1}
    assert [d.split()[0] for d in numerics_differences(other)] == ["intra_op_threads"]


def test_head_schedule_and_loss_masking_run(straight):
    """alpha(n) per optimizer update n (0-based) with N = 8, H_kv = 4: counts round(alpha * 4) =
    0,0,1,1,2,3,3,4 (paper Eq. (27)); 0 before 10%, 50% at n = 4, 100% at the last."""
    rows = metrics(straight)
    fractions = [rows[step]["mdlmpe/active_head_fraction"] for step in range(1, N + 1)]
    assert fractions == [0.0, 0.0, 0.25, 0.25, 0.5, 0.75, 0.75, 1.0]


def test_tensorboard_tags(straight):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(straight / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/samples_seen",
        "train/nonfinite_skipped",
        "mdlmpe/active_head_fraction",
        "mdlmpe/gamma/embedding",
        "mdlmpe/delta_abs_mean",
        "mdlmpe/delta_abs_max",
        "memory/peak_gb",
    }
    assert expected <= tags, f"missing {expected - tags}"
    assert any(tag.startswith("nll_by_t/") for tag in tags)
    for tag in expected:
        steps = [event.step for event in acc.Scalars(tag)]
        assert steps == list(range(1, N + 1)), f"{tag}: {steps}"
    samples = [event.value for event in acc.Scalars("train/samples_seen")]
    assert samples == [2 * 2 * 2 * step for step in range(1, N + 1)]  # micro 2 x accum 2 x world 2


def test_export_load_same_logits(straight, tmp_path):
    from mdlmpe_ds.models.hf_io import load_pretrained

    out = launch_module("export").export(straight / "checkpoints" / "latest", tmp_path / "export")
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    exported = json.loads((out / "config.json").read_text())
    assert not RUN_TIME_KEYS & (set(exported) | set(exported["mdlmpe_ds"]))
    model = load_pretrained(out).eval()
    probe = torch.load(straight / "probe.pt")
    with torch.no_grad():
        logits = model(probe["input_ids"], valid=probe["valid"]).float()
    # Same fp32 weights; ZeRO-3's gathered forward vs the plain module: identical kernels, so only
    # summation-order noise is allowed.
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)
    # The same export through plain transformers (modeling_mdlmpe.py + auto_map, issue 17).
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        hf_logits = hf(probe["input_ids"], attention_mask=probe["valid"].long()).logits.float()
    torch.testing.assert_close(hf_logits, probe["logits"], rtol=1e-5, atol=1e-5)


def test_reexport_sharded_over_a_single_file_export_and_into_the_checkpoint(straight, tmp_path, capsys):
    """Re-exporting the newest checkpoint sharded where an older one was exported as one file: no
    stale model.safetensors stays (transformers would load it while hf_io loads the shards), both
    loaders give the newest checkpoint's logits, and every file is 0644. An export into the
    checkpoint itself is refused by name and leaves the checkpoint intact."""
    import stat

    from transformers import AutoModel

    from mdlmpe_ds.training import checkpoint as ckpt
    from mdlmpe_ds.models.hf_io import load_pretrained

    export = launch_module("export")
    out = tmp_path / "export"
    export.export(straight / "checkpoints" / "step_000004", out)
    assert (out / "model.safetensors").is_file()
    export.export(
        straight / "checkpoints" / "latest", out, max_shard_gb=0.0001
    )  # update 8, sharded (~100 KB shards)
    assert not (out / "model.safetensors").exists() and (out / "model.safetensors.index.json").is_file()
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in out.iterdir()}
    assert set(modes.values()) == {"0o644"}, modes
    probe = torch.load(straight / "probe.pt")  # the engine's logits after update 8
    hf = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    ours = load_pretrained(out).eval()
    with torch.no_grad():
        got_hf = hf(probe["input_ids"], attention_mask=probe["valid"].long()).logits.float()
        got_ours = ours(probe["input_ids"], valid=probe["valid"]).float()
    torch.testing.assert_close(got_hf, probe["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ours, probe["logits"], rtol=1e-5, atol=1e-5)

    step = straight / "checkpoints" / "step_000008"
    before = (step / "config.json").read_bytes()
    assert export.main([str(step), str(step)]) == 2
    err = capsys.readouterr().err
    assert f"export target {step.resolve()} is the checkpoint being exported" in err, err
    assert (step / "config.json").read_bytes() == before and ckpt.verify(step) == []
