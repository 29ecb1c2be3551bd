"""Block diffusion: which response positions the model sees, for sampling and for SFT (paper §3.4).

A response of length R is cut into blocks of ``block_size`` tokens, denoised one after the other
(semi-autoregressive). Two regimes (paper Figure 6, docs/method.md "Block diffusion"):

- ``full`` (LLaDA-style): the whole partially denoised response is visible; blocks after the active
  one are present as mask tokens (a_t = 1, b_t = 0).
- ``blocked``: attention and availability see only the prompt and the blocks up to the active one;
  later positions are invalid (``valid = False``, so a_t = 0, b_t = 0, and no query attends to them).

No block ID enters the model: the regime is expressed only through the ids and ``valid`` the model
is given, and MDLMPE recomputes b (and a) from that state (paper §3.4).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mdlmpe_ds.diffusion.corruption import corrupt

BLOCK_CONTEXTS = ("full", "blocked")


def check_block_context(block_context: str) -> str:
    if block_context not in BLOCK_CONTEXTS:
        raise ValueError(f"block_context={block_context!r} must be one of {BLOCK_CONTEXTS}")
    return block_context


def num_blocks(gen_length: int, block_length: int) -> int:
    """Blocks in a generation of ``gen_length`` tokens; ``block_length`` must divide it (as LLaDA)."""
    if gen_length < 1 or block_length < 1:
        raise ValueError(f"gen_length={gen_length} and block_length={block_length} must be >= 1")
    if gen_length % block_length:
        raise ValueError(f"block_length={block_length} must divide gen_length={gen_length}")
    return gen_length // block_length


def sampling_visibility(
    real: torch.Tensor, gen_start: torch.Tensor, block_end: int, block_context: str
) -> torch.Tensor:
    """``valid`` for a sampling step whose active block ends at response offset ``block_end``.

    real [B, L] bool (prompt + response canvas, False on batch padding); gen_start [B] long (the
    response's first position per row). ``full``: ``real``. ``blocked``: also False on response
    positions at offset >= block_end. -> [B, L] bool.
    """
    check_block_context(block_context)
    if block_context == "full":
        return real
    pos = torch.arange(real.shape[1], device=real.device)[None, :]  # [1, L]
    return real & (pos < (gen_start[:, None] + block_end))  # [B, L]


class BlockCorruption(NamedTuple):
    """Result of ``block_sft_corrupt`` (all [B, L] unless noted).

    ``noisy_ids``: prompt and earlier response blocks clean, the active block corrupted, later
    blocks set to the mask token; ``valid``: the input validity, with later blocks False in
    ``blocked`` mode; ``loss_mask``: the masked positions of the active block (the only loss
    positions); ``t``, ``p_mask`` [B]: the active block's noise level; ``active_block`` [B] long;
    ``block_start`` [B] long: the active block's first position; ``block_len`` [B] long: its length
    (the last block may be short), the natural LLaDA ``answer_len`` normaliser for this objective.
    """

    noisy_ids: torch.Tensor
    valid: torch.Tensor
    loss_mask: torch.Tensor
    t: torch.Tensor
    p_mask: torch.Tensor
    active_block: torch.Tensor
    block_start: torch.Tensor
    block_len: torch.Tensor


def block_sft_corrupt(
    input_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    maskable: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    block_context: str,
    mask_id: int,
    generator: torch.Generator,
    eps: float = 1e-3,
) -> BlockCorruption:
    """Block-diffusion SFT corruption: one active block per example (paper §3.4, §4.4).

    Inputs are ``SFTCollator``'s tensors ([B, L]): the response (``maskable``) must be one contiguous
    run starting right after the prompt (left padding may precede the prompt). Per row: the response
    is cut into blocks of ``block_size`` from its first token, an active block k ~ U{0..n-1} is
    drawn, earlier blocks stay clean, the active block is corrupted by ``corruption.corrupt``
    (t ~ U(eps, 1)), and later blocks are replaced by the mask token (the clean future is never fed
    to the model) and, for ``blocked``, made invalid. The loss covers only the active block's masked tokens.

    Draws from ``generator``: the active block per row ([B] uniforms) first, then ``corrupt``'s.
    """
    check_block_context(block_context)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    shapes = {tuple(x.shape) for x in (input_ids, prompt_mask, maskable, valid)}
    if len(shapes) != 1 or input_ids.dim() != 2:
        raise ValueError(
            "input_ids, prompt_mask, maskable and valid must all be [B, L]; got "
            f"{[tuple(x.shape) for x in (input_ids, prompt_mask, maskable, valid)]}"
        )
    B, L = input_ids.shape
    device = input_ids.device
    maskable, prompt_mask, valid = maskable.bool(), prompt_mask.bool(), valid.bool()
    # 1. Response layout per row: [S, S + R), S the position after the prompt (after any left pads).
    pos = torch.arange(L, device=device)[None, :]  # [1, L]
    start = torch.where(prompt_mask, pos + 1, 0).amax(1)  # [B]
    length = maskable.sum(1)  # [B]
    rel = pos - start[:, None]  # [B, L] offset inside the response
    expected = (rel >= 0) & (rel < length[:, None])  # [B, L]
    if not torch.equal(expected, maskable):
        bad = (expected != maskable).any(1).nonzero().flatten().tolist()
        raise ValueError(f"rows {bad}: the maskable response must be one run right after the prompt")
    if bool((length == 0).any()):
        raise ValueError(f"rows {(length == 0).nonzero().flatten().tolist()} have no response tokens")
    # 2. Active block per row, k ~ U{0 .. n-1}.
    n_blocks = (length + block_size - 1) // block_size  # [B]
    u = torch.rand(B, generator=generator, device=generator.device, dtype=torch.float64).to(device)
    active = torch.minimum((u * n_blocks).long(), n_blocks - 1)  # [B]
    block_of = torch.div(rel, block_size, rounding_mode="floor")  # [B, L]
    in_active = maskable & (block_of == active[:, None])  # [B, L]
    later = maskable & (block_of > active[:, None])  # [B, L]
    # 3. Corrupt the active block only; hide or mask the later blocks.
    c = corrupt(input_ids, in_active, mask_id, generator, eps=eps)
    noisy = c.noisy_ids.masked_fill(later, mask_id)  # [B, L]
    out_valid = valid & ~later if block_context == "blocked" else valid.clone()
    block_start = start + active * block_size  # [B]
    block_len = in_active.sum(1)  # [B]
    return BlockCorruption(noisy, out_valid, c.masked, c.t, c.p_mask, active, block_start, block_len)
