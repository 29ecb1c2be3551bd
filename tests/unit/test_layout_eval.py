"""Paired layout evaluation and the layout knockout (evaluation/layout_eval.py, knockout.py): the
paired standard error against a hand-computed case; the iid layout scores exactly the diffusion
ELBO terms; every model is scored on the same masks; the knockout changes only A and D and is
exactly a no-op for a RoPE model."""

from __future__ import annotations

import math

import pytest
import torch

from mdlmpe_ds.diffusion.elbo import sequence_losses
from mdlmpe_ds.experiments.knockout import layout_knockout, mdlmpe_encoder, summaries_for
from mdlmpe_ds.experiments.layout_eval import (
    LayoutEvalSettings,
    paired_difference,
    ratio_se,
    score_layouts,
    summarise,
)
from mdlmpe_ds.models.presets import preset
from mdlmpe_ds.models.transformer import DiffusionLM

L = 48
MASK = 511


def model(encoding: str, seed: int = 0) -> DiffusionLM:
    torch.manual_seed(seed)
    cfg = preset("llada-tiny", position_encoding=encoding, max_seq_len=L)
    m = DiffusionLM(cfg).eval()
    if encoding == "mdlmpe":  # a trained-looking model: non-zero phase MLP outputs
        with torch.no_grad():
            for layer in m.layers:
                phase = getattr(layer.attn, "phase", None)
                if phase is not None:
                    phase.fc2.weight.normal_(0, 0.5)
    return m


def batches(n: int = 6, bs: int = 3) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (n, L), generator=gen)
    out = []
    for i in range(0, n, bs):
        rows = ids[i : i + bs]
        valid = torch.ones_like(rows, dtype=torch.bool)
        out.append(
            {"input_ids": rows, "valid": valid, "maskable": valid, "index": torch.arange(i, i + len(rows))}
        )
    return out


def fn(m: DiffusionLM):
    return lambda ids, valid: m(ids, valid=valid)


def test_paired_standard_error_hand_computed():
    # Three windows of 2 tokens: A sums 3, 5, 4; B sums 2, 5, 2. d = 1, 0, 2; delta = 3 / 6 = 0.5.
    # Residuals d - delta n = 0, -1, 1; SE = sqrt(3/2 * 2) / 6 = sqrt(3) / 6 (= sd of 0.5, 0, 1 / sqrt 3).
    delta, se = paired_difference([3.0, 5.0, 4.0], [2.0, 5.0, 2.0], [2.0, 2.0, 2.0])
    assert delta == pytest.approx(0.5) and se == pytest.approx(math.sqrt(3) / 6)
    # Unequal sizes: x = 1, 4 on n = 1, 3 -> R = 5/4; resid = -0.25, 0.25; SE = sqrt(2 * 0.125) / 4.
    r, se = ratio_se(torch.tensor([1.0, 4.0]), torch.tensor([1.0, 3.0]))
    assert r == pytest.approx(1.25) and se == pytest.approx(math.sqrt(0.25) / 4)
    # One window holding every token: no spread to estimate an error from.
    assert math.isnan(ratio_se([0.0, 3.0, 0.0], [0.0, 2.0, 0.0])[1])
    # Unpaired errors of the two means are much larger than the paired one here.
    assert ratio_se([3.0, 5.0, 4.0], [2.0, 2.0, 2.0])[1] > 0 and se > 0


def test_iid_layout_scores_the_diffusion_elbo_terms():
    m = model("rope")
    settings = LayoutEvalSettings(seq_len=L, draws=4, layouts=("iid",), seed=3)
    got = score_layouts(fn(m), batches(), MASK, settings)["iid"]
    ref = torch.cat(
        [
            sequence_losses(
                fn(m), b["input_ids"], b["valid"], b["index"], MASK, 4, 3, t_sampling="antithetic"
            )
            for b in batches()
        ]
    ).sum(1)  # [N] sum over draws of sum CE / p
    assert torch.allclose(torch.tensor(got.loss, dtype=torch.float64), ref, rtol=1e-9, atol=0)
    assert got.tokens == [4.0 * L] * 6


def test_every_model_is_scored_on_the_same_masks_and_paired_differences_are_reported():
    settings = LayoutEvalSettings(
        seq_len=L, draws=2, layouts=("iid", "semi_ar", "spans"), buckets=(0, 0.1, 1)
    )
    scores = {name: score_layouts(fn(model(name)), batches(), MASK, settings) for name in ("rope", "mdlmpe")}
    for layout in settings.layouts:
        assert scores["rope"][layout].tokens == scores["mdlmpe"][layout].tokens
        assert scores["rope"][layout].bucket_n == scores["mdlmpe"][layout].bucket_n
    assert sum(scores["rope"]["semi_ar"].tokens) < sum(scores["rope"]["iid"].tokens)  # block scope only
    table = summarise(scores, settings)
    cell = table["paired"]["mdlmpe"]["spans"]
    rope, mdl = table["nll"]["rope"]["spans"]["nll"], table["nll"]["mdlmpe"]["spans"]["nll"]
    assert cell["delta"] == pytest.approx(mdl - rope, abs=1e-12) and cell["se"] > 0
    # Every masked token falls in exactly one deviation bucket.
    buckets = table["nll"]["rope"]["iid"]["buckets"]
    assert len(buckets) == 2 and sum(b["tokens"] for b in buckets) > 0


