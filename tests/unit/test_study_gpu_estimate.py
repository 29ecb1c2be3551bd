"""benchmarks/gpu_cost/study_run.py: the ESTIMATE of the paper-scale mechanism study's GPU time.

What can be wrong without a GPU is checked: the shape it scales to is the model the recipe builds
(weights, rotary pairs MDLMPE turns), the scaling returns the measured pieces at the measured shape,
each piece scales with the work it names, and the totals follow from the recipe's steps and batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gpu_cost import measured, study_run


def test_the_100m_shape_is_the_model_the_recipe_builds():
    from mdlmpe_ds.config import recipes
    from mdlmpe_ds.models.presets import preset
    from mdlmpe_ds.models.transformer import DiffusionLM
    from mdlmpe_ds.pe.phase import mdlmpe_pairs

    shape = study_run.LLADA_100M
    run = recipes.pretrain_run(None, "llada-100m", {}, 8)
    assert (run.train.max_steps, run.data.max_len) == (study_run.STEPS, study_run.MEASURED_LENGTH)
    assert run.train.micro_batch_size * run.train.grad_accum * 8 == study_run.GLOBAL_BATCH
    assert run.model.gradient_checkpointing  # the recompute the pieces include
    config = preset("llada-100m", position_encoding="mdlmpe")
    with torch.device("meta"):
        model = DiffusionLM(config)
    matrices = [p for n, p in model.layers[0].named_parameters() if p.dim() == 2 and "phase" not in n]
    assert sum(p.numel() for p in matrices) == shape.layer_weights
    embedding = config.vocab_size * config.hidden_size
    assert config.tie_embeddings and (config.vocab_size, config.hidden_size) == (shape.vocab, shape.hidden)
    backbone = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "mdlmpe" not in n
                   and "phase" not in n)  # fmt: skip
    assert backbone == shape.parameters == shape.layers * shape.layer_weights + embedding
    assert mdlmpe_pairs(config.head_dim // 2).numel() == shape.mdlmpe_pairs
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
    )


def test_scaling_is_the_identity_at_the_measured_shape_and_follows_the_work():
    row = measured.load()["benchmark"]["lengths"][str(study_run.MEASURED_LENGTH)]
    ms = row["ms"]
    same = study_run.scaled_pieces_ms(study_run.LLADA_8B, ms, 0.25)
    assert same["mdlmpe_attention"] == ms["mdlmpe_triton"] and same["lm_head"] == ms["lm_head"]
    assert same["linear"] == ms["linear_layer"] + ms["linear_layer_fwd"]
    assert same["mdlmpe_attention_fwd"] == 0.25 * ms["mdlmpe_triton"]
    assert study_run.LLADA_8B.layer_weights == 4 * 4096**2 + 3 * 4096 * 12288
    small = study_run.scaled_pieces_ms(study_run.LLADA_100M, ms, 0.25)
    assert small["mdlmpe_attention"] == pytest.approx(ms["mdlmpe_triton"] * (12 * 16) / (32 * 32))
    assert small["rope_attention"] == pytest.approx(
        (ms["rope_flash"] + ms["rope_flash_fwd"]) * (12 * 64) / (32 * 128)
    )
    assert small["lm_head"] == pytest.approx(ms["lm_head"] * 768 / 4096)
    share = study_run.forward_share(row["kernels_ms"]["current"])
    assert 0.1 < share < 0.3  # the fused backward is most of the kernels' time


def test_totals_follow_from_steps_batch_and_seeds():
    est = study_run.study_estimate()
    pieces = est["pieces_ms"]
    for name, (values, why) in study_run.ASSUMPTIONS.items():
        assert len(values) == 3 and why, name
    central = est["scenarios"]["central"]
    small = study_run.ASSUMPTIONS["small_shape"][0][1]
    per_seq = small * (12 * (pieces["linear"] + pieces["mdlmpe_attention"]) + pieces["lm_head"])
    assert central["mdlmpe"]["step_ms"] == pytest.approx(2 * per_seq + central["exposed_comm_ms"])
    assert central["mdlmpe"]["run_hours"] == pytest.approx(200_000 * central["mdlmpe"]["step_ms"] / 3.6e6)
    gpu_h = [central[e]["gpu_hours"] for e in ("rope", "mdlmpe")]
    assert central["study_gpu_hours"] == pytest.approx(5 * sum(gpu_h))
    assert central["mdlmpe"]["gpu_hours"] > 8 * central["mdlmpe"]["run_hours"]  # + the scoring
    low, high = est["scenarios"]["low"], est["scenarios"]["high"]
    assert low["study_gpu_hours"] < central["study_gpu_hours"] < high["study_gpu_hours"]
    assert low["exposed_comm_ms"] == 0 and high["exposed_comm_ms"] > central["exposed_comm_ms"]


def test_the_docs_quote_the_estimate_as_it_is_now():
    """README and docs/results.md quote the study's GPU-hours as the estimate computes them from
    today's record (it moves whenever the H100 record does)."""
    repo = Path(__file__).resolve().parents[2]
    hours = {s: c["study_gpu_hours"] for s, c in study_run.study_estimate()["scenarios"].items()}
    low, central, high = round(hours["low"]), round(hours["central"]), round(hours["high"])
    results = (repo / "docs" / "results.md").read_text()
    assert f"| whole study (10 runs + scoring), H100 GPU-hours | {low} | {central} | {high} |" in results
    readme = " ".join((repo / "README.md").read_text().split())
    assert f"ESTIMATE is {round(central, -1)} H100 GPU-hours ({low}–{high}; docs/results.md)" in readme
