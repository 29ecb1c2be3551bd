"""The one place seeds are derived: every random stream of a run is keyed by integers through here.

``mix_seed(*parts)`` hashes a tuple of non-negative integers (blake2b, 8-byte digest) into a 63-bit
seed for ``torch.Generator.manual_seed``. Streams are told apart by their key alone: the training
noise by (seed, rank, micro-step), the sampler by (stream tag, seed, epoch), the pretraining
corruption by (seed, data index, sample) -- so a resumed run or another model compared redraws
exactly the same numbers, whatever the batch, the rank layout or the machine.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence

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


#: Initial-weight streams of the modules one position encoding has and another has not (the
#: MDLMPE encoder's W_p, each layer's phase MLP, the absolute position table, the one phase MLP of
#: phase_mlp="shared", the run-length study's gap oracle): their own streams, so the backbone's
#: draws are the same for every encoding of one seed.
INIT_STREAMS = {
    "mdlmpe_encoder": 1,
    "phase_mlp": 2,
    "absolute_positions": 3,
    "shared_phase_mlp": 4,
    "gap_oracle": 10,
}


@contextlib.contextmanager
def init_stream(tag: str, *index: int) -> Iterator[None]:
    """Inside: torch's global generator (and the current CUDA device's, when CUDA is in use) draws
    from a stream of its own, seeded by (the global seed, ``INIT_STREAMS[tag]``, ``index``); on exit
    the global streams continue exactly where they were, as if nothing had been drawn.

    A model of one seed then starts from bit-identical backbone weights whatever position modules
    it builds between the backbone's layers (a matched comparison changes only the position module,
    docs/method.md "Initialisation"), and each optional module's initial values depend on the seed
    and its own key only (layer i's phase MLP: index i)."""
    seed = mix_seed(torch.initial_seed(), INIT_STREAMS[tag], *index)
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        yield
