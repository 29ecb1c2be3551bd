"""The scored-positions LM head (models/scored_head.py): the training losses computed from the chunked
head equal the full-logits losses and their gradients, for both families, block diffusion and every
Dream weighting; and the training forward never allocates a [B, L, V] tensor.

Tolerance (fp32): the two paths run the same operations on the same rows, except that the head's
GEMM sees [chunk, d] instead of [B*L, d] (another blocking, so another summation order of the d
products of each logit) and the final norm sees [M, d] rows instead of [B, L, d]. Each logit then
differs by at most ~d * eps32 * sum|h||w| ~ 64 * 6e-8 * O(1) ~ 4e-6 relative, which carries through
the softmax and the weighted sums at the same relative size; we allow 2e-5 relative (5x margin).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mdlmpe_ds.config.cli import build_config
from mdlmpe_ds.data.sft_collate import SFTCollator
from mdlmpe_ds.data.sft_encode import SFTExample
from mdlmpe_ds.diffusion.blocks import block_sft_corrupt
from mdlmpe_ds.diffusion.corruption import corrupt, noise_generator
from mdlmpe_ds.diffusion.losses import dream_sft_loss, llada_pretrain_loss, llada_sft_loss
from mdlmpe_ds.models.presets import preset
from mdlmpe_ds.models.recompute import Recompute
from mdlmpe_ds.models.scored_head import ScoredCE, scored_cross_entropy
from mdlmpe_ds.models.transformer import DiffusionLM

RTOL = 2e-5
CHUNK = 5  # rows per head chunk: several chunks and a ragged last one in every test batch


def _model(family: str, encoding: str = "rope", checkpointing: bool = True) -> DiffusionLM:
    torch.manual_seed(0)
    cfg = preset(f"{family}-tiny", position_encoding=encoding)
    return DiffusionLM(cfg, recompute=Recompute(layers=checkpointing)).train()


def _batch(model: DiffusionLM, seed: int = 0) -> dict[str, torch.Tensor]:
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for n, prompt in ((21, 5), (14, 3), (18, 7)):
        ids = torch.randint(0, cfg.vocab_size - 3, (n,), generator=gen).tolist()
        examples.append(SFTExample(input_ids=ids, prompt_len=prompt))
    return SFTCollator(cfg.eos_token_id, max_len=64, attend_padding=False)(examples)


def _grads(model: DiffusionLM, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(name: str, new: torch.Tensor, old: torch.Tensor) -> None:
    scale = float(old.abs().max()) or 1.0
    err = float((new - old).abs().max())
    assert err <= RTOL * scale, f"{name}: max |new - old| = {err:.3g} > {RTOL} x {scale:.3g}"


def _compare(model: DiffusionLM, loss_fn, ids, valid, masked, positions=None) -> None:
    """loss_fn(logits_or_scored) -> (loss, stats) through the full logits and the scored head."""
    old_loss, old_stats = loss_fn(model(ids, valid=valid, positions=positions))
    old_grads = _grads(model, old_loss)
    scored = model(ids, valid=valid, positions=positions, scored=masked, targets=ids, head_chunk=CHUNK)
    assert isinstance(scored, ScoredCE) and scored.ce.dtype == torch.float32
    new_loss, new_stats = loss_fn(scored)
    new_grads = _grads(model, new_loss)
    _assert_close("loss", new_loss.detach(), old_loss.detach())
    for field in ("nll_sum", "bucket_nll"):
        _assert_close(field, getattr(new_stats, field), getattr(old_stats, field))
    assert torch.equal(new_stats.bucket_count, old_stats.bucket_count)
    assert new_grads.keys() == old_grads.keys() and len(new_grads) == len(list(model.parameters()))
    for name in old_grads:
        _assert_close(f"grad {name}", new_grads[name], old_grads[name])


@pytest.mark.parametrize("encoding", ["rope", "mdlmpe"])
def test_llada_sft_loss_and_gradients_match_full_logits(encoding):
    model = _model("llada", encoding)
    batch = _batch(model)
    gen = noise_generator(1, 0, 0)
    noisy = corrupt(batch["input_ids"], batch["maskable"], model.config.mask_token_id, gen)
    ids, valid = batch["input_ids"], batch["valid"]

    def loss_fn(out):
        return llada_sft_loss(out, ids, noisy.masked, noisy.p_mask, batch["answer_len"])

    assert int(noisy.masked.sum()) > 2 * CHUNK
    # the model sees the noisy ids; the targets are the clean ids
    old = loss_fn(model(noisy.noisy_ids, valid=valid))[0]
    new = loss_fn(model(noisy.noisy_ids, valid=valid, scored=noisy.masked, targets=ids, head_chunk=CHUNK))[0]
    _assert_close("noisy-input loss", new.detach(), old.detach())
    _compare(model, loss_fn, ids, valid, noisy.masked)


def test_llada_block_diffusion_loss_matches_full_logits():
    model = _model("llada", "mdlmpe")
    batch = _batch(model, seed=3)
    gen = noise_generator(1, 0, 5)
    b = block_sft_corrupt(
        batch["input_ids"], batch["prompt_mask"], batch["maskable"], batch["valid"],
        4, "blocked", model.config.mask_token_id, gen,
    )  # fmt: skip
    ids = batch["input_ids"]

    def loss_fn(out):
        return llada_sft_loss(out, ids, b.loss_mask, b.p_mask, b.block_len)

    assert bool(b.loss_mask.any())
    _compare(model, loss_fn, ids, b.valid, b.loss_mask)


def test_llada_pretrain_loss_matches_full_logits():
    model = _model("llada", checkpointing=False)
    batch = _batch(model, seed=4)
    gen = noise_generator(2, 0, 0)
    noisy = corrupt(batch["input_ids"], batch["valid"], model.config.mask_token_id, gen)
    ids = batch["input_ids"]
    _compare(
        model, lambda out: llada_pretrain_loss(out, ids, noisy.masked, noisy.p_mask), ids, None, noisy.masked
    )


@pytest.mark.parametrize("weighting", ["original", "cart", "linear", "none"])
def test_dream_sft_loss_and_gradients_match_full_logits(weighting):
    """Dream's logits are shifted (aligned logit i = raw logit i - 1): the scored head must read
    the hidden state one column to the left; left padding and per-row positions included."""
    model = _model("dream", "mdlmpe")
    batch = _batch(model, seed=1)
    ids, valid = batch["input_ids"], batch["valid"]
    positions = torch.arange(ids.shape[1]).expand_as(ids).clone()
    positions[1] += 2  # rows need not start at 0
    gen = noise_generator(1, 0, 2)
    noisy = corrupt(ids, batch["maskable"], model.config.mask_token_id, gen)
    masked = noisy.masked.clone()
    masked[0, 0] = batch["maskable"][0, 0]  # column 0 (raw logit 0 reused) is covered as well

    def loss_fn(out):
        return dream_sft_loss(
            out, ids, masked, noisy.t, batch["maskable"] & valid, weighting=weighting, cart_p=0.2, valid=valid
        )

    _compare(model, loss_fn, ids, valid, masked, positions)


def test_no_masked_position_gives_zero_loss_and_zero_gradients():
    """A micro-batch without a scored position still runs the head (on an empty chunk) so every
    parameter gets a (zero) gradient, as ZeRO-3's gradient hooks expect on every rank."""
    model = _model("llada")
    batch = _batch(model)
    ids, none = batch["input_ids"], torch.zeros_like(batch["valid"])
    out = model(ids, valid=batch["valid"], scored=none, targets=ids, head_chunk=CHUNK)
    loss, stats = llada_sft_loss(out, ids, none, torch.full((3,), 0.5), batch["answer_len"])
    grads = _grads(model, loss)
    assert float(loss.detach()) == 0.0 and int(stats.num_masked) == 0
    assert len(grads) == len(list(model.parameters())) and all(
        float(g.abs().max()) == 0 for g in grads.values()
    )


