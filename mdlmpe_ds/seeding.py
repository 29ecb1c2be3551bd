"""The one place seeds are derived: every random stream of a run is keyed by integers through here.

``mix_seed(*parts)`` hashes a tuple of non-negative integers (blake2b, 8-byte digest) into a 63-bit
seed for ``torch.Generator.manual_seed``. Streams are told apart by their key alone: the training
noise by (seed, rank, micro-step), the sampler by (stream tag, seed, epoch), the pretraining
corruption by (seed, data index, sample) -- so a resumed run or another model compared redraws
exactly the same numbers, whatever the batch, the rank layout or the machine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers: blake2b of their decimal forms joined by ``:``.

    Order matters ((1, 2) != (2, 1)), nearby inputs give unrelated seeds, integers of any size are
    accepted and the result fits ``torch.Generator.manual_seed``. Negative parts are rejected.
    """
    values = [int(p) for p in parts]
    if any(v < 0 for v in values):
        raise ValueError(f"seed parts must be non-negative, got {parts}")
    digest = hashlib.blake2b(":".join(map(str, values)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded by ``mix_seed(*parts)``."""
    g = torch.Generator(device=device)
    g.manual_seed(mix_seed(*parts))
    return g


def corruption_draws(
    seed: int, data_indices: Sequence[int] | torch.Tensor, length: int, sample: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform draws for the forward process of each sequence: ``t`` [B] and ``u`` [B, length].

    A sequence's draws depend only on ``(seed, its data index, sample)``: a token is masked at noise
    level ``p`` iff ``u < p`` (with ``p`` a function of ``t``), identical for every model compared and
    independent of batch composition. Both are float64 on the CPU.
    """
    idx = data_indices.tolist() if isinstance(data_indices, torch.Tensor) else list(data_indices)
    t = torch.empty(len(idx), dtype=torch.float64)
    u = torch.empty(len(idx), length, dtype=torch.float64)
    for row, i in enumerate(idx):
        g = generator(seed, int(i), sample)
        t[row] = torch.rand((), generator=g, dtype=torch.float64)
        u[row] = torch.rand(length, generator=g, dtype=torch.float64)
    return t, u
