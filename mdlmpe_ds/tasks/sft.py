"""Supervised fine-tuning as a task: chat batches, response-token corruption, the family's loss.

Corruption (the draw) is keyed by (train.seed, rank, micro-step), so a resumed run redraws exactly
the masks it would have drawn. With ``train.block_size`` one block of each response is active
(block diffusion); otherwise every response token may be masked at the row's noise level.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from mdlmpe_ds.config.run import TrainConfig
from mdlmpe_ds.diffusion.blocks import block_sft_corrupt
from mdlmpe_ds.diffusion.corruption import corrupt, noise_generator
from mdlmpe_ds.diffusion.losses import dream_sft_loss, llada_sft_loss
from mdlmpe_ds.distributed import process_group
from mdlmpe_ds.tasks import Micro, engine_device
from mdlmpe_ds.training.head_chunks import configured_chunk, group_chunk_count

log = logging.getLogger(__name__)


class Corrupted(NamedTuple):
    """The draw of one micro-batch: ``ids`` [B, L] to feed, ``valid`` [B, L] attended positions,
    ``masked`` [B, L] loss positions, ``answer_len`` [B] the loss normaliser (response or block
    length), ``p_mask`` [B] and ``t`` [B] the row's mask probability and noise level."""

    ids: torch.Tensor
    valid: torch.Tensor
    masked: torch.Tensor
    answer_len: torch.Tensor
    p_mask: torch.Tensor
    t: torch.Tensor


def dream_keys_unread(train: TrainConfig, loss_family: str) -> str | None:
    """The note for Dream-loss settings given to a run that trains LLaDA's loss, which reads none
    of them (a LLaDA model with --dream_weighting trained exactly as without it, without a word)."""
    defaults = TrainConfig()
    given = [
        f"--{key} {getattr(train, key)}"
        for key in ("dream_weighting", "cart_p")
        if getattr(train, key) != getattr(defaults, key)
    ]
    if loss_family != "llada" or not given:
        return None
    return (
        f"{' and '.join(given)} set the Dream loss, but this run trains LLaDA's loss (the model's "
        "family; --loss dream trains Dream's), which reads neither: they change nothing"
    )


class SFTTask:
    """Chat examples through the length-grouped sampler and the SFT collator."""

    def __init__(self, train: TrainConfig, model_config, dataset=None, sampler=None, collator=None) -> None:
        self.train, self.model_config = train, model_config
        self.dataset, self.sampler, self.collator = dataset, sampler, collator
        self.loss_family = model_config.family if train.loss == "auto" else train.loss
        self.evaluation_stopped = False  # SFT runs no evaluation
        unread = dream_keys_unread(train, self.loss_family)
        if unread and process_group.rank() == 0:
            log.warning(unread)

    def batches(self) -> Iterator[dict]:
        """Per-rank micro-batches forever. The collator's per-batch cutoff draw is keyed by (epoch,
        sample indices), so a resumed run redraws it exactly."""
        while True:
            for indices in self.sampler:
                key = (self.sampler.epoch, *indices)
                yield self.collator([self.dataset[i] for i in indices], draw_key=key)

    def corrupt(self, batch: dict, micro_step: int, rank: int) -> Corrupted:
        """The corruption draw of micro-batch ``micro_step`` on ``rank`` (tensors on the batch's device)."""
        t = self.train
        gen = noise_generator(t.seed, rank, micro_step)
        mask_id = self.model_config.mask_token_id
        if t.block_size is None:
            noisy = corrupt(batch["input_ids"], batch["maskable"], mask_id, gen, eps=t.noise_eps)
            return Corrupted(
                noisy.noisy_ids, batch["valid"], noisy.masked, batch["answer_len"], noisy.p_mask, noisy.t
            )
        # One active block per example; the loss covers its masked tokens, normalised by its length.
        noisy = block_sft_corrupt(
            batch["input_ids"], batch["prompt_mask"], batch["maskable"], batch["valid"],
            t.block_size, t.block_context, mask_id, gen, eps=t.noise_eps,
        )  # fmt: skip
        return Corrupted(
            noisy.noisy_ids, noisy.valid, noisy.loss_mask, noisy.block_len, noisy.p_mask, noisy.t
        )

    def micro(self, engine, batch: dict, micro_step: int, rank: int) -> Micro:
        t = self.train
        device = engine_device(engine)
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        c = self.corrupt(batch, micro_step, rank)
        # fp32 CE at the masked positions only, the LM head run in chunks (as many on every rank):
        # no [B, L, V] logits; rows per chunk: the run's setting (head_chunks.py), not the model's
        chunk = configured_chunk()
        scored = engine(
            c.ids, valid=c.valid, positions=batch.get("positions"), scored=c.masked,
            targets=batch["input_ids"], head_chunk=chunk, head_chunks=group_chunk_count(c.masked, chunk),
        )  # fmt: skip
        # scored: ScoredCE, ce [M]
        if self.loss_family == "llada":
            loss, stats = llada_sft_loss(scored, batch["input_ids"], c.masked, c.p_mask, c.answer_len)
        else:
            # CART's context is what the model sees revealed: not a later block's mask tokens either.
            hidden = c.ids == self.model_config.mask_token_id
            loss, stats = dream_sft_loss(
                scored, batch["input_ids"], c.masked, c.t, batch["maskable"] & c.valid,
                weighting=t.dream_weighting, cart_p=t.cart_p, valid=c.valid, hidden=hidden,
            )  # fmt: skip
        return Micro(loss, stats, int(batch["valid"].sum()), int(batch["input_ids"].shape[0]))

    def periodic_metrics(
        self, engine, step: int, total_updates: int, say: Callable[[str], None]
    ) -> dict[str, float]:
        return {}

    def probe_batch(self) -> dict[str, Any]:
        """The first two examples as one batch (a fixed draw key): the export-parity probe's input."""
        indices = list(range(min(2, len(self.dataset))))
        return self.collator([self.dataset[i] for i in indices], draw_key=(0, *indices))