def _captured_forward(m: DiffusionLM, ids, valid, positions):
    seen = {}

    def hook(module, args, output):
        seen["args"] = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        seen["features"] = output[1]

    handle = m.embed.register_forward_hook(hook)
    try:
        logits = m(ids, valid=valid, positions=positions)
    finally:
        handle.remove()
    return logits, seen


@pytest.mark.parametrize("mode", ["shuffle", "constant"])
def test_knockout_changes_only_A_and_D(mode):
    m = model("mdlmpe")
    b = batches()[0]
    ids = torch.where(
        torch.rand(3, L, generator=torch.Generator().manual_seed(0)) < 0.5, MASK, b["input_ids"]
    )
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[0, :5] = False  # a left-padded row, with its positions
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    plain, seen = _captured_forward(m, ids, valid, positions)
    with layout_knockout(m, mode, seed=0):
        knocked, seen_k = _captured_forward(m, ids, valid, positions)
    for x, y in zip(seen["args"], seen_k["args"]):  # ids, valid, positions as given
        assert (x is None and y is None) or torch.equal(x, y)
    f, g = seen["features"], seen_k["features"]
    assert torch.equal(f.b, g.b) and torch.equal(f.a, g.a)
    assert not torch.allclose(f.A, g.A)  # A follows the knocked-out b
    assert torch.allclose(f.D, g.D, rtol=0, atol=1e-6)  # D depends on a alone: recomputed, the same
    assert not torch.allclose(plain, knocked)
    # Outside the context the model is itself again; summaries_for rebuilds the model's own A, D.
    again, _ = _captured_forward(m, ids, valid, positions)
    assert torch.equal(again, plain)
    A, D = summaries_for(mdlmpe_encoder(m), f.b, f.a, positions)
    assert torch.equal(A, f.A) and torch.equal(D, f.D)


def test_knockout_keeps_the_visible_count_and_is_a_noop_for_rope():
    from mdlmpe_ds.experiments.knockout import knocked_availability

    b = (torch.rand(4, L, generator=torch.Generator().manual_seed(2)) < 0.3).float()
    a = torch.ones_like(b)
    a[1, -6:] = 0
    b = b * a
    shuffled = knocked_availability(b, a, "shuffle", torch.Generator().manual_seed(0))
    assert torch.equal(shuffled.sum(1), b.sum(1)) and not torch.equal(shuffled, b)
    assert not (shuffled * (1 - a)).any()  # never onto invalid positions
    const = knocked_availability(b, a, "constant")
    assert torch.allclose(const.sum(1), b.sum(1)) and torch.equal(const[1, -6:], torch.zeros(6))

    rope = model("rope")
    settings = LayoutEvalSettings(seq_len=L, draws=2, layouts=("iid", "spans"))
    plain = score_layouts(fn(rope), batches(), MASK, settings)
    with layout_knockout(rope, "shuffle"):
        knocked = score_layouts(fn(rope), batches(), MASK, settings)
    for layout in settings.layouts:
        delta, _ = paired_difference(knocked[layout].loss, plain[layout].loss, plain[layout].tokens)
        assert delta == 0.0


