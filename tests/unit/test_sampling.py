"""Samplers (docs/models.md §4): schedules, reveal counts, block regimes, MDLMPE features per step, seeding,
batching, EOS early stop. Tiny fp32 models on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from mdlmpe_ds.diffusion.sampling import (
    SamplerConfig,
    build_canvas,
    eos_finished,
    generate,
    trim_at_eos,
)
from mdlmpe_ds.diffusion.sampling_rules import (
    dream_transfer_counts,
    linear_transfer_counts,
    select_positions,
    top_p_filter,
    transfer_counts,
)
from mdlmpe_ds.models import DiffusionLM, preset
from mdlmpe_ds.pe.availability import dense_weights, sine_basis

PROMPTS = [[3, 14, 15, 92], [6, 53], [58, 97, 93, 23, 84, 62, 64]]


def tiny(family: str = "llada", encoding: str = "mdlmpe", seed: int = 0) -> DiffusionLM:
    torch.manual_seed(seed)
    # init_std 0.2 makes the random model's logits peaked, so argmax/confidence orderings are clear.
    model = DiffusionLM(preset(f"{family}-tiny", position_encoding=encoding, init_std=0.2))
    return model.eval()


@pytest.fixture(scope="module")
def llada():
    return tiny("llada")


@pytest.fixture(scope="module")
def dream():
    return tiny("dream")


# ------------------------------------------------------------------------------------ schedules
def test_linear_schedule_is_lladas():
    counts = linear_transfer_counts(torch.tensor([10, 8, 3]), 4)
    assert counts.tolist() == [[3, 3, 2, 2], [2, 2, 2, 2], [1, 1, 1, 0]]


def test_dream_schedule_by_hand():
    # t = linspace(1, 1e-3, 5) = [1, .75025, .5005, .25075, .001]; m = 8:
    # floor(8 * .24975) = 1, floor(7 * (1 - .5005/.75025)) = 2, floor(5 * (1 - .25075/.5005)) = 2, rest 3.
    assert dream_transfer_counts(torch.tensor([8]), 4).tolist() == [[1, 2, 2, 3]]
    counts = dream_transfer_counts(torch.tensor([32, 5, 0]), 7)
    assert counts.sum(1).tolist() == [32, 5, 0] and bool((counts >= 0).all())
    with pytest.raises(ValueError):
        transfer_counts(torch.tensor([4]), 2, "cosine")


def test_select_positions_takes_most_confident_eligible():
    conf = torch.tensor([[0.1, 0.9, 0.5, 0.8], [0.3, 0.2, 0.7, 0.6]])
    eligible = torch.tensor([[True, False, True, True], [True, True, True, True]])
    chosen = select_positions(conf, eligible, torch.tensor([2, 1]))
    assert chosen.tolist() == [[False, False, True, True], [False, False, True, False]]
    with pytest.raises(ValueError, match="eligible"):
        select_positions(conf, eligible, torch.tensor([4, 1]))
    g = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    drawn = select_positions(conf, eligible, torch.tensor([3, 2]), alg_temp=0.5, generators=g)
    assert drawn.sum(1).tolist() == [3, 2] and not bool((drawn & ~eligible).any())


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = top_p_filter(logits, 0.7) > torch.finfo(torch.float32).min
    assert kept.tolist() == [[True, True, False, False]]


# ------------------------------------------------------------------------------------ sampling
ALGOS = [
    dict(algorithm="low_confidence"),
    dict(algorithm="random", temperature=1.0),
    dict(algorithm="low_confidence", temperature=0.7),
    dict(algorithm="maskgit_plus", temperature=0.5, top_p=0.95),
    dict(algorithm="margin", top_k=20),
    dict(algorithm="entropy", temperature=0.2, top_p=0.95, alg_temp=0.3),
]


@pytest.mark.parametrize("context", ["full", "blocked"])
def test_origin_reveals_each_mask_with_probability_one_minus_s_over_t(llada, context):
    steps = 4
    cfg = SamplerConfig(
        gen_length=64,
        steps=steps,
        algorithm="origin",
        temperature=0.5,
        block_context=context,
        stop_at_eos=False,
    )
    out = generate(llada, [PROMPTS[0]] * 8, cfg, seeds=range(8), record_history=True)
    revealed = torch.stack([h.revealed for h in out.history]).double()  # [steps, rows]
    t = torch.linspace(1.0, 1e-3, steps + 1, dtype=torch.float64)
    remaining = torch.full((8,), 64.0, dtype=torch.float64)
    for k in range(steps - 1):  # binomial(remaining, 1 - s/t) per row; compare the batch mean
        p = 1 - t[k + 1] / t[k]
        expected = (remaining * p).sum()
        assert abs(revealed[k].sum() - expected) < 4 * math.sqrt(float(expected * (1 - p))) + 1
        remaining -= revealed[k]
    assert torch.equal(revealed[-1], remaining)  # everything left at the last step
    assert not bool((out.responses == llada.config.mask_token_id).any())
    alone = generate(llada, [PROMPTS[0]], cfg, seeds=[3]).responses[0]
    assert torch.equal(alone, out.responses[3])


@pytest.mark.parametrize("context", ["full", "blocked"])
@pytest.mark.parametrize("opts", ALGOS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_each_step_reveals_the_scheduled_count_and_keeps_the_prompt(llada, context, opts):
    cfg = SamplerConfig(
        gen_length=12, steps=6, block_length=4, block_context=context, stop_at_eos=False, **opts
    )
    out = generate(llada, PROMPTS, cfg, record_history=True)
    counts = transfer_counts(torch.tensor([4]), 2, cfg.resolved_schedule)[0].tolist()  # per block
    assert [h.revealed.tolist() for h in out.history] == [[c] * 3 for c in counts * 3]
    for r, prompt in enumerate(PROMPTS):
        assert out.sequences[r, : len(prompt)].tolist() == prompt
        for h in out.history:  # the prompt is never changed at any step
            assert h.input_ids[r, : len(prompt)].tolist() == prompt
    assert not bool((out.responses == llada.config.mask_token_id).any())
    # Only the active block changes at a step.
    for before, after in zip(out.history, [*out.history[1:], None]):
        state = out.sequences if after is None else after.input_ids
        changed = (state != before.input_ids).nonzero()
        for r, col in changed.tolist():
            offset = col - len(PROMPTS[r])
            assert before.block * 4 <= offset < (before.block + 1) * 4


def _spy_features(model):
    enc = model.embed.mdlmpe
    original = enc.features
    calls = []

    def spy(input_ids, valid=None, positions=None):
        feats = original(input_ids, valid, positions)
        calls.append((input_ids.clone(), None if valid is None else valid.clone(), feats))
        return feats

    enc.features = spy
    return calls, lambda: delattr(enc, "features")


def _features_from_scratch(model, ids, valid):
    """b, a, A, D on a state with the materialised weights (Eq. (22)), independent of the conv path."""
    cfg, enc = model.config, model.embed.mdlmpe
    a = valid.float()
    b = (ids != cfg.mask_token_id).float() * a
    w = dense_weights(a, cfg.mdlmpe.window, cfg.mdlmpe.sigma, cfg.mdlmpe.eps)  # [B, L, L]
    c = sine_basis(ids.shape[1], cfg.head_dim, cfg.rope_theta)  # [L, F]
    A = w @ (b[..., None] * c)
    D = w @ (a[..., None] * c) + cfg.mdlmpe.eps
    return b, a, A, D, enc


@pytest.mark.parametrize("context", ["full", "blocked"])
def test_mdlmpe_features_at_every_step_equal_features_of_that_state(context):
    model = tiny("llada")
    calls, restore = _spy_features(model)
    cfg = SamplerConfig(gen_length=8, steps=8, block_length=4, block_context=context, stop_at_eos=False)
    out = generate(model, PROMPTS[:2], cfg, record_history=True)
    restore()
    assert len(calls) == len(out.history) == 8
    revealed_so_far = torch.zeros(2, dtype=torch.long)
    for (ids, valid, feats), h in zip(calls, out.history):
        assert torch.equal(ids, h.input_ids) and torch.equal(valid, h.valid)
        b, a, A, D, _ = _features_from_scratch(model, h.input_ids, h.valid)
        assert torch.equal(feats.b, b) and torch.equal(feats.a, a)
        torch.testing.assert_close(feats.A, A, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(feats.D, D, atol=1e-5, rtol=1e-5)
        # b counts exactly the prompt plus what earlier steps revealed: it tracks the state.
        assert feats.b.sum(1).long().tolist() == [
            len(p) + n for p, n in zip(PROMPTS, revealed_so_far.tolist())
        ]
        revealed_so_far += h.revealed
        offsets = torch.arange(ids.shape[1])[None, :] - torch.tensor([len(p) for p in PROMPTS[:2]])[:, None]
        later = (offsets >= (h.block + 1) * 4) & (offsets < 8)
        if context == "blocked":  # later blocks hidden: a_t = 0, b_t = 0
            assert not bool(feats.a[later].any()) and not bool(feats.b[later].any())
        else:  # visible as masks: a_t = 1, b_t = 0
            assert bool(feats.a[later].all()) and not bool(feats.b[later].any())


@pytest.mark.parametrize("context", ["full", "blocked"])
def test_blocked_context_ignores_positions_after_the_active_block(llada, context):
    cfg = SamplerConfig(gen_length=8, steps=4, block_length=4, block_context=context, stop_at_eos=False)
    out = generate(llada, PROMPTS[:1], cfg, record_history=True)
    first = out.history[1]  # a step inside block 0
    ids, valid = first.input_ids, first.valid
    later = torch.zeros_like(ids, dtype=torch.bool)
    later[0, len(PROMPTS[0]) + 4 :] = True
    perturbed = ids.masked_fill(later, 7)  # real tokens where the masks of later blocks were
    with torch.no_grad():
        base, moved = llada(ids, valid=valid), llada(perturbed, valid=valid)
    seen = ~later
    if context == "blocked":
        torch.testing.assert_close(moved[seen], base[seen], atol=0, rtol=0)
    else:  # full: the later masks are visible, so writing tokens there changes the logits
        assert (moved[seen] - base[seen]).abs().max() > 1e-4


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_blocked_generation_does_not_depend_on_the_blocks_that_follow(family, llada, dream):
    """End to end: with blocked context the first blocks come out the same whether 2 or 6 more
    blocks follow (they are invisible); with full context the trailing masks are seen and change them."""
    model = llada if family == "llada" else dream
    outputs = {}
    for context in ("blocked", "full"):
        for gen_length in (8, 24):
            cfg = SamplerConfig(
                gen_length=gen_length,
                steps=gen_length // 2,
                block_length=4,
                block_context=context,
                algorithm="low_confidence",
                temperature=0.8,
                stop_at_eos=False,
            )
            outputs[context, gen_length] = generate(model, PROMPTS, cfg, seeds=[5, 6, 7]).responses[:, :8]
    assert torch.equal(outputs["blocked", 8], outputs["blocked", 24])
    assert not torch.equal(outputs["full", 8], outputs["full", 24])


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_same_seed_same_output_and_seed_matters(family, llada, dream):
    model = llada if family == "llada" else dream
    cfg = SamplerConfig(gen_length=8, steps=8, algorithm="low_confidence", temperature=1.0, stop_at_eos=False)
    a = generate(model, PROMPTS, cfg, seeds=[1, 2, 3]).responses
    b = generate(model, PROMPTS, cfg, seeds=[1, 2, 3]).responses
    c = generate(model, PROMPTS, cfg, seeds=[4, 5, 6]).responses
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize(
    "family,opts",
    [
        ("llada", dict(algorithm="low_confidence", temperature=1.0, block_length=4, block_context="blocked")),
        ("llada", dict(algorithm="random", temperature=0.5, block_length=8)),
        ("dream", dict(algorithm="entropy", temperature=0.7, top_p=0.9, alg_temp=0.2, block_length=4)),
        ("dream", dict(algorithm="maskgit_plus", block_length=4, block_context="blocked")),
    ],
)
def test_batch_equals_prompts_one_by_one(family, opts, llada, dream):
    model = llada if family == "llada" else dream
    cfg = SamplerConfig(gen_length=8, steps=8, stop_at_eos=False, **opts)
    seeds = [11, 12, 13]
    batch = generate(model, PROMPTS, cfg, seeds=seeds).responses
    for r, (prompt, seed) in enumerate(zip(PROMPTS, seeds)):
        alone = generate(model, [prompt], cfg, seeds=[seed]).responses
        assert torch.equal(batch[r], alone[0]), f"row {r}"


class EosAfter(torch.nn.Module):
    """Wraps a model and makes EOS overwhelmingly likely at response offsets >= ``offset``."""

    def __init__(self, model, prompt_len, offset):
        super().__init__()
        self.model, self.config, self.cut = model, model.config, prompt_len + offset

    def forward(self, input_ids, valid=None):
        logits = self.model(input_ids, valid=valid).clone()
        logits[:, self.cut :, self.config.eos_token_id] += 50.0
        return logits


def test_eos_early_stop_saves_steps_without_changing_the_text(llada):
    prompt = PROMPTS[0]
    model = EosAfter(llada, len(prompt), offset=5)
    eos = llada.config.eos_token_id
    cfg = dict(gen_length=16, steps=16, block_length=4)
    stopped = generate(model, [prompt, prompt], SamplerConfig(**cfg), seeds=[0, 1])
    full = generate(model, [prompt, prompt], SamplerConfig(stop_at_eos=False, **cfg), seeds=[0, 1])
    assert stopped.finished.all() and stopped.steps_run < full.steps_run
    for r in range(2):
        text = trim_at_eos(stopped.responses[r], eos)
        assert text == trim_at_eos(full.responses[r], eos) and len(text) == 5
        assert stopped.responses[r, 5:].eq(eos).all()


class Favours(torch.nn.Module):
    """Wraps a model and adds ``bias`` to the logit of ``token`` everywhere."""

    def __init__(self, model, token, bias=50.0):
        super().__init__()
        self.model, self.config, self.token, self.bias = model, model.config, token, bias

    def forward(self, input_ids, valid=None):
        logits = self.model(input_ids, valid=valid).clone()
        logits[..., self.token] += self.bias
        return logits


@pytest.mark.parametrize("algorithm", ["low_confidence", "entropy"])
def test_mask_and_suppressed_eos_are_never_proposed(llada, algorithm):
    cfg = SamplerConfig(gen_length=8, steps=4, algorithm=algorithm, temperature=0.5)
    out = generate(Favours(llada, llada.config.mask_token_id), PROMPTS, cfg)
    assert not bool((out.responses == llada.config.mask_token_id).any())
    eos = llada.config.eos_token_id
    out = generate(Favours(llada, eos), PROMPTS, SamplerConfig(gen_length=8, steps=4, suppress_eos=True))
    assert not bool((out.responses == eos).any())


class Guided(torch.nn.Module):
    """LLaDA's CFG done by hand: the unconditional logits come from the prompt-masked state."""

    def __init__(self, model, prompt_lens, scale):
        super().__init__()
        self.model, self.config, self.prompt_lens, self.scale = model, model.config, prompt_lens, scale

    def forward(self, input_ids, valid=None):
        uncond_ids = input_ids.clone()
        for r, n in enumerate(self.prompt_lens):
            uncond_ids[r, :n] = self.config.mask_token_id
        cond, uncond = self.model(input_ids, valid=valid), self.model(uncond_ids, valid=valid)
        return uncond + (self.scale + 1.0) * (cond - uncond)