def test_mismatched_scored_mask_is_refused():
    model = _model("llada")
    batch = _batch(model)
    ids, valid = batch["input_ids"], batch["valid"]
    out = model(ids, valid=valid, scored=batch["maskable"], targets=ids)
    with pytest.raises(ValueError, match="ScoredCE holds"):
        llada_sft_loss(out, ids, valid, torch.full((3,), 0.5), batch["answer_len"])
    with pytest.raises(ValueError, match="scored and targets together"):
        model(ids, valid=valid, scored=batch["maskable"])
    with pytest.raises(ValueError, match="chunk"):
        scored_cross_entropy(model.lm_head, torch.zeros(2, 64), torch.zeros(2, dtype=torch.long), chunk=0)


class _VocabWideOutputs(TorchDispatchMode):
    """Records the largest number of vocabulary-wide rows (numel / V of any op output whose last
    dim is V, the LM head weight's own [d, V] / [V, d] views and gradients excluded)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.max_rows, self.shapes = vocab, hidden, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                if tuple(t.shape) in ((self.hidden, self.vocab), (self.vocab, self.hidden)):
                    continue
                self.shapes.add(tuple(t.shape))
                self.max_rows = max(self.max_rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("block_size", [None, 4])
def test_training_micro_step_allocates_no_full_logits(family, block_size):
    """SFTTask.micro (forward + backward of one micro-batch, the model in place of the DeepSpeed
    engine, whose forward calls it unchanged): no op output is vocabulary-wide for more rows than one
    head chunk -- in particular no [B, L, V] logits and no fp32 [M, V] copy."""
    from mdlmpe_ds.tasks.sft import SFTTask

    model = _model(family, "mdlmpe")
    cfg = model.config
    tokens = ["--block_size", str(block_size)] if block_size else []
    run = build_config(None, tokens)
    sft = SFTTask(run.train, cfg)
    batch = _batch(model, seed=2)
    B, L = batch["input_ids"].shape
    watch = _VocabWideOutputs(cfg.vocab_size, cfg.hidden_size)
    with watch:
        loss, stats, _, _ = sft.micro(model, batch, micro_step=0, rank=0)
        loss.backward()
    assert torch.isfinite(loss) and int(stats.num_masked) > 0
    # the head's chunk is DEFAULT_CHUNK rows, far more than B * L here: bound by the scored count
    assert watch.max_rows <= int(stats.num_masked), sorted(watch.shapes)
    assert (B, L, cfg.vocab_size) not in watch.shapes and int(stats.num_masked) < B * L


def test_head_chunk_from_the_environment(monkeypatch):
    """Trainers pass no chunk: $MDLMPE_DS_HEAD_CHUNK (else DEFAULT_CHUNK) bounds the vocab-wide rows."""
    from mdlmpe_ds.training.head_chunks import CHUNK_ENV, DEFAULT_CHUNK, configured_chunk

    assert configured_chunk() == DEFAULT_CHUNK
    monkeypatch.setenv(CHUNK_ENV, "3")
    model = _model("llada")
    batch = _batch(model)
    ids = batch["input_ids"]
    watch = _VocabWideOutputs(model.config.vocab_size, model.config.hidden_size)
    with watch:
        out = model(
            ids, valid=batch["valid"], scored=batch["maskable"], targets=ids, head_chunk=configured_chunk()
        )
        out.ce.sum().backward()
    assert out.ce.numel() > 3 and watch.max_rows == 3
    monkeypatch.setenv(CHUNK_ENV, "0")
    with pytest.raises(ValueError, match=CHUNK_ENV):
        configured_chunk()


def test_a_fixed_chunk_count_adds_empty_head_calls():
    """Under ZeRO-3 every rank calls the head ``head_chunks`` times (each call gathers its weight):
    extra chunks are empty, in forward and in the backward recompute; values are unchanged."""
    model = _model("llada")
    batch = _batch(model)
    ids, valid, scored = batch["input_ids"], batch["valid"], batch["maskable"]
    calls = []
    model.lm_head.register_forward_hook(lambda module, args, out: calls.append(out.shape[0]))
    needed = -(-int(scored.sum()) // CHUNK)
    reference = model(ids, valid=valid, scored=scored, targets=ids, head_chunk=CHUNK)
    calls.clear()
    out = model(ids, valid=valid, scored=scored, targets=ids, head_chunk=CHUNK, head_chunks=needed + 2)
    out.ce.sum().backward()
    assert len(calls) == 2 * (needed + 2) and calls[needed : needed + 2] == [0, 0]  # forward, then recompute
    assert torch.equal(out.ce.detach(), reference.ce.detach())
    with pytest.raises(ValueError, match="cannot hold"):
        model(ids, valid=valid, scored=scored, targets=ids, head_chunk=CHUNK, head_chunks=needed - 1)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_pretraining_micro_step_allocates_no_full_logits(family):
    """PretrainTask.micro on packed windows: the same scored-head path, no [B, L, V] tensor,
    and its loss equals the pretraining loss of the full logits on the same corruption."""
    from mdlmpe_ds.data.packing import packed_collate
    from mdlmpe_ds.diffusion.elbo import scored_positions
    from mdlmpe_ds.tasks.pretrain import PretrainTask

    model = _model(family, "mdlmpe")
    cfg = model.config
    run = build_config(None, [])
    sft = PretrainTask(run.train, cfg)
    gen = torch.Generator().manual_seed(5)
    items = [
        {"input_ids": torch.randint(0, cfg.vocab_size - 3, (32,), generator=gen), "index": i} for i in (3, 8)
    ]
    batch = {**packed_collate(items), "epoch": 0}
    watch = _VocabWideOutputs(cfg.vocab_size, cfg.hidden_size)
    with watch:
        loss, stats, _, _ = sft.micro(model, batch, micro_step=0, rank=0)
        loss.backward()
    masked_count = int(stats.num_masked)
    assert 0 < masked_count < 2 * 32 and watch.max_rows <= masked_count, sorted(watch.shapes)
    noisy, masked, p = sft.corrupt(batch)
    ids, valid = batch["input_ids"], batch["valid"]
    with torch.no_grad():
        logits = model(noisy, valid=valid)
        if family == "llada":
            old, _ = llada_pretrain_loss(logits, ids, masked, p)
        else:
            t = sft.train  # the run's weighting (Dream's default is CART)
            old, _ = dream_sft_loss(
                logits, ids, masked, p, scored_positions(valid, "dream"), valid=valid,
                weighting=t.dream_weighting, cart_p=t.cart_p,
            )  # fmt: skip
    _assert_close("pretraining loss", loss.detach(), old)


def test_cart_counts_no_later_block_mask_token_as_context():
    """Block diffusion with block_context "full" writes the mask token into every later block and
    the model sees them, but no loss covers them: CART's context (revealed tokens) must leave them
    out, as the "blocked" mode does by making them invalid. Counting them as context made the early
    blocks' weights about 2.8x too large."""
    from mdlmpe_ds.diffusion.losses import cart_weights, masked_cross_entropy
    from mdlmpe_ds.tasks.sft import SFTTask

    model = _model("dream", "mdlmpe")
    run = build_config(None, ["--block_size", "4", "--block_context", "full", "--dream_weighting", "cart"])
    sft = SFTTask(run.train, model.config)
    batch = _batch(model, seed=3)
    c = sft.corrupt(batch, 0, 0)  # the micro step's own draw (keyed by seed, rank, micro-step)
    shown_masks = c.ids == model.config.mask_token_id
    assert bool((shown_masks & ~c.masked & c.valid).any())  # later blocks' masks, seen, not scored
    with torch.no_grad():
        loss, _, _, _ = sft.micro(model, batch, micro_step=0, rank=0)
        ce, _ = masked_cross_entropy(model(c.ids, valid=c.valid), batch["input_ids"], c.masked)
    weight = cart_weights(shown_masks, run.train.cart_p, c.valid)[c.masked]
    assert float(loss) == pytest.approx(float((ce * weight).sum() / ce.numel()), rel=1e-5)
    counted = cart_weights(c.masked, run.train.cart_p, c.valid)[c.masked]  # the mask tokens as context
    assert float((ce * counted).sum() / ce.numel()) > 1.2 * float(loss)


def test_dream_loss_settings_on_a_llada_loss_say_they_change_nothing(caplog):
    """--dream_weighting none --cart_p 0.5 on a LLaDA model trained bit for bit as without them."""
    from mdlmpe_ds.tasks.sft import SFTTask

    cfg = preset("llada-tiny")
    with caplog.at_level("WARNING"):
        SFTTask(build_config(None, ["--dream_weighting", "none", "--cart_p", "0.5"]).train, cfg)
    assert "--dream_weighting none and --cart_p 0.5 set the Dream loss" in caplog.text
    assert "--loss dream" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        SFTTask(build_config(None, ["--loss", "dream", "--cart_p", "0.5"]).train, cfg)
        SFTTask(build_config(None, []).train, cfg)
    assert caplog.text == ""
