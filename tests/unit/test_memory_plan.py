"""The per-GPU memory plan (mdlmpe_ds/training/memory_plan.py): its activation terms against measured layers
(live tensor bytes of a real layer's forward and backward on the CPU, fp32), ZeRO-3 states and
offload, and the plan printed by a dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mdlmpe_ds.attention.impl import AttentionImpl
from mdlmpe_ds.models.presets import preset
from mdlmpe_ds.models.recompute import Recompute
from mdlmpe_ds.pe.config import MDLMPEConfig
from mdlmpe_ds.training.activation_bytes import head_bytes, layer_activation_bytes
from mdlmpe_ds.training.memory_measure import measure_layer
from mdlmpe_ds.training.memory_plan import GIB, plan_memory


@pytest.fixture(autouse=True)
def _logging():
    """The run's notes (the plan, warnings) are log records, as the launchers configure them."""
    from mdlmpe_ds.training.log_setup import configure

    configure(rank=0, force=True)  # whatever an earlier test's entry point set


REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.20  # the plan vs a measured layer, relative


def _layer_config(family: str, width: int, encoding: str, length: int):
    heads = width // 128  # d_h = 128 as in LLaDA-8B and Dream-7B
    kv = heads if family == "llada" else max(1, heads // 4)
    return preset(
        f"{family}-tiny",
        hidden_size=width,
        num_heads=heads,
        num_kv_heads=kv,
        intermediate_size=3 * width,
        max_seq_len=length,
        position_encoding=encoding,
        mdlmpe=MDLMPEConfig(max_seq_len=length),
    )


def _check_against_measured(
    cfg, batch: int, length: int, recompute: Recompute, impl: AttentionImpl | None = None
) -> None:
    measured = measure_layer(cfg, batch, length, impl=impl, recompute=recompute)
    plan = layer_activation_bytes(cfg, 4, batch, length, impl=impl, recompute=recompute)
    peak = measured["kept"] + measured["backward"]
    for name, planned, seen in (("kept", plan["kept"], measured["kept"]), ("peak", plan["peak"], peak)):
        assert abs(planned - seen) <= TOLERANCE * seen, (
            f"{name}: plan {planned / 1024:.1f} KB/token vs measured {seen / 1024:.1f} KB/token"
        )


@pytest.mark.parametrize(
    ("family", "encoding", "checkpointing", "impl"),
    [
        ("llada", "rope", False, {}),
        ("llada", "rope", True, {}),
        ("llada", "mdlmpe", True, {}),  # blocked (recomputes per block): attention outside
        ("llada", "mdlmpe", False, {}),
        ("dream", "rope", True, {}),  # GQA, rotary in the activation dtype
        ("dream", "mdlmpe", True, {}),
    ],
)
def test_activation_terms_match_a_measured_narrow_layer(family, encoding, checkpointing, impl):
    """d = 512 (4 heads of 128): every checkpointing mode and backend path the plan models."""
    cfg = _layer_config(family, 512, encoding, 128)
    _check_against_measured(cfg, 2, 128, Recompute(layers=checkpointing), AttentionImpl(**impl))


@pytest.mark.parametrize("encoding", ["rope", "mdlmpe"])
def test_activation_terms_match_a_measured_llada_8b_width_layer(encoding):
    """One LLaDA-8B-width layer (d 4096, 32 heads, SwiGLU 12288), fp32, L = 64: ~1.3 GB, ~10 s."""
    cfg = _layer_config("llada", 4096, encoding, 64)
    assert (cfg.num_heads, cfg.intermediate_size) == (32, 12288)
    _check_against_measured(cfg, 1, 64, Recompute(layers=True))


def _ds(name: str, bf16: bool = True) -> dict:
    ds = json.loads((REPO / "ds_configs" / name).read_text())
    ds["bf16"] = {"enabled": bf16}
    return ds


def test_plan_states_offload_and_total():
    cfg = preset("llada-8b", position_encoding="mdlmpe")
    checkpointed = Recompute(layers=True)
    plan = plan_memory(cfg, _ds("zero3.json"), world=8, micro_batch=1, length=4096, recompute=checkpointed)
    params = 8_015_947_777  # LLaDA-8B + MDLMPE at these dims, counted on the meta device
    assert plan.item("parameters (ZeRO-3 shard)") == pytest.approx(params / 8 * 2, rel=1e-3)
    assert plan.item("optimizer states (ZeRO-3 shard)") == pytest.approx(params / 8 * 12, rel=1e-3)
    assert plan.total == pytest.approx(sum(b for _, b, _ in plan.items))
    assert "total" in plan.format() and "estimate" in plan.format()
    offload = plan_memory(
        cfg, _ds("zero3_offload.json"), world=8, micro_batch=1, length=4096, recompute=checkpointed
    )
    names = {n for n, _, _ in offload.items}
    assert "optimizer states (ZeRO-3 shard)" not in names and "parameters (ZeRO-3 shard)" not in names
    assert {n for n, _, _ in offload.cpu_items} == {"parameters", "optimizer + grads"}
    assert offload.total < plan.total - 14 * GIB
    # activations grow with the micro-batch; the chunked head does not grow past one chunk
    bigger = plan_memory(cfg, _ds("zero3.json"), world=8, micro_batch=4, length=4096, recompute=checkpointed)
    assert bigger.item("activations kept (other layers)") == pytest.approx(
        4 * plan.item("activations kept (other layers)")
    )
    chunk_only = head_bytes(cfg, 2, 16384) - 2 * 16384 * cfg.hidden_size * 2
    assert chunk_only == pytest.approx(1024 * cfg.vocab_size * (2 + 4 + 4 + 4))  # bf16 logits, 3 fp32
    with pytest.raises(ValueError, match="micro-batch"):
        plan_memory(cfg, _ds("zero3.json"), world=8, micro_batch=0, length=4096)


def test_dry_run_prints_the_memory_plan(capsys, monkeypatch):
    """trainer.build_engine (the dry run's meta-device build) logs the memory plan for the world
    size of the job (WORLD_SIZE when no process group is up) and returns its total."""
    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.distributed import engine as eng
    from mdlmpe_ds.runs.common import build_engine

    monkeypatch.setenv("WORLD_SIZE", "8")
    run = build_config(None, ["--micro_batch_size", "2", "--max_len", "64", "--precision", "bf16"])
    cfg = preset("llada-tiny", position_encoding="mdlmpe", max_seq_len=64, mdlmpe={"max_seq_len": 64})
    ds = eng.prepare_ds_config(REPO / "ds_configs" / "zero3.json", run, world=8)
    engine, built = build_engine(run, cfg, ds, total=3, n_examples=10, dry_run=True)
    out = capsys.readouterr().out
    assert engine is None
    assert "memory plan per GPU (estimate): world 8, micro-batch 2 x L 64" in out
    assert "activations kept" in out and "LM head + CE" in out
    planned = plan_memory(cfg, ds, 8, 2, 64, recompute=run.recompute())
    assert run.recompute() == Recompute(layers=True)  # the run's default: checkpointed
    assert built["memory_gib"] == pytest.approx(planned.total / GIB)


def test_plan_uses_the_attention_rule_for_the_learned_coordinate():
    """``auto`` with the learned coordinate (coordinate='mlp') runs the blocked path on a GPU
    (attention.choose_backend: the fused kernel has no gradient for A, D), so the plan of that
    ablation is the blocked path's, not the Triton kernel's; the sine coordinate plans Triton."""
    from mdlmpe_ds.attention import choose_backend

    assert choose_backend("auto", "cuda", learned_coordinate=True) == "blocked"
    ds = _ds("zero3.json")
    for coordinate, runs in (("mlp", "blocked"), ("sine", "triton")):
        cfg = preset(
            "llada-8b",
            position_encoding="mdlmpe",
            mdlmpe=MDLMPEConfig(max_seq_len=4096, coordinate=coordinate),
        )
        auto = plan_memory(cfg, ds, world=8, micro_batch=1, length=4096)
        named = plan_memory(cfg, ds, world=8, micro_batch=1, length=4096, impl=AttentionImpl(backend=runs))
        assert auto.items == named.items, coordinate
    cfg = preset(
        "llada-8b", position_encoding="mdlmpe", mdlmpe=MDLMPEConfig(max_seq_len=4096, coordinate="mlp")
    )
    triton = plan_memory(cfg, ds, world=8, micro_batch=1, length=4096, impl=AttentionImpl(backend="triton"))
    assert plan_memory(cfg, ds, world=8, micro_batch=1, length=4096).items != triton.items
