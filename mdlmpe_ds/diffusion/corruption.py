"""Forward (masking) process of masked diffusion, driven by an explicit generator.

One noise level per sequence: u ~ U(0, 1), t = (1 - eps) * u + eps, i.e. t ~ U(eps, 1), and each
maskable token is masked independently with probability p_mask = t (linear schedule alpha_t = 1 - t).
This is exactly LLaDA's ``forward_process`` (p_mask = (1 - eps) t' + eps with t' ~ U(0, 1),
eps = 1e-3; docs/models.md §3.1) and Dream-train's ``q_sample`` for eps = 0 (docs/models.md §3.5).
Tokens that are not maskable (prompt, and padding when it is not trained) are never masked.

Noise comes from ``noise_generator(seed, rank, step)`` so a resumed run redraws exactly the masks it
would have drawn, and ranks draw different masks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mdlmpe_ds.seeding import generator


def noise_generator(seed: int, rank: int, step: int, device: str | torch.device = "cpu") -> torch.Generator:
    """The generator for the corruption noise of micro-step ``step`` on ``rank``.

    Seeded with ``seeding.mix_seed(seed, rank, step)``: deterministic in (seed, rank, step), distinct streams
    for distinct triples. ``step`` should count micro-batches (not optimizer updates) so gradient
    accumulation steps draw different noise.
    """
    return generator(seed, rank, step, device=device)


class Corruption(NamedTuple):
    """Result of ``corrupt``: ``noisy_ids`` [B, L] long, ``masked`` [B, L] bool (True where the mask
    token was written), ``t`` [B] fp32 noise level, ``p_mask`` [B] fp32 per-token mask probability
    (equal to ``t`` under the linear schedule; kept separate so losses read as in the papers)."""

    noisy_ids: torch.Tensor
    masked: torch.Tensor
    t: torch.Tensor
    p_mask: torch.Tensor


def sample_t(batch_size: int, generator: torch.Generator, eps: float = 1e-3) -> torch.Tensor:
    """t = (1 - eps) u + eps with u ~ U(0, 1): t ~ U(eps, 1), one per sequence. fp32 [B] on the
    generator's device."""
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    u = torch.rand(batch_size, generator=generator, device=generator.device, dtype=torch.float32)
    return (1.0 - eps) * u + eps


def corrupt(
    input_ids: torch.Tensor,
    maskable: torch.Tensor,
    mask_id: int,
    generator: torch.Generator,
    eps: float = 1e-3,
    t: torch.Tensor | None = None,
) -> Corruption:
    """Mask each maskable token independently with probability p_mask = t of its row.

    input_ids, maskable: [B, L]. ``t`` [B] overrides the draw (then used as given, must lie in
    (0, 1]); otherwise ``t = sample_t(B, generator, eps)``. Draws come from ``generator`` (on its own
    device) and are moved to ``input_ids.device``; t first, then one uniform per token, so the masks
    for a given (generator state, B, L) are reproducible.
    """
    if input_ids.shape != maskable.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and maskable {tuple(maskable.shape)} must both be [B, L]"
        )
    B, L = input_ids.shape
    device = input_ids.device
    if t is None:
        t = sample_t(B, generator, eps)
    else:
        if t.shape != (B,):
            raise ValueError(f"t has shape {tuple(t.shape)}, expected ({B},)")
        if bool(((t <= 0) | (t > 1)).any()):
            raise ValueError("t must lie in (0, 1]")
        t = t.to(dtype=torch.float32)
    t = t.to(device)
    u = torch.rand(B, L, generator=generator, device=generator.device, dtype=torch.float32)  # [B, L]
    u = u.to(device)
    masked = (u < t[:, None]) & maskable.to(torch.bool)  # [B, L]
    noisy_ids = torch.where(masked, torch.full_like(input_ids, mask_id), input_ids)
    return Corruption(noisy_ids, masked, t, t.clone())
