"""From-scratch pretraining as a task (paper §4.3, Appendix B): packed windows, index-keyed
corruption, the family's pretraining loss, and the validation perplexity.

- data: fixed ``data.max_len`` windows of a packed token stream, no padding, every token maskable;
- corruption: LLaDA's forward process, ``t ~ U[0, 1)``, ``p = (1 - eps) t + eps``, token i masked
  iff ``u_i < p``, where ``(t, u)`` depend only on ``(train.seed, window index, epoch)``
  (``seeding.corruption_draws``): the model, the position encoding, the rank and the batch a window
  lands in play no part, so every encoding compared sees exactly the same masks;
- loss: LLaDA's ``sum_masked CE / p`` over B L; Dream's 1/t-weighted mean over the masked tokens,
  position 0 excluded (Dream's shifted logits cannot predict it);
- validation: the diffusion-ELBO perplexity of the validation windows, logged as ``val/ppl`` every
  ``train.eval_every`` updates and at the end, with fixed draws.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from mdlmpe_ds import stop_request
from mdlmpe_ds.config.run import TrainConfig
from mdlmpe_ds.diffusion.elbo import diffusion_elbo, scored_positions
from mdlmpe_ds.diffusion.layouts import corrupt_layout
from mdlmpe_ds.diffusion.losses import dream_sft_loss, llada_pretrain_loss
from mdlmpe_ds.distributed import collectives
from mdlmpe_ds.tasks import Micro, engine_device
from mdlmpe_ds.training.head_chunks import configured_chunk, group_chunk_count


def pretrain_corruption(
    batch: dict, seed: int, eps: float, mask_id: int, family: str, layout: str = "iid"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward process on a packed batch: (noisy ids [B, L], scored [B, L] bool, p [B] fp32).

    ``batch`` holds ``input_ids`` [B, L], ``valid`` [B, L], ``index`` [B] (window indices) and
    ``epoch``. Window i in epoch e is masked by the draws of (seed, i, sample=e) alone: the same
    masks for every model compared, a fresh draw every epoch. ``layout`` (``train.corruption``,
    ``diffusion/layouts.py``): ``iid`` is LLaDA's process; ``semi_ar`` / ``spans`` / ``mix`` mask
    structured layouts. LLaDA's loss divides by B L, so its ``p`` is scaled by the row's scope
    fraction (1 for iid, bit for bit): every row then weighs as a per-token estimate of its scope
    (so ``train/nll_by_t`` bins a semi_ar row by that scaled p; per-layout NLLs at the true t come
    from ``launch/evaluate.py --corruption``). CPU tensors.
    """
    ids = batch["input_ids"]
    scorable = scored_positions(batch["valid"], family)
    draw = corrupt_layout(layout, seed, batch["index"], scorable, int(batch["epoch"]), eps=eps)
    noisy = torch.where(draw.masked, torch.full_like(ids, mask_id), ids)
    p = draw.p  # [B] float64
    if family == "llada":
        p = p * (draw.scope.sum(1).double() / scorable.sum(1).clamp(min=1).double())
    return noisy, draw.scored, p.float()


class _EvaluationStopped(Exception):
    """A stop request reached the validation loop (every rank raises it at the same forward)."""


class PretrainTask:
    """Packed windows through the sampler, tagged with their epoch; validation on fixed windows."""

    def __init__(
        self,
        train: TrainConfig,
        model_config,
        dataset=None,
        sampler=None,
        collator=None,
        validation: list[dict] | None = None,
    ) -> None:
        self.train, self.model_config = train, model_config
        self.dataset, self.sampler, self.collator = dataset, sampler, collator
        self.validation = validation
        self.last_validation: dict[str, float] | None = None
        self.loss_family = model_config.family if train.loss == "auto" else train.loss
        self.evaluation_stopped = False

    def batches(self) -> Iterator[dict]:
        """Packed micro-batches forever, each tagged with the epoch it belongs to (the corruption
        draw's ``sample``, so a window is masked differently in every epoch)."""
        while True:
            for indices in self.sampler:
                batch = self.collator([self.dataset[i] for i in indices])
                batch["epoch"] = self.sampler.epoch
                yield batch

    def corrupt(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The corruption draw of a packed batch (keyed by its windows, not by rank or step)."""
        t, cfg = self.train, self.model_config
        # Dream's loss never scores position 0 (its shifted logits cannot predict it), so no family
        # may mask it when that loss is chosen, whatever the model's own family.
        family = "dream" if "dream" in (self.loss_family, cfg.family) else "llada"
        return pretrain_corruption(batch, t.seed, t.noise_eps, cfg.mask_token_id, family, t.corruption)

    def micro(self, engine, batch: dict, micro_step: int, rank: int) -> Micro:
        device = engine_device(engine)
        noisy, masked, p = self.corrupt(batch)
        ids, valid = batch["input_ids"].to(device), batch["valid"].to(device)
        masked, p = masked.to(device), p.to(device)
        chunk = configured_chunk()  # rows per head chunk: the run's setting, read here, not in the model
        scored = engine(
            noisy.to(device),
            valid=valid,
            scored=masked,
            targets=ids,
            head_chunk=chunk,
            head_chunks=group_chunk_count(masked, chunk),
        )  # ScoredCE [M]: the head in chunks, as many on every rank
        if self.loss_family == "llada":
            loss, stats = llada_pretrain_loss(scored, ids, masked, p)
        else:
            loss, stats = dream_sft_loss(
                scored, ids, masked, p, scored_positions(valid, "dream"),
                weighting=self.train.dream_weighting, cart_p=self.train.cart_p, valid=valid,
            )  # fmt: skip
        return Micro(loss, stats, int(valid.sum()), int(ids.shape[0]))

    def validate(self, engine) -> dict[str, float]:
        """Diffusion-ELBO perplexity of the validation windows. Every rank scores the same windows
        (ZeRO-3 forwards are collective), so no gathering is needed and all ranks agree."""
        t = self.train
        device = engine_device(engine)

        def forward(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
            # A stop request (SIGTERM during a long validation) is polled before every forward,
            # agreed over the ranks (each scores the same windows, so the calls line up).
            if collectives.all_reduce_max([1.0 if stop_request.stop_reason() else 0.0])[0] > 0:
                raise _EvaluationStopped
            return engine(ids.to(device), valid=valid.to(device))

        engine.eval()
        try:
            result = diffusion_elbo(
                forward,
                self.validation,
                self.model_config.mask_token_id,
                t.eval_samples,
                t.seed,
                eps=t.noise_eps,
            )
        finally:
            engine.train()
        out = {
            "val/nll": result.nll_per_token,
            "val/ppl": result.perplexity,
            "val/nll_stderr": result.stderr,
            "val/tokens": float(result.num_tokens),
        }
        self.last_validation = out
        return out

    def periodic_metrics(
        self, engine, step: int, total_updates: int, say: Callable[[str], None]
    ) -> dict[str, float]:
        every = self.train.eval_every
        if not self.validation or not (step == total_updates or (every and step % every == 0)):
            return {}
        try:
            out = self.validate(engine)
        except _EvaluationStopped:
            self.evaluation_stopped = True
            say(f"update {step}: validation abandoned ({stop_request.stop_reason() or 'a rank was stopped'})")
            return {}
        say(
            f"update {step}: validation ELBO perplexity {out['val/ppl']:.2f} "
            f"(nll {out['val/nll']:.4f} ± {out['val/nll_stderr']:.4f} nats/token, "
            f"{int(out['val/tokens'])} tokens)"
        )
        return out