def test_evaluate_cli_by_layout_pairs_models_on_the_same_masks(tmp_path, assets):
    """launch/evaluate.py --corruption: a model paired with itself differs by exactly 0; RoPE and
    MDLMPE models are scored on the same tokens under every layout."""
    import importlib.util
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from mdlmpe_ds.models.hf_io import save_pretrained
    from mdlmpe_ds.runs.pretrain_run import sentencepiece_for_corpus

    corpus = str(assets("botchan").botchan)
    tokenizer = AutoTokenizer.from_pretrained(str(sentencepiece_for_corpus(corpus, 400, cache_root=tmp_path)))
    dirs = []
    for name, encoding in (("rope", "rope"), ("rope_again", "rope"), ("mdlmpe", "mdlmpe")):
        torch.manual_seed(0)
        config = preset(
            "llada-tiny", vocab_size=448, mask_token_id=tokenizer.mask_token_id, position_encoding=encoding,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, max_seq_len=32,
        )  # fmt: skip
        save_pretrained(DiffusionLM(config), tmp_path / name, config)
        tokenizer.save_pretrained(str(tmp_path / name))
        dirs.append(str(tmp_path / name))
    spec = importlib.util.spec_from_file_location(
        "evaluate_cli", Path(__file__).parents[2] / "launch" / "evaluate.py"
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "layouts"
    args = [*dirs, "--corpora", corpus, "--max_sequences", "4", "--num_samples", "2", "--batch_size", "2"]
    assert cli.main([*args, "--corruption", "iid", "semi_ar", "spans", "--out", str(out)]) == 0
    table = json.loads(out.with_suffix(".json").read_text())["tables"][corpus]
    assert table["reference"] == "rope"
    for layout in ("iid", "semi_ar", "spans"):
        assert table["paired"]["rope_again"][layout]["delta"] == 0.0
        assert table["paired"]["mdlmpe"][layout]["delta"] != 0.0
        assert table["nll"]["rope"][layout]["tokens"] == table["nll"]["mdlmpe"][layout]["tokens"] > 0
    assert "| mdlmpe − rope (paired) |" in out.with_suffix(".md").read_text()


def test_seed_summary_of_a_bucket_no_window_reached_is_nan_not_an_error():
    """The full-size study met a local-density bucket empty in one seed (paired difference NaN):
    the summary must report NaN there and still summarise every other bucket."""
    from mdlmpe_ds.experiments.mechanism_study import _across

    full = _across([{"delta": 0.25, "se": 0.1}, {"delta": 0.75, "se": 0.2}])
    assert full["mean"] == 0.5 and full["sd_over_seeds"] == pytest.approx(0.5**0.5 * 0.5)
    assert full["paired_se_of_mean"] == pytest.approx((0.1**2 + 0.2**2) ** 0.5 / 2)
    empty = _across([{"delta": math.nan, "se": math.nan}, {"delta": 0.75, "se": 0.2}])
    assert math.isnan(empty["mean"]) and math.isnan(empty["sd_over_seeds"])
    assert _across([{"delta": 0.3, "se": 0.1}])["sd_over_seeds"] is None


@pytest.mark.parametrize("plan", ["STUDY", "TOY"])
def test_mechanism_study_training_flags_make_a_valid_pretraining_run(plan):
    """The study's own pretraining flags (launch/mechanism_study.py) parse into a run that passes
    validation, with the settings its docs state: the full study trains with the unweighted
    masked-token mean and compiled MDLMPE attention at L 128 (docs/results.md)."""
    import runpy
    from pathlib import Path

    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.config.recipes import pretrain_config

    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "launch" / "mechanism_study.py"))
    flags = script["training_flags"](script[plan]["train"], ["--max_steps", "5"])
    run = build_config(None, flags, defaults=pretrain_config(None, 2))
    assert run.train.max_steps == 5  # the user's flag wins over the study's
    assert run.train.corruption == "mix"
    if plan == "STUDY":
        assert (run.data.max_len, run.data.tokenizer_vocab, run.model.preset) == (128, 512, "llada-mech")
        assert (run.train.loss, run.train.dream_weighting, run.attention.compile) == ("dream", "none", True)


def test_mechanism_study_paper_plan_is_the_100m_recipe_with_the_study_corruption(capsys, tmp_path):
    """``--paper --dry-run`` plans, per (encoding, seed), the paper's llada-100m pretraining (App.
    B.3: OpenWebText, L 1024, 200K updates, LLaDA's loss) with the study's ``mix`` corruption, and
    the scoring on OWT's held-out slice; a flag the user passes wins; nothing is written."""
    import runpy
    from pathlib import Path

    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "launch" / "mechanism_study.py"))
    out = tmp_path / "mech"
    assert script["main"](["--paper", "--dry-run", "--seeds", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for encoding in ("rope", "mdlmpe"):
        line = next(x for x in text.splitlines() if x.startswith(f"[mechanism] {encoding} seed 3:"))
        for part in ("llada-100m", "max_steps 200000", "lr 0.0001", "max_len 1024", "corruption mix",
                     "loss auto", "dataset openwebtext", "tokenizer GSAI-ML/LLaDA-8B-Base"):  # fmt: skip
            assert part in line, (part, line)
    assert "256 windows of openwebtext x 8 draws" in text
    assert f"--output_dir {out}/runs/mdlmpe-seed3 --resume auto" in text
    assert not out.exists()
    script["main"](["--paper", "--dry-run", "--seeds", "0", "--encodings", "rope", "--max_steps", "7"])
    assert "max_steps 7," in capsys.readouterr().out


def test_mechanism_study_wall_clock_counts_a_killed_call(tmp_path):
    """A study call that is killed still counts the time up to its last write: the entry is
    rewritten while it runs, and the next call adds its own entry beside it."""
    import json
    import runpy
    import time
    from pathlib import Path

    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "launch" / "mechanism_study.py"))
    first = script["WallClock"](tmp_path, every=0.02)  # never stopped: the call that was killed
    time.sleep(0.2)
    written = json.loads((tmp_path / "wall_time.json").read_text())["calls"]
    assert len(written) == 1 and written[0] >= 0.1
    first._done.set()
    second = script["WallClock"](tmp_path, every=60)
    time.sleep(0.05)
    total = second.stop()
    calls = json.loads((tmp_path / "wall_time.json").read_text())["calls"]
    assert len(calls) == 2 and calls[1] >= 0.05 and total == pytest.approx(sum(calls))
