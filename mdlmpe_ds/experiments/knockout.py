"""Layout knockout: forward passes of a trained MDLMPE model with its availability *layout* destroyed.

Inside ``layout_knockout(model, mode)`` the model's MDLMPE encoder builds A and D from a
replaced availability ``b'`` instead of the input's ``b``; the token ids, ``valid`` (``a``) and the
positions the model sees are untouched, and so is the returned ``b`` (only A and D, the features
every layer reads, change):

* ``shuffle``: ``b`` permuted within each row over its valid positions (the same count of visible
  tokens, their places random);
* ``constant``: ``b' = a * mean(b)`` over the row's valid positions (the row's visible fraction,
  ``1 - t`` in expectation under the iid and spans layouts, everywhere).

The NLL change under a knockout, on the same windows and masks, measures how much the model uses
where the visible tokens are, beyond how many there are. It has no seed variance (one trained
model, fixed draws). A model without MDLMPE features (RoPE, ALiBi, absolute) is left unchanged, so
its change is exactly 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mdlmpe_ds.pe.availability import gaussian_taps, token_summaries
from mdlmpe_ds.pe.encoder import AvailabilityFeatures, MDLMPEEncoder
from mdlmpe_ds.pe.phase import PhaseMLP

KNOCKOUTS = ("shuffle", "constant")


def knocked_availability(
    b: torch.Tensor, a: torch.Tensor, mode: str, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The replaced availability b' [B, L] fp32 from b, a [B, L] (module doc); ``generator`` (CPU)
    draws the shuffles."""
    if mode == "constant":
        frac = b.sum(-1, keepdim=True) / a.sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1]
        return a * frac
    if mode != "shuffle":
        raise ValueError(f"knockout mode {mode!r}; expected one of {KNOCKOUTS}")
    out = b.clone()
    for row in range(b.shape[0]):
        visible = (a[row] > 0).nonzero().flatten()  # positions a row's b may move between
        perm = torch.randperm(visible.numel(), generator=generator).to(visible.device)
        out[row, visible] = b[row, visible[perm]]
    return out


def summaries_for(
    encoder: MDLMPEEncoder, b: torch.Tensor, a: torch.Tensor, positions: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A, D [B, L, F] of ``encoder`` for availability b and validity a, with the coordinate and taps
    ``encoder.features`` uses (a test checks both agree on the model's own b)."""
    length, device = b.shape[-1], b.device
    if positions is None:
        coordinate = encoder.basis(length, device)  # [L, F]
    else:
        coordinate = encoder.basis(int(positions.max()) + 1, device)[positions.clamp(min=0)]  # [B, L, F]
    taps = gaussian_taps(encoder.config.window, encoder.config.sigma, device)
    return token_summaries(b, a, coordinate, taps, encoder.config.eps)


def mdlmpe_encoder(model: torch.nn.Module) -> MDLMPEEncoder | None:
    """The DiffusionLM's MDLMPE encoder, or None for a model without availability features."""
    embed = getattr(model, "embed", None)
    return getattr(embed, "mdlmpe", None)


@contextmanager
def layout_knockout(model: torch.nn.Module, mode: str, seed: int = 0) -> Iterator[None]:
    """Run ``model``'s forwards inside with A, D built from the knocked-out availability (module
    doc). Shuffles come from one generator seeded with ``seed`` at entry, so the same sequence of
    forwards gets the same shuffles."""
    if mode not in KNOCKOUTS:
        raise ValueError(f"knockout mode {mode!r}; expected one of {KNOCKOUTS}")
    encoder = mdlmpe_encoder(model)
    if encoder is None:
        yield
        return
    original = encoder.features
    generator = torch.Generator().manual_seed(seed)

    def knocked(input_ids, valid=None, positions=None) -> AvailabilityFeatures:
        own = original(input_ids, valid, positions)
        b = knocked_availability(own.b, own.a, mode, generator)
        A, D = summaries_for(encoder, b, own.a, positions)
        return AvailabilityFeatures(own.b, own.a, A, D)

    encoder.features = knocked  # an instance attribute shadows the method while inside
    try:
        yield
    finally:
        del encoder.features


@contextmanager
def mdlmpe_off(model: torch.nn.Module) -> Iterator[None]:
    """Inside: gamma -> 0 and delta -> 0 on the model's trained weights (the embedding gate closed,
    every phase MLP's output layer zeroed), so the model is exactly its RoPE backbone; the weights
    are restored on exit. What the trained model gets from MDLMPE as a whole, where the layout
    knockouts measure what it gets from *where* the visible tokens are."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        encoder = mdlmpe_encoder(model)
        if encoder is not None and encoder.gate_logit is not None:
            saved.append((encoder.gate_logit, encoder.gate_logit.clone()))
            encoder.gate_logit.fill_(float("-inf"))  # gamma = gamma_max * sigmoid(-inf) = 0
        for module in model.modules():
            if isinstance(module, PhaseMLP):
                for p in (module.fc2.weight, module.fc2.bias):
                    saved.append((p, p.clone()))
                    p.zero_()  # delta = tau_max * tanh(0) = 0
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in saved:
                p.copy_(value)


def shuffle_context(
    ids: torch.Tensor, valid: torch.Tensor, mask_id: int, generator: torch.Generator
) -> torch.Tensor:
    """The context knockout: each row's visible tokens permuted among the visible positions; the
    mask layout, padding and positions unchanged. A model that uses its context loses it; a model
    at its unigram plateau does not notice. ids, valid [B, L] -> [B, L]."""
    out = ids.clone()
    visible = (ids != mask_id) & valid.bool()
    for row in range(ids.shape[0]):
        where = visible[row].nonzero().flatten()
        perm = torch.randperm(where.numel(), generator=generator).to(where.device)
        out[row, where] = ids[row, where[perm]]
    return out


@contextmanager
def knockout(model: torch.nn.Module, mode: str, seed: int = 0) -> Iterator[None]:
    """One model-side knockout around a block of forwards: a layout knockout (``shuffle``,
    ``constant``; see :func:`layout_knockout`) or ``off`` (:func:`mdlmpe_off`)."""
    if mode == "off":
        with mdlmpe_off(model):
            yield
    else:
        with layout_knockout(model, mode, seed=seed):
            yield
