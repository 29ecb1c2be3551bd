"""From-scratch pretraining of a masked diffusion LM on packed text (paper §4.3, Appendix B).

Same engine, checkpoints, resume and TensorBoard as SFT (``trainer.py``); what differs:

- data: a text corpus (``data/corpora.py``) tokenised and packed into fixed ``data.max_len``
  windows (``PackedTokenDataset``), no padding, every token maskable;
- corruption: LLaDA's forward process, ``t ~ U[0, 1)``, ``p = (1 - eps) t + eps``, token i masked
  iff ``u_i < p``, where ``(t, u)`` depend only on ``(train.seed, window index, epoch)``
  (``data.pretrain.corruption_draws``). The model, the position encoding, the rank and the batch a
  window lands in play no part, so every encoding compared sees exactly the same masks;
- loss: the family's (LLaDA: ``sum_masked CE / p`` over B L; Dream: its 1/t-weighted mean over the
  masked tokens, position 0 excluded because Dream's shifted logits cannot predict it);
- all MDLMPE heads active from the first update (no SFT head warmup, paper Appendix B);
- validation: the diffusion-ELBO perplexity of ``data.validation`` logged as ``val/ppl`` every
  ``train.eval_every`` updates and at the end, with fixed draws.

Tokenizer: ``data.tokenizer`` if given, else the model directory's, else a SentencePiece BPE of
``data.tokenizer_vocab`` pieces trained on the corpus and cached by (files' content, vocab).
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import torch

from mdlmpe_ds import engine as eng
from mdlmpe_ds import recipes
from mdlmpe_ds.config import RunConfig
from mdlmpe_ds.data.fingerprint import packed_fingerprint
from mdlmpe_ds.diffusion.elbo import scored_positions
from mdlmpe_ds.trainer import (
    SFTTrainer,
    _log,
    assert_same_on_all_ranks,
    build_engine,
    check_resume_data,
    model_config_for,
    prepare_resume,
    rank_zero_first,
    total_updates_for,
)

# Defaults of launch/pretrain.py: the embedded CPU demo (tiny LLaDA-family model on Shakespeare).
PRETRAIN_DEFAULTS: dict[str, Any] = {
    "model.preset": "llada-tiny",
    "data.dataset": "shakespeare",
    "data.validation": "shakespeare-heldout",
    "data.max_len": 128,
    "data.tokenizer_vocab": 2048,
    "optim.lr": 3e-3,
    "optim.betas": (0.9, 0.999),
    "optim.warmup_ratio": 0.05,
    "train.micro_batch_size": 4,
    "train.max_steps": 60,
    "train.save_every": 30,
    "train.eval_every": 30,
    "train.head_schedule": False,
    "train.output_dir": "outputs/pretrain-demo",
}

# Paper Appendix B.3 (AdamW lr 1e-4, betas 0.9/0.999, weight decay 0.01, cosine, 2K warmup steps,
# effective batch 16, L = 1024, 200K steps, MDLMPE on every head from the start): the llada-100m and
# dream-100m recipes of mdlmpe_ds/recipes.py, which a --preset of that name applies as --recipe does.
PAPER_RECIPE: dict[str, Any] = {k: v for k, (v, _) in recipes._PRETRAIN_100M.items()}
RECIPE_PRESETS = tuple(name for name, r in recipes.RECIPES.items() if r.launcher == "pretrain")
PAPER_GLOBAL_BATCH = 16


def pretrain_recipe(preset: str | None, recipe: str | None) -> str | None:
    """The recipe a pretraining run applies: ``--recipe``, else a ``--preset`` that has one."""
    if recipe is not None:
        recipes.get(recipe, "pretrain")
        return recipe
    return preset if preset in RECIPE_PRESETS else None


def pretrain_defaults(preset: str | None, world: int, recipe: str | None = None) -> dict[str, Any]:
    """Launcher defaults: the recipe's values (``--recipe``, or a ``--preset`` with a recipe) over the
    CPU demo's. Config files and flags override them.

    The recipe's global batch of 16 is micro-batch 4 x gradient accumulation on 1, 2 or 4 ranks; on
    8 or 16 ranks micro-batches of 2 or 1 (the shipped ds configs say "auto"; one that sets the
    batch explicitly must agree)."""
    defaults = dict(PRETRAIN_DEFAULTS)
    name = pretrain_recipe(preset, recipe)
    if name is not None:
        chosen = recipes.get(name, "pretrain")
        defaults.update(chosen.defaults())
        defaults.update(recipes.batch_split(chosen, world))
    if preset is not None:
        defaults["model.preset"] = preset
    return defaults


# ------------------------------------------------------------------------------------ tokenizer
def _files_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def sentencepiece_for_corpus(spec: str, vocab: int, cache_root: Path | None = None) -> Path:
    """A SentencePiece BPE tokenizer directory trained on corpus ``spec``, cached by content + size.

    Trained into a temporary directory and renamed into place, so an interrupted run never leaves a
    half-written tokenizer behind. Nodes sharing the cache may train it at the same time (each
    node's first rank builds): the first rename wins and the others keep that copy.
    """
    from mdlmpe_ds.data.assets import default_cache_dir
    from mdlmpe_ds.data.corpora import corpus_text_files
    from mdlmpe_ds.data.tokenizers import train_sentencepiece

    files = corpus_text_files(spec)
    root = (cache_root or default_cache_dir()) / "tokenizers"
    out = root / f"spm-bpe-{vocab}-{_files_digest(files)}"
    if (out / "tokenizer.json").is_file():
        return out
    tmp = root / f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    train_sentencepiece(files, vocab, tmp)
    if out.exists() and not (out / "tokenizer.json").is_file():
        shutil.rmtree(out, ignore_errors=True)  # an incomplete leftover, never a finished copy
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "tokenizer.json").is_file():
            raise
    return out


def resolve_tokenizer_dir(run: RunConfig) -> Path:
    if run.data.tokenizer is not None:
        return Path(run.data.tokenizer)
    if run.model.model_name_or_path is not None:
        return Path(run.model.model_name_or_path)
    return sentencepiece_for_corpus(run.data.dataset, run.data.tokenizer_vocab)


# ------------------------------------------------------------------------------------ trainer
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
    from mdlmpe_ds.diffusion.layouts import corrupt_layout

    ids = batch["input_ids"]
    scorable = scored_positions(batch["valid"], family)
    draw = corrupt_layout(layout, seed, batch["index"], scorable, int(batch["epoch"]), eps=eps)
    noisy = torch.where(draw.masked, torch.full_like(ids, mask_id), ids)
    p = draw.p  # [B] float64
    if family == "llada":
        p = p * (draw.scope.sum(1).double() / scorable.sum(1).clamp(min=1).double())
    return noisy, draw.scored, p.float()


class PretrainTrainer(SFTTrainer):
    """The SFT loop with packed batches, index-keyed corruption, the pretraining loss and validation."""

    def __init__(self, *args, validation: list[dict] | None = None, **kwargs) -> None:
        from mdlmpe_ds.diffusion.elbo import diffusion_elbo
        from mdlmpe_ds.diffusion.losses import llada_pretrain_loss

        self._elbo, self._pretrain_loss = diffusion_elbo, llada_pretrain_loss
        self.validation = validation
        self.last_validation: dict[str, float] | None = None
        super().__init__(*args, **kwargs)

    def _batches(self):
        """Packed micro-batches forever, each tagged with the epoch it belongs to (the epoch is the
        corruption draw's ``sample``, so a window is masked differently in every epoch)."""
        while True:
            for indices in self.sampler:
                batch = self.collator([self.dataset[i] for i in indices])
                batch["epoch"] = self.sampler.epoch
                yield batch

    def corruption(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self.run.train
        return pretrain_corruption(
            batch, t.seed, t.noise_eps, self.model_config.mask_token_id, self.model_config.family,
            t.corruption,
        )  # fmt: skip

    def _micro(self, batch: dict, nan: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        noisy, masked, p = self.corruption(batch)
        ids, valid = batch["input_ids"].to(self.device), batch["valid"].to(self.device)
        masked, p = masked.to(self.device), p.to(self.device)
        from mdlmpe_ds.models.scored_head import group_chunk_count

        logits = self.engine(
            noisy.to(self.device),
            valid=valid,
            scored=masked,
            targets=ids,
            head_chunks=group_chunk_count(masked),
        )  # ScoredCE [M]: the head in chunks, as many on every rank
        if self.loss_family == "llada":
            loss, stats = self._pretrain_loss(logits, ids, masked, p)
        else:
            loss, stats = self._dream_loss(
                logits, ids, masked, p, scored_positions(valid, "dream"),
                weighting=self.run.train.dream_weighting, cart_p=self.run.train.cart_p, valid=valid,
            )  # fmt: skip
        if nan:
            loss = loss * float("nan")
        return loss, {"stats": stats, "tokens": int(valid.sum()), "samples": int(ids.shape[0])}

    def validate(self) -> dict[str, float]:
        """Diffusion-ELBO perplexity of the validation windows. Every rank scores the same windows
        (ZeRO-3 forwards are collective), so no gathering is needed and all ranks agree."""
        t = self.run.train
        self.engine.eval()
        try:
            result = self._elbo(
                lambda ids, valid: self.engine(ids.to(self.device), valid=valid.to(self.device)),
                self.validation,
                self.model_config.mask_token_id,
                t.eval_samples,
                t.seed,
                eps=t.noise_eps,
            )
        finally:
            self.engine.train()
        out = {
            "val/nll": result.nll_per_token,
            "val/ppl": result.perplexity,
            "val/nll_stderr": result.stderr,
            "val/tokens": float(result.num_tokens),
        }
        self.last_validation = out
        return out

    def periodic_metrics(self, step: int) -> dict[str, float]:
        every = self.run.train.eval_every
        if not self.validation or not (step == self.total_updates or (every and step % every == 0)):
            return {}
        out = self.validate()
        self.tracker.print(
            f"update {step}: validation ELBO perplexity {out['val/ppl']:.2f} "
            f"(nll {out['val/nll']:.4f} ± {out['val/nll_stderr']:.4f} nats/token, "
            f"{int(out['val/tokens'])} tokens)"
        )
        return out


# ------------------------------------------------------------------------------------ building a run
def store_dir(run: RunConfig) -> Path:
    """Where the token stores of this run's corpora live (data.store_dir, else the run's folder)."""
    return Path(run.data.store_dir) if run.data.store_dir else Path(run.train.output_dir) / "data_cache"


def validation_batches(run: RunConfig, tokenizer, family: str) -> list[dict] | None:
    """The first ``train.eval_sequences`` windows of ``data.validation``, in micro-batches, each
    with the positions a ``family`` model is scored on (``maskable``)."""
    from mdlmpe_ds.data.corpora import load_packed_corpus
    from mdlmpe_ds.data.pretrain import packed_collate

    d, t = run.data, run.train
    if d.validation is None:
        return None
    packed = load_packed_corpus(
        d.validation, tokenizer, d.max_len, split=d.text_split, text_column=d.text_column,
        cache_dir=store_dir(run), role="eval", workers=d.build_workers,
    )  # fmt: skip
    if len(packed) == 0:
        raise ValueError(f"validation corpus {d.validation!r} is shorter than one {d.max_len}-token window")
    n = min(t.eval_sequences, len(packed))
    items = [packed[i] for i in range(n)]
    batches = [packed_collate(items[i : i + t.micro_batch_size]) for i in range(0, n, t.micro_batch_size)]
    for batch in batches:
        batch["maskable"] = scored_positions(batch["valid"], family)
    return batches


def run_pretrain(
    run: RunConfig, ds_config_path: str, resume: str | None = None, dry_run: bool = False
) -> dict:
    """Build the packed data, the model under ZeRO-3 and the engine; pretrain. Call inside
    `engine.distributed_session` (except dry runs)."""
    from transformers import AutoTokenizer

    from mdlmpe_ds.data.corpora import load_packed_corpus
    from mdlmpe_ds.data.pretrain import packed_collate
    from mdlmpe_ds.data.sampler import LengthGroupedSampler
    from mdlmpe_ds.hub.resolve import resolve_run_names

    world, rank = eng.world_size(), eng.rank()
    resolve_run_names(run)  # hub ids -> local snapshots (rank 0 downloads first)
    d, t = run.data, run.train
    tok_dir = rank_zero_first(lambda: resolve_tokenizer_dir(run))
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    model_config = model_config_for(run, tokenizer)
    ds_config = eng.prepare_ds_config(ds_config_path, run, world)
    resume_from = prepare_resume(resume, run, model_config, ds_config, dry_run)

    def pack():
        return load_packed_corpus(
            d.dataset, tokenizer, d.max_len, split=d.text_split, text_column=d.text_column,
            max_documents=d.max_documents, cache_dir=store_dir(run), role="train",
            workers=d.build_workers,
        )  # fmt: skip

    dataset = rank_zero_first(pack)
    fingerprint = packed_fingerprint(dataset, tokenizer)  # one digest: ranks agree, the checkpoint matches
    assert_same_on_all_ranks(fingerprint, f"{d.dataset}: the ranks packed different token streams")
    if len(dataset) == 0:
        raise ValueError(f"corpus {d.dataset!r} is shorter than one {d.max_len}-token window")
    check_resume_data(resume_from, fingerprint, run)
    _log(
        f"data {d.dataset}: {len(dataset)} windows of {d.max_len} tokens "
        f"({dataset.num_tokens:,} tokens, {dataset.doc_ends.size} documents), tokenizer {tok_dir}"
    )
    validation = rank_zero_first(lambda: validation_batches(run, tokenizer, model_config.family))
    sampler = LengthGroupedSampler(
        [d.max_len] * len(dataset), t.micro_batch_size, rank=rank, world_size=world, seed=t.seed
    )
    total = total_updates_for(run, len(sampler))
    engine, built = build_engine(run, model_config, ds_config, total, len(dataset), dry_run, resume_from)
    if engine is None:
        return built
    trainer = PretrainTrainer(
        run, engine, model_config, dataset, sampler, packed_collate, total, resume_from, str(tok_dir),
        fingerprint, validation=validation,
    )  # fmt: skip
    summary = trainer.train()
    summary.update(
        {
            "total_updates": total,
            "tokenizer": str(tok_dir),
            "output_dir": t.output_dir,
            "finished": trainer.state.step >= total,  # False after train.stop_at
            "validation": trainer.last_validation,
            "tokens_per_epoch": dataset.num_tokens,
            "epochs": (total * t.micro_batch_size * t.grad_accum * world) / max(1, len(dataset)),
        }
    )
    if trainer.last_validation is not None and not math.isfinite(trainer.last_validation["val/ppl"]):
        _log("warning: the final validation perplexity is not finite")
    return summary