def test_cfg_guidance_equals_the_formula_with_a_prompt_masked_copy(llada):
    base = dict(gen_length=8, steps=8, block_length=4, temperature=0.5, stop_at_eos=False)
    guided = generate(llada, PROMPTS, SamplerConfig(cfg_scale=1.5, **base), seeds=[1, 2, 3]).responses
    by_hand = generate(
        Guided(llada, [len(p) for p in PROMPTS], 1.5), PROMPTS, SamplerConfig(**base), seeds=[1, 2, 3]
    )
    plain = generate(llada, PROMPTS, SamplerConfig(**base), seeds=[1, 2, 3]).responses
    assert torch.equal(guided, by_hand.responses)
    assert not torch.equal(guided, plain)


def test_eos_finished_rule():
    m, e = 9, 8
    responses = torch.tensor([[1, 2, e, m], [1, m, e, 3], [1, 2, 3, 4], [e, m, m, m]])
    assert eos_finished(responses, m, e).tolist() == [True, False, False, True]


def test_canvas_layout_pads_only_at_the_end():
    canvas = build_canvas([[5, 6, 7], [8]], gen_length=2, mask_id=9, pad_id=0)
    assert canvas.ids.tolist() == [[5, 6, 7, 9, 9], [8, 9, 9, 0, 0]]
    assert canvas.real.tolist() == [[True] * 5, [True, True, True, False, False]]
    assert canvas.gen_start.tolist() == [3, 1]
    with pytest.raises(ValueError, match="prompt 1 contains the mask"):
        build_canvas([[1], [9]], 2, mask_id=9, pad_id=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(gen_length=8, block_length=3), "divide"),
        (dict(gen_length=8, block_length=4, steps=3), "multiple"),
        (dict(block_context="sideways"), "block_context"),
        (dict(algorithm="low_confidence", top_p=0.9), "Dream options"),
        (dict(algorithm="beam"), "unknown sampling algorithm"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplerConfig(**kwargs).validate()


# ------------------------------------------------------------------------------------ launch/generate.py
def _byte_tokenizer(path):
    """A byte-level tokenizer (256 byte tokens, no merges) with EOS 510 and mask 511, saved as an HF dir."""
    from byte_model_fixtures import byte_tokenizer

    return byte_tokenizer(path)


def _load_launcher():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "launch" / "generate.py"
    spec = importlib.util.spec_from_file_location("launch_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generate_launcher_end_to_end_from_an_exported_dir(tmp_path, llada):
    import io

    from mdlmpe_ds.models.hf_io import save_pretrained

    save_pretrained(llada, tmp_path, llada.config)
    tok = _byte_tokenizer(tmp_path)
    launcher = _load_launcher()
    common = [
        "--checkpoint",
        str(tmp_path),
        "--gen_length",
        "8",
        "--steps",
        "8",
        "--block_length",
        "4",
        "--block_context",
        "blocked",
        "--stop_at_eos",
        "false",
    ]
    out = io.StringIO()
    assert launcher.main([*common, "--prompt", "Hi", "--prompt", "Hello there", "--show_steps"], out=out) == 0
    lines = out.getvalue().splitlines()
    assert sum(line.startswith("[step ") for line in lines) == 8 * 2  # every step, both rows
    assert "<|mdm_mask|>" in lines[0]  # masks are visible in the intermediate steps
    # The printed answers are the library's output for the same prompts and options.
    cfg = SamplerConfig(gen_length=8, steps=8, block_length=4, block_context="blocked", stop_at_eos=False)
    expected = generate(llada, [tok.encode("Hi"), tok.encode("Hello there")], cfg).responses
    answers = [tok.decode(trim_at_eos(r, 510), skip_special_tokens=True) for r in expected]
    assert out.getvalue().endswith("\n".join(answers) + "\n")
    chat = io.StringIO()
    assert launcher.main([*common, "--chat"], out=chat, stdin=io.StringIO("Hi\nAgain\n\n")) == 0
    assert chat.getvalue().startswith("chat:") and chat.getvalue().count("\n") >= 3  # banner + two answers


def test_generate_launcher_refuses_prompt_plus_gen_length_over_max_seq_len(tmp_path, llada):
    """A canvas past max_seq_len exits non-zero with a message giving both numbers (it used to print
    text generated at untrained positions and exit 0)."""
    import io
    import subprocess
    import sys
    from pathlib import Path

    from mdlmpe_ds.models.hf_io import save_pretrained

    save_pretrained(llada, tmp_path, llada.config)
    tok = _byte_tokenizer(tmp_path)
    limit = llada.config.max_seq_len
    prompt_len = len(tok.encode("Hello", add_special_tokens=False))
    gen = limit - prompt_len + 1
    launcher = _load_launcher()
    args = ["--checkpoint", str(tmp_path), "--steps", "1", "--prompt", "Hi", "--prompt", "Hello"]
    out = io.StringIO()
    with pytest.raises(SystemExit) as exc:
        launcher.main([*args, "--gen_length", str(gen)], out=out)
    assert str(exc.value) == (
        f"prompt 2 has {prompt_len} tokens + --gen_length {gen} = {limit + 1} tokens, more than the model's "
        f"maximum length {limit} (max_seq_len in its config); shorten the prompt or lower --gen_length"
    )
    assert out.getvalue() == ""  # nothing that looks like an answer
    # As a command: a non-zero exit status and the message on stderr.
    script = Path(__file__).resolve().parents[2] / "launch" / "generate.py"
    cmd = [sys.executable, str(script), *args[:-4], "--prompt", "Hello", "--gen_length", str(gen)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"the prompt has {prompt_len} tokens + --gen_length {gen}" in proc.stderr
    assert f"maximum length {limit}" in proc.stderr


def test_generate_launcher_from_a_training_output_dir(tmp_path, llada, monkeypatch):
    """A run's output_dir resolves to its newest COMPLETE checkpoint and the run's tokenizer; the
    consolidated weights (here: the engine's reader stubbed with the model's own state) load strictly."""
    import io

    from mdlmpe_ds.distributed import engine
    from mdlmpe_ds.training import checkpoint as ckpt
    from mdlmpe_ds.training import checkpointer

    tok_dir = tmp_path / "tok"
    tok = _byte_tokenizer(tok_dir)
    for step, complete in ((2, True), (4, False)):  # the newer one was interrupted mid-save
        path = ckpt.step_dir(tmp_path / "run", step)
        path.mkdir(parents=True)
        ckpt.write_meta(path, step, 1, {}, llada.config.to_dict(), str(tok_dir))
        if complete:
            checkpointer.finalize(path.rename(path.with_name(path.name + ckpt.STAGING)), path)
    seen = []

    def fake_reader(step_dir):
        seen.append(step_dir.name)
        return {k: v.clone() for k, v in llada.state_dict().items() if not k.endswith("active_kv")}

    monkeypatch.setattr(engine, "fp32_state_dict_from_checkpoint", fake_reader)
    out = io.StringIO()
    args = ["--checkpoint", str(tmp_path / "run"), "--gen_length", "8", "--steps", "4", "--prompt", "Hi"]
    assert _load_launcher().main(args, out=out) == 0
    assert seen == ["step_000002"]
    cfg = SamplerConfig(gen_length=8, steps=4)
    expected = generate(llada, [tok.encode("Hi")], cfg).responses[0]
    assert out.getvalue() == tok.decode(trim_at_eos(expected, 510), skip_special_tokens=True) + "\n"


def test_generate_refuses_or_warns_about_a_tokenizer_the_model_was_not_trained_with(monkeypatch, capsys):
    """launch/generate.py --tokenizer: one with ids past the model's vocabulary gave an IndexError
    from the embedding, and one of the same size from another corpus printed fluent-looking garbage
    with exit 0. The first is refused naming both sizes, the second warned about."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "launch" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_cli", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def __len__(self):
            return len(self.vocab)

        def get_vocab(self):
            return self.vocab

    trained = Tok({"a": 0, "b": 1, "c": 2})
    monkeypatch.setattr(cli, "load_tokenizer", lambda d: trained)
    with pytest.raises(SystemExit, match=r"--tokenizer big: 5 tokens, but the model's vocabulary has 3"):
        cli.check_tokenizer(Tok(dict.fromkeys("abcde", 0)), "big", 3, "run/tok")
    cli.check_tokenizer(Tok({"x": 0, "y": 1, "z": 2}), "other", 3, "run/tok")
    assert "is not the tokenizer the model was trained with (run/tok)" in capsys.readouterr().err
    cli.check_tokenizer(Tok({"a": 0, "b": 1, "c": 2}), "same", 3, "run/tok")
    assert capsys.readouterr().err == ""
