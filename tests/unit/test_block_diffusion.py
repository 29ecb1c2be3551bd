"""Block-diffusion SFT corruption and visibility, both regimes (paper §3.4, Figure 6)."""

from __future__ import annotations

import pytest
import torch

from mdlmpe_ds.data.sft_collate import SFTCollator
from mdlmpe_ds.data.sft_encode import SFTExample
from mdlmpe_ds.diffusion.blocks import block_sft_corrupt, num_blocks, sampling_visibility
from mdlmpe_ds.diffusion.corruption import noise_generator
from mdlmpe_ds.models import DiffusionLM, preset

MASK, EOS = 511, 510


def batch():
    examples = [
        SFTExample(input_ids=list(range(1, 5)) + list(range(100, 111)), prompt_len=4),  # response 11
        SFTExample(input_ids=[7, 8, *range(200, 206)], prompt_len=2),  # response 6 + EOS pads
        SFTExample(input_ids=[9, 10, 11, *range(300, 308)], prompt_len=3),
    ]
    return SFTCollator(pad_id=EOS)(examples)


def regions(b, out, block_size):
    """Per row: prompt, earlier, active, later masks [L] (recomputed from the response layout)."""
    L = b["input_ids"].shape[1]
    start = b["prompt_mask"].sum(1)
    rel = torch.arange(L)[None, :] - start[:, None]
    blk = torch.div(rel, block_size, rounding_mode="floor")
    resp = b["maskable"]
    k = out.active_block[:, None]
    return b["prompt_mask"], resp & (blk < k), resp & (blk == k), resp & (blk > k)


@pytest.mark.parametrize("context", ["full", "blocked"])
@pytest.mark.parametrize("seed", range(6))
def test_block_sft_corruption_regions(context, seed):
    b, bs = batch(), 4
    out = block_sft_corrupt(
        b["input_ids"],
        b["prompt_mask"],
        b["maskable"],
        b["valid"],
        bs,
        context,
        MASK,
        noise_generator(seed, 0, 0),
    )
    prompt, earlier, active, later = regions(b, out, bs)
    x, y = b["input_ids"], out.noisy_ids
    assert torch.equal(y[prompt], x[prompt]) and torch.equal(y[earlier], x[earlier])  # clean
    assert bool((y[later] == MASK).all())  # the clean future never enters the model
    assert torch.equal(out.loss_mask, active & (y == MASK))  # loss only on the active block's masks
    assert torch.equal(y[active & ~out.loss_mask], x[active & ~out.loss_mask])
    if context == "blocked":
        assert torch.equal(out.valid, b["valid"] & ~later)  # hidden: a_t = 0
    else:
        assert torch.equal(out.valid, b["valid"])  # visible as masks
    assert torch.equal(out.block_len, active.sum(1))
    assert torch.equal(out.block_start, b["prompt_mask"].sum(1) + out.active_block * bs)


def test_block_sft_is_seeded_and_covers_every_block():
    b = batch()
    args = (b["input_ids"], b["prompt_mask"], b["maskable"], b["valid"], 4, "blocked", MASK)
    one = block_sft_corrupt(*args, noise_generator(3, 0, 5))
    two = block_sft_corrupt(*args, noise_generator(3, 0, 5))
    assert torch.equal(one.noisy_ids, two.noisy_ids) and torch.equal(one.active_block, two.active_block)
    seen = {
        tuple(block_sft_corrupt(*args, noise_generator(3, 0, s)).active_block.tolist()) for s in range(60)
    }
    n = (b["maskable"].sum(1) + 3) // 4  # blocks per row: 4, 4, 3 (row 1 includes EOS pads)
    for row in range(3):
        assert {k[row] for k in seen} == set(range(int(n[row])))


def test_block_sft_rejects_a_split_response():
    b = batch()
    maskable = b["maskable"].clone()
    maskable[0, 7] = False
    with pytest.raises(ValueError, match="rows \\[0\\]"):
        block_sft_corrupt(
            b["input_ids"], b["prompt_mask"], maskable, b["valid"], 4, "full", MASK, noise_generator(0, 0, 0)
        )
    with pytest.raises(ValueError, match="block_context"):
        block_sft_corrupt(
            b["input_ids"],
            b["prompt_mask"],
            b["maskable"],
            b["valid"],
            4,
            "none",
            MASK,
            noise_generator(0, 0, 0),
        )


def test_blocked_sft_loss_positions_do_not_see_later_blocks():
    torch.manual_seed(0)
    model = DiffusionLM(preset("llada-tiny", position_encoding="mdlmpe", init_std=0.2)).eval()
    b = batch()
    for context in ("blocked", "full"):
        out = block_sft_corrupt(
            b["input_ids"],
            b["prompt_mask"],
            b["maskable"],
            b["valid"],
            4,
            context,
            MASK,
            noise_generator(1, 0, 0),
        )
        _, _, _, later = regions(b, out, 4)
        assert later.any()
        perturbed = torch.where(later, b["input_ids"], out.noisy_ids)  # leak the clean future
        with torch.no_grad():
            # Every position the model keeps (the loss positions among them); rows 1-2 have later blocks.
            seen = out.valid & ~later
            base = model(out.noisy_ids, valid=out.valid)[seen]
            leaked = model(perturbed, valid=out.valid)[seen]
        if context == "blocked":
            torch.testing.assert_close(leaked, base, atol=0, rtol=0)
        else:
            assert (leaked - base).abs().max() > 1e-4


def test_sampling_visibility():
    real = torch.tensor([[True] * 8, [True] * 6 + [False] * 2])
    gen_start = torch.tensor([2, 2])
    assert torch.equal(sampling_visibility(real, gen_start, 2, "full"), real)
    blocked = sampling_visibility(real, gen_start, 2, "blocked")
    assert blocked.tolist() == [[True] * 4 + [False] * 4, [True] * 4 + [False] * 4]
    assert num_blocks(12, 4) == 3
    with pytest.raises(ValueError):
        num_blocks(12, 5)
