"""The SFT loop on a DeepSpeed ZeRO-3 engine: head schedule per update, exact resume, logging.

One optimizer update n (0-based) is:
  1. set the MDLMPE active KV heads to the first round(alpha(n) * H_kv) of the nested order
     (paper Eq. sft_head_warmup, SPEC §2) -- per update, not per micro-batch;
  2. for each of grad_accum micro-batches: corrupt the response tokens with a generator seeded by
     (seed, rank, micro-batch counter), forward the corrupted ids, the family loss, backward;
  3. DeepSpeed's step at the accumulation boundary (clipping, AdamW, lr scheduler). A non-finite
     gradient norm makes ZeRO-3 skip the update (and the lr scheduler) on every rank alike; we count
     it, and stop after `max_consecutive_nonfinite` in a row, pointing at the last good checkpoint.

Everything that decides the next batch and the next noise draw -- engine state (DeepSpeed), sampler
position, counters, RNG states -- is in every checkpoint, so a resumed run repeats the straight run's
losses, lr and gradient norms bit for bit, in fp32 and in bf16 (tests/dist/test_sft_resume.py), given
the same world size and, on the CPU, the same intra-op thread count (OMP_NUM_THREADS: the order in
which CPU kernels add partial sums depends on it; a resume with another count is warned about).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mdlmpe_ds import checkpoint as ckpt
from mdlmpe_ds import collectives, lifecycle, lora
from mdlmpe_ds import engine as eng
from mdlmpe_ds.config import RunConfig
from mdlmpe_ds.pe.heads import active_head_count, head_fraction, scheduled_kv_heads
from mdlmpe_ds.tracking import make_tracker

# Test-only fault injection (tests/dist): comma-separated update indices whose loss is made NaN, and
# the update at whose save rank 0 SIGKILLs itself after DeepSpeed's shards but before COMPLETE.
FAULT_NAN_UPDATES = "MDLMPE_DS_FAULT_NAN_UPDATES"
FAULT_KILL_IN_SAVE = "MDLMPE_DS_FAULT_KILL_IN_SAVE"
# Test-only: the update at whose save rank 0 waits 60 s at the same point, so that a test can kill the
# whole job from outside while the save is under way (a tiny model's save outruns any poll).
FAULT_PAUSE_IN_SAVE = "MDLMPE_DS_FAULT_PAUSE_IN_SAVE"
# Test-only: after training, save the engine's logits on a probe batch to this path (export parity).
PROBE_LOGITS = "MDLMPE_DS_PROBE_LOGITS"

T_BUCKETS = 10


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite updates."""


class Stopped(RuntimeError):
    """The run stopped on a signal or a lost launcher after saving a checkpoint; ``exit_code`` is
    128 + the signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class TrainerState:
    """Counters that, with DeepSpeed's state and the sampler's, define where the run is."""

    step: int = 0  # optimizer updates attempted (applied + skipped): the head schedule's n
    micro_step: int = 0  # micro-batches consumed by this rank: the noise generator's step
    samples_seen: int = 0  # global
    tokens_seen: int = 0  # global, non-padding tokens
    nonfinite_total: int = 0
    nonfinite_consecutive: int = 0
    sampler: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ helpers
def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def _fault_updates() -> set[int]:
    raw = os.environ.get(FAULT_NAN_UPDATES, "")
    return {int(x) for x in raw.split(",") if x.strip()}


def mdlmpe_stats(module: torch.nn.Module) -> dict[str, float]:
    """gamma of the embedding path and |delta| statistics of every layer's phase MLP.

    |delta| is evaluated on a fixed sample of pair features s ~ U(-pi/2, pi/2)^F (the range of s,
    Eq. clipped_angle_bound), i.e. the size of the learned residual over its input domain, not on a
    training batch (that would need the L x L pair tensor). Collective under ZeRO-3 (gathers the
    small MDLMPE parameters on every rank); call on log steps only.
    """
    from mdlmpe_ds.pe.encoder import MDLMPEEncoder
    from mdlmpe_ds.pe.phase import PhaseMLP, phase_residual

    encoders = [m for m in module.modules() if isinstance(m, MDLMPEEncoder)]
    phases = [m for m in module.modules() if isinstance(m, PhaseMLP)]
    params = [p for m in encoders + phases for p in m.parameters()]
    if not params:
        return {}
    out: dict[str, float] = {}
    with eng.gathered(params), torch.no_grad():
        for i, enc in enumerate(encoders):
            if getattr(enc, "gate_logit", None) is not None:
                out[f"mdlmpe/gamma/embedding{i if len(encoders) > 1 else ''}"] = float(enc.gamma)
        tau_max = encoders[0].config.tau_max if encoders else 0.25
        means, maxes = [], []
        for layer, phase in enumerate(phases):
            gen = torch.Generator().manual_seed(0)
            s = (torch.rand(256, phase.num_pairs, generator=gen) - 0.5) * math.pi  # [256, F]
            params_cpu = type(phase.params())(*(t.detach().float().cpu() for t in phase.params()))
            delta = phase_residual(s, params_cpu, tau_max).abs()  # [256, |M|]
            out[f"mdlmpe/delta_abs_mean/layer{layer}"] = float(delta.mean())
            means.append(float(delta.mean()))
            maxes.append(float(delta.max()))
        if phases:
            out["mdlmpe/delta_abs_mean"] = sum(means) / len(means)
            out["mdlmpe/delta_abs_max"] = max(maxes)
    return out


# ------------------------------------------------------------------------------------ trainer
class SFTTrainer:
    """Owns the engine, the data iterator, the counters and the checkpoints of one SFT run."""

    def __init__(
        self,
        run: RunConfig,
        engine,
        model_config,
        dataset,
        sampler,
        collator,
        total_updates: int,
        resume_from: Path | None,
        tokenizer_dir: str = "",
        data_fingerprint: str | None = None,
    ) -> None:
        from mdlmpe_ds.diffusion.blocks import block_sft_corrupt
        from mdlmpe_ds.diffusion.corruption import corrupt, noise_generator
        from mdlmpe_ds.diffusion.losses import dream_sft_loss, llada_sft_loss

        self._corrupt, self._noise_generator = corrupt, noise_generator
        self._block_corrupt = block_sft_corrupt
        self._llada_loss, self._dream_loss = llada_sft_loss, dream_sft_loss
        self.run, self.engine, self.model_config = run, engine, model_config
        self.dataset, self.sampler, self.collator = dataset, sampler, collator
        self.total_updates = total_updates
        self.tokenizer_dir = str(tokenizer_dir)
        self.data_fingerprint = data_fingerprint
        self.stop_requested = False
        self.rank, self.world = eng.rank(), eng.world_size()
        self.state = TrainerState()
        self.loss_family = model_config.family if run.train.loss == "auto" else run.train.loss
        self.uses_mdlmpe = model_config.position_encoding == "mdlmpe"
        self.device = engine.device
        self.last_good: Path | None = None
        if resume_from is not None:
            self._resume(resume_from)
        self.tracker = make_tracker(self.rank, run.train.output_dir, total_updates, self.state.step)
        if resume_from is not None:
            self.tracker.print(f"resumed from {resume_from} (update {self.state.step}/{total_updates})")

    # ---------------------------------------------------------------- data
    def _batches(self):
        """Per-rank micro-batches forever; the sampler moves to the next epoch by itself and its
        position (epoch, batches consumed) is what a checkpoint stores. The collator's per-batch
        cutoff draw is keyed by (epoch, sample indices), so a resumed run redraws it exactly."""
        while True:
            for indices in self.sampler:
                key = (self.sampler.epoch, *indices)
                yield self.collator([self.dataset[i] for i in indices], draw_key=key)

    # ---------------------------------------------------------------- one update
    def _heads(self, update: int) -> float:
        """Apply alpha(n) to every layer; returns the active fraction actually set."""
        if not self.uses_mdlmpe:
            return 0.0
        h_kv = self.model_config.num_kv_heads
        if not self.run.train.head_schedule:
            self.engine.module.set_active_kv_heads(torch.ones(h_kv, dtype=torch.bool))
            return 1.0
        mask = scheduled_kv_heads(update, self.total_updates, h_kv)
        self.engine.module.set_active_kv_heads(mask)
        return active_head_count(head_fraction(update, self.total_updates), h_kv) / h_kv

    def _micro(self, batch: dict[str, torch.Tensor], nan: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        t = self.run.train
        batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        gen = self._noise_generator(t.seed, self.rank, self.state.micro_step)
        mask_id = self.model_config.mask_token_id
        if t.block_size is None:
            noisy = self._corrupt(batch["input_ids"], batch["maskable"], mask_id, gen, eps=t.noise_eps)
            ids, valid, masked, answer_len = (
                noisy.noisy_ids,
                batch["valid"],
                noisy.masked,
                batch["answer_len"],
            )
        else:
            # One active block per example; the loss covers its masked tokens, normalised by its length.
            noisy = self._block_corrupt(
                batch["input_ids"], batch["prompt_mask"], batch["maskable"], batch["valid"],
                t.block_size, t.block_context, mask_id, gen, eps=t.noise_eps,
            )  # fmt: skip
            ids, valid, masked, answer_len = noisy.noisy_ids, noisy.valid, noisy.loss_mask, noisy.block_len
        # fp32 CE at the masked positions only, the LM head run in chunks (as many on every rank): no
        # [B, L, V] logits
        from mdlmpe_ds.models.scored_head import group_chunk_count

        logits = self.engine(
            ids, valid=valid, positions=batch.get("positions"), scored=masked, targets=batch["input_ids"],
            head_chunks=group_chunk_count(masked),
        )  # fmt: skip
        # logits: ScoredCE, ce [M]
        if self.loss_family == "llada":
            loss, stats = self._llada_loss(logits, batch["input_ids"], masked, noisy.p_mask, answer_len)
        else:
            loss, stats = self._dream_loss(
                logits,
                batch["input_ids"],
                masked,
                noisy.t,
                batch["maskable"] & valid,
                weighting=t.dream_weighting,
                cart_p=t.cart_p,
                valid=valid,
            )
        if nan:
            loss = loss * float("nan")
        extra = {"tokens": int(batch["valid"].sum()), "samples": int(batch["input_ids"].shape[0])}
        return loss, {"stats": stats, **extra}

    def _update(self, batches) -> dict[str, float]:
        t = self.run.train
        update = self.state.step
        fraction = self._heads(update)
        nan = update in _fault_updates()
        lr = float(self.engine.get_lr()[0])  # the lr this update uses
        loss_sum, tokens, samples = 0.0, 0, 0
        bucket_sum = [0.0] * T_BUCKETS
        bucket_cnt = [0.0] * T_BUCKETS
        for _ in range(t.grad_accum):
            batch = next(batches)
            loss, stats = self._micro(batch, nan)
            self.engine.backward(loss)
            self.engine.step()
            self.state.micro_step += 1
            value = float(loss.detach())
            loss_sum += value
            tokens += stats["tokens"]
            samples += stats["samples"]
            for b, (nll, count) in enumerate(
                zip(stats["stats"].bucket_nll.tolist(), stats["stats"].bucket_count.tolist())
            ):
                bucket_sum[b] += nll
                bucket_cnt[b] += count
        applied = bool(self.engine.was_step_applied())
        # The stop flag rides on the update's own all-reduce, so every rank sees the same sum and
        # stops after the same update, wherever its signal arrived.
        stop = 1.0 if lifecycle.stop_reason() is not None else 0.0
        reduced = collectives.all_reduce_sum([loss_sum, tokens, samples, *bucket_sum, *bucket_cnt, stop])
        self.stop_requested = reduced[-1] > 0
        reduced = reduced[:-1]
        loss_mean = reduced[0] / (t.grad_accum * self.world)
        self.state.step += 1
        self.state.tokens_seen += int(reduced[1])
        self.state.samples_seen += int(reduced[2])
        finite = applied and math.isfinite(loss_mean)
        if finite:
            self.state.nonfinite_consecutive = 0
        else:
            self.state.nonfinite_total += 1
            self.state.nonfinite_consecutive += 1
        grad_norm = self.engine.get_global_grad_norm()
        out = {
            "train/loss": loss_mean,
            "train/lr": lr,
            "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "train/samples_seen": float(self.state.samples_seen),
            "train/tokens_seen": float(self.state.tokens_seen),
            "train/nonfinite_skipped": float(self.state.nonfinite_total),
            "train/update_applied": float(finite),
            "mdlmpe/active_head_fraction": fraction,
            "_tokens": reduced[1],
        }
        sums, counts = reduced[3 : 3 + T_BUCKETS], reduced[3 + T_BUCKETS :]
        # unweighted per-token CE of the masked tokens (the loss itself carries 1/p weights)
        out["train/nll"] = sum(sums) / max(sum(counts), 1.0)
        out["train/masked_tokens"] = sum(counts)  # loss positions of this update, all ranks
        for b in range(T_BUCKETS):
            if counts[b] > 0:
                # unweighted per-token NLL of the masked tokens whose row has t in this bucket
                out[f"nll_by_t/{b / T_BUCKETS:.1f}-{(b + 1) / T_BUCKETS:.1f}"] = sums[b] / counts[b]
        return out

    def periodic_metrics(self, step: int) -> dict[str, float]:
        """Extra scalars logged after update ``step`` (a subclass's validation); collective-safe:
        called on every rank."""
        return {}

    # ---------------------------------------------------------------- loop
    def train(self) -> dict[str, Any]:
        """Run to total_updates; returns a summary (per-update losses, lrs, fractions, paths)."""
        t = self.run.train
        history: list[dict[str, float]] = []
        batches = self._batches()
        self.engine.train()
        try:
            while self.state.step < self.total_updates:
                start = time.perf_counter()
                metrics = self._update(batches)
                elapsed = time.perf_counter() - start
                tokens = metrics.pop("_tokens")
                metrics["train/tokens_per_s"] = tokens / max(elapsed, 1e-9)
                metrics["memory/peak_gb"] = peak_memory_gb()
                step = self.state.step
                if step % t.log_every == 0 or step == self.total_updates:
                    metrics.update(mdlmpe_stats(self.engine.module))
                metrics.update(self.periodic_metrics(step))
                self.tracker.scalars(step, metrics)
                history.append(
                    {
                        "step": step,
                        "loss": metrics["train/loss"],
                        "lr": metrics["train/lr"],
                        "active_head_fraction": metrics["mdlmpe/active_head_fraction"],
                    }
                )
                remaining = (self.total_updates - step) * elapsed
                self.tracker.progress(
                    step,
                    {
                        "loss": f"{metrics['train/loss']:.4f}",
                        "tok/s": f"{metrics['train/tokens_per_s']:.0f}",
                        "eta": f"{remaining:.0f}s",
                    },
                )
                if self.state.nonfinite_consecutive:
                    self.tracker.print(
                        f"update {step}: non-finite loss/gradient, update skipped "
                        f"({self.state.nonfinite_consecutive} in a row, {self.state.nonfinite_total} total)"
                    )
                if self.state.nonfinite_consecutive >= t.max_consecutive_nonfinite:
                    where = self.last_good or ckpt.newest_complete(t.output_dir)
                    raise NonFiniteError(
                        f"{self.state.nonfinite_consecutive} consecutive non-finite updates (limit "
                        f"train.max_consecutive_nonfinite={t.max_consecutive_nonfinite}) at update {step}; "
                        f"last good checkpoint: {where or 'none saved yet'}. "
                        "Lower optim.lr or check the data, "
                        f"then resume with --resume {where or 'auto'}"
                    )
                stopping = t.stop_at is not None and step >= t.stop_at
                if step % t.save_every == 0 or step == self.total_updates or stopping or self.stop_requested:
                    self.save()
                if self.stop_requested:
                    reason = lifecycle.stop_reason() or "another rank was asked to stop"
                    raise Stopped(
                        f"stopped after update {step} ({reason}); checkpoint {self.last_good} is "
                        f"complete: continue with --resume auto",
                        lifecycle.exit_code() or 128 + signal.SIGTERM,
                    )
                if stopping:
                    self.tracker.print(
                        f"stopping at update {step} (train.stop_at); resume with --resume auto"
                    )
                    break
        finally:
            self.tracker.close()
        if self.uses_mdlmpe:  # all heads at the end and at inference (SPEC §2)
            self.engine.module.set_active_kv_heads(
                torch.ones(self.model_config.num_kv_heads, dtype=torch.bool)
            )
        probe = os.environ.get(PROBE_LOGITS)
        if probe:
            self._probe_logits(Path(probe))
        return {
            "history": history,
            "last_checkpoint": str(self.last_good) if self.last_good else None,
            "tensorboard": str(Path(t.output_dir) / "tensorboard"),
        }

    def _probe_logits(self, path: Path) -> None:
        """Test hook: logits of the engine (all heads, eval mode) on the first examples, saved by
        rank 0, to compare with an exported-and-reloaded model (tests/dist)."""
        indices = list(range(min(2, len(self.dataset))))
        batch = self.collator([self.dataset[i] for i in indices], draw_key=(0, *indices))
        if "positions" in batch:
            raise RuntimeError(f"{PROBE_LOGITS} compares position-free forwards; run it without left padding")
        self.engine.eval()
        with torch.no_grad():
            logits = self.engine(batch["input_ids"].to(self.device), valid=batch["valid"].to(self.device))
        self.engine.train()
        state = eng.consolidated_state_dict(self.engine)  # collective; the trained weights (LoRA tests)
        if self.rank == 0:
            torch.save(
                {
                    "input_ids": batch["input_ids"],
                    "valid": batch["valid"],
                    "logits": logits.float().cpu(),
                    "state": state,
                },
                path,
            )

    # ---------------------------------------------------------------- checkpoints
    def save(self) -> Path:
        """Everything into ``step_N.saving``: DeepSpeed shards, per-rank state, config; every rank
        fsyncs; barrier; rank 0 writes the manifest and COMPLETE and swaps the directory in as
        ``step_N`` (replacing an older copy atomically), then prunes (checkpoint.py)."""
        t = self.run.train
        final = ckpt.step_dir(t.output_dir, self.state.step)
        staging = ckpt.staging_dir(t.output_dir, self.state.step)
        if self.rank == 0:
            if staging.exists():  # debris of this step's earlier attempt (recovered at start)
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        eng.barrier()
        # LoRA: the frozen base is not written again (lora.checkpoint_save_kwargs)
        self.engine.save_checkpoint(
            str(staging), tag=ckpt.DS_TAG, save_latest=False, **lora.checkpoint_save_kwargs(self.run)
        )
        self.state.sampler = self.sampler.state_dict()
        ckpt.write_trainer_state(
            staging,
            self.rank,
            {"trainer": asdict(self.state), "rng": ckpt.rng_state(), "numerics": ckpt.numerics_state()},
        )
        if self.rank == 0:
            ckpt.write_meta(
                staging,
                self.state.step,
                self.world,
                self.run.to_dict(),
                self.model_config.to_dict(),
                self.tokenizer_dir,
                self.data_fingerprint,
            )
            lora.write_checkpoint_meta_of(staging, self.run, self.engine.module)  # LoRA runs only
        eng.barrier()  # every rank's files are written (no .tmp left) before anyone flushes
        ckpt.fsync_tree(staging)
        eng.barrier()
        if self.rank == 0:
            if os.environ.get(FAULT_KILL_IN_SAVE) == str(self.state.step):
                os.kill(os.getpid(), signal.SIGKILL)
            if os.environ.get(FAULT_PAUSE_IN_SAVE) == str(self.state.step):
                time.sleep(60)
            ckpt.finalize(staging, final)
            for gone in ckpt.prune(t.output_dir, t.keep_last, keep=final):
                self.tracker.print(f"removed old checkpoint {gone}")
        eng.barrier()
        self.last_good = final
        self.tracker.print(f"saved checkpoint {final}")
        return final

    def _resume(self, path: Path) -> None:
        saved = ckpt.read_saved_run(path)
        ckpt.check_same_model(saved, self.model_config.to_dict())
        # Another world size reads DeepSpeed's universal copy (run_sft has switched the engine's
        # "checkpoint.load_universal" on and checked that the copy exists).
        tag = ckpt.DS_TAG if saved.world_size == self.world else ckpt.DS_UNIVERSAL_TAG
        lora.check_resume(path, self.run, self.engine.module)  # adapter + MDLMPE keys all there
        loaded, _ = self.engine.load_checkpoint(str(path), tag=tag, **lora.checkpoint_load_kwargs(self.run))
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load {path}/{tag}")
        same_world = saved.world_size == self.world
        state = ckpt.read_trainer_state(path, self.rank if same_world else 0)
        self.state = TrainerState(**state["trainer"])
        # Same global micro-batch sequence on any world size (the sampler re-cuts its groups).
        self.sampler.load_state_dict(self.state.sampler)
        if same_world:
            ckpt.set_rng_state(state["rng"])
            differences = ckpt.numerics_differences(state.get("numerics"))
            if differences and eng.on_cpu():
                _log(
                    f"note: {path} was written with other CPU numerics ({'; '.join(differences)}): the "
                    f"resumed losses will differ from an uninterrupted run's in the last bits "
                    f"(set OMP_NUM_THREADS as at save for a bitwise continuation)"
                )
        else:  # per-rank noise streams are keyed by rank: continue from the global count
            self.state.micro_step = self.state.micro_step * saved.world_size // self.world
        self.last_good = path


def summary_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=1)


# ------------------------------------------------------------------------------------ building a run
DEMO_DATASET = "chat-demo"


def _log(message: str) -> None:
    if eng.rank() == 0:
        print(message, flush=True)


def demo_assets() -> tuple[Path, Path]:
    """(Qwen2.5 tokenizer dir, chat.jsonl) prepared offline by data/assets.py (rank 0 first)."""
    from mdlmpe_ds.data.assets import ensure_assets

    paths = rank_zero_first(lambda: ensure_assets(parts=("qwen_tokenizer", "chat")))
    return paths.qwen_tokenizer_dir, paths.chat_jsonl


def resolve_sources(run: RunConfig) -> tuple[str, str]:
    """(tokenizer dir, dataset source) after the demo defaults are filled in."""
    d, m = run.data, run.model
    tokenizer, dataset = d.tokenizer, d.dataset
    if dataset == DEMO_DATASET or (tokenizer is None and m.model_name_or_path is None):
        tok_dir, chat = demo_assets()
        if dataset == DEMO_DATASET:
            dataset = str(chat)
        if tokenizer is None and m.model_name_or_path is None:
            tokenizer = str(tok_dir)
    if tokenizer is None:
        tokenizer = m.model_name_or_path
    return tokenizer, dataset


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def model_config_for(run: RunConfig, tokenizer):
    """The backbone's ModelConfig: a preset with ids from the tokenizer, or a pretrained directory's
    config; then this run's position encoding, MDLMPE knobs (L_ref = data.max_len unless set) and
    gradient checkpointing."""
    import dataclasses

    from mdlmpe_ds.models.presets import preset

    m = run.model
    mdlmpe = run.mdlmpe_config().validate()
    common = {
        "position_encoding": m.position_encoding,
        "gradient_checkpointing": m.gradient_checkpointing,
        "recompute_mdlmpe_attention": m.recompute_mdlmpe_attention,
    }
    if m.model_name_or_path is not None:
        from mdlmpe_ds.models.hf_io import read_hf_config

        base = read_hf_config(m.model_name_or_path)
        # L_ref of MDLMPE is the run's max length, and the model config must agree with it.
        return dataclasses.replace(base, max_seq_len=run.data.max_len, mdlmpe=mdlmpe, **common).validate()
    vocab = m.vocab_size if m.vocab_size is not None else _round_up(len(tokenizer), 64)
    mask_id = m.mask_token_id
    if mask_id is None:
        mask_id = tokenizer.mask_token_id
        if mask_id is None:
            mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
            if mask_id is None or mask_id == tokenizer.unk_token_id:
                own = _preset_with_mask_for(m.preset, len(tokenizer))
                mask_id, vocab = own.mask_token_id, m.vocab_size or own.vocab_size
    eos = m.eos_token_id if m.eos_token_id is not None else tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token; set model.eos_token_id")
    pad = m.pad_token_id if m.pad_token_id is not None else eos
    if vocab < len(tokenizer):
        raise ValueError(f"model.vocab_size={vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    return preset(
        m.preset,
        vocab_size=vocab,
        mask_token_id=int(mask_id),
        eos_token_id=int(eos),
        pad_token_id=int(pad),
        max_seq_len=max(run.data.max_len, 8),
        mdlmpe=mdlmpe,
        **common,
    )


def _preset_with_mask_for(name: str, tokenizer_size: int):
    """The preset whose own mask id (and table size) serve when the tokenizer declares no mask token:
    LLaDA's tokenizer has none, and its model config's 126336 is the source of truth. Only when the
    preset's table covers the tokenizer; else the error naming the key to set."""
    from mdlmpe_ds.models.presets import preset

    own = preset(name)
    if own.vocab_size >= tokenizer_size:
        return own
    raise ValueError(
        f"the tokenizer has no mask token (<|mask|>) and preset {name}'s table ({own.vocab_size}) does not "
        f"cover its {tokenizer_size} tokens; set model.mask_token_id"
    )


def updates_per_epoch(num_batches_per_rank: int, grad_accum: int) -> int:
    return max(1, num_batches_per_rank // grad_accum)


def total_updates_for(run: RunConfig, num_batches_per_rank: int) -> int:
    if run.train.max_steps is not None:
        return run.train.max_steps
    return max(1, math.ceil(run.train.epochs * updates_per_epoch(num_batches_per_rank, run.train.grad_accum)))


def describe_plan(run: RunConfig, model_config, world: int, total: int, n_examples: int, params: dict) -> str:
    t = run.train
    per_update = t.micro_batch_size * t.grad_accum * world
    scheduled = t.head_schedule and model_config.position_encoding == "mdlmpe"
    return "\n".join(
        [
            f"model: {run.model.model_name_or_path or run.model.preset} ({model_config.family}), "
            f"position encoding {model_config.position_encoding}",
            f"parameters: backbone {params['backbone']:,}  mdlmpe {params['mdlmpe']:,}  "
            f"total {params['total']:,}",
            f"data: {n_examples} examples, max_len {run.data.max_len}",
            f"batch: micro {t.micro_batch_size} x grad_accum {t.grad_accum} x world {world} = {per_update} "
            f"sequences per update",
            f"updates: {total} (warmup {run.warmup_updates(total)}, cosine {run.optim.cosine}), "
            f"~{total * per_update / max(1, n_examples):.2f} epochs",
            f"head schedule: {'on' if scheduled else 'off'};"
            f" checkpoints every {t.save_every} updates into {Path(t.output_dir) / 'checkpoints'}"
            f" (keep {t.keep_last})",
        ]
    )


def assert_same_on_all_ranks(fingerprint: str, what: str) -> None:
    """Raise ``what`` (with every rank's digest) unless all ranks hold the same hex ``fingerprint``
    (data/fingerprint.py: the sampler indexes the data globally, so every rank must hold the same)."""
    if not dist.is_initialized():
        return
    mine = torch.tensor(list(bytes.fromhex(fingerprint)), dtype=torch.uint8)  # [32], host: gloo
    gathered = collectives.all_gather(mine, setup=True)
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        raise RuntimeError(f"{what} (fingerprints {[bytes(g.tolist()).hex()[:16] for g in gathered]})")


def prepare_output_dir(resume: str | None, run: RunConfig, dry_run: bool = False) -> None:
    """Rank 0, then everyone: finish or discard what a killed save left; refuse (or, with
    train.overwrite_output_dir, clear) an output_dir holding another run's checkpoints when this run
    does not resume. A dry run only checks."""
    t = run.train
    if eng.rank() == 0:
        for action in [] if dry_run else ckpt.recover_interrupted(t.output_dir):
            _log(action)
        existing = ckpt.existing_run(t.output_dir)
        if resume is None and existing:
            if not t.overwrite_output_dir:
                names = ", ".join(p.name for p in existing)
                raise FileExistsError(
                    f"{t.output_dir} already holds checkpoints of a run ({names}). "
                    f"Continue it with --resume auto, or start over with --overwrite_output_dir true "
                    f"(deletes its checkpoints, metrics and TensorBoard logs), or pick another --output_dir"
                )
            out = Path(t.output_dir)
            if dry_run:
                _log(f"--overwrite_output_dir: the run would delete the earlier run in {out}")
                return
            for stale in (ckpt.checkpoints_root(out), out / "tensorboard"):
                shutil.rmtree(stale, ignore_errors=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
            _log(f"--overwrite_output_dir: removed the earlier run's checkpoints and logs in {out}")
    eng.barrier()


def prepare_resume(
    resume: str | None, run: RunConfig, model_config, ds_config: dict, dry_run: bool = False
) -> Path | None:
    """The checkpoint to resume from (None: a fresh run), verified against its manifest and checked
    against this model before any data or engine work; checkpoints newer than it are moved aside
    (checkpoint.supersede_newer); a checkpoint of another world size switches the engine to its
    universal copy."""
    prepare_output_dir(resume, run, dry_run)
    resume_from = ckpt.resolve_resume(resume, run.train.output_dir, log=_log)
    eng.barrier()  # every rank has verified before rank 0 may move anything
    if resume_from is None:
        return None
    if eng.rank() == 0 and not dry_run:
        for moved in ckpt.supersede_newer(run.train.output_dir, resume_from):
            _log(f"moved {moved.name} aside to {moved} (newer than the checkpoint resumed from)")
    eng.barrier()
    saved = ckpt.read_saved_run(resume_from)
    ckpt.check_same_model(saved, model_config.to_dict())
    world = eng.world_size()
    if saved.world_size != world:
        if not (resume_from / ckpt.DS_UNIVERSAL_TAG).is_dir():
            raise RuntimeError(eng.load_universal_instructions(resume_from, saved.world_size, world))
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
        _log(f"resuming a {saved.world_size}-rank checkpoint on {world} ranks from its universal copy")
    return resume_from


def build_engine(
    run: RunConfig,
    model_config,
    ds_config: dict,
    total: int,
    n_examples: int,
    dry_run: bool,
    resume_from: Path | None = None,
):
    """The model under ZeRO-3 (weights created partitioned, MDLMPE initialised, a pretrained
    directory streamed in) and its DeepSpeed engine; logs the plan. Returns (engine, result) where a
    dry run builds on the meta device only and returns (None, {plan, total_updates, params})."""
    from mdlmpe_ds.models.transformer import DiffusionLM

    torch.manual_seed(run.train.seed)  # same initial weights on every rank
    model = eng.build_model(lambda: DiffusionLM(model_config, impl=run.attention), ds_config, meta=dry_run)
    if not dry_run:
        eng.init_mdlmpe_parameters(model)
        if run.model.model_name_or_path is not None:
            from mdlmpe_ds.models.hf_io import load_weights_into

            load_weights_into(model, run.model.model_name_or_path, gathered=eng.gathered_factory())
    params = {"backbone": model.num_backbone_parameters(), "mdlmpe": model.num_mdlmpe_parameters()}
    params["total"] = params["backbone"] + params["mdlmpe"]
    plan = describe_plan(run, model_config, eng.world_size(), total, n_examples, params)
    plan += lora.attach(model, run, ds_config, resume_from, params, meta=dry_run)  # LoRA runs only
    from mdlmpe_ds.memory_plan import plan_memory

    memory = plan_memory(
        model_config, ds_config, eng.world_size(), run.train.micro_batch_size, run.data.max_len,
        impl=run.attention, **lora.memory_plan_kwargs(params),
    )  # fmt: skip
    plan += "\n" + memory.format()
    if dry_run:
        _log("dry run (meta device, nothing allocated):\n" + plan)
        return None, {
            "plan": plan,
            "total_updates": total,
            "params": params,
            "memory_gib": memory.total / 2**30,
        }
    _log(plan)
    return eng.initialize(model, ds_config, run, total), {"plan": plan, "params": params}


def check_resume_data(resume_from: Path | None, fingerprint: str, run: RunConfig) -> None:
    """Refuse to resume on other data than the checkpoint's (train.allow_data_change overrides)."""
    if resume_from is None:
        return
    warning = ckpt.check_same_data(ckpt.read_saved_run(resume_from), fingerprint, run.train.allow_data_change)
    if warning:
        _log(warning)


def rank_zero_first(build: Callable[[], Any]) -> Any:
    """``build()`` on each node's local rank 0, then on the node's other ranks: `datasets` writes
    its Arrow cache (and we our tokenizer and data caches) on first use, and ranks building it at
    the same time were seen to disagree; the others then read what their node's first rank cached.

    Nodes build at the same time (their caches may be one shared folder: the writes are atomic
    renames). The waits are on the setup group (``train.setup_timeout_min``), before and after the
    others' build, so no rank waits for data on the short collective timeout.
    """
    first = collectives.local_rank() == 0
    if first:
        out = build()
    collectives.setup_barrier("data setup on each node's first rank")
    if not first:
        out = build()
    collectives.setup_barrier("data setup on the other ranks")
    return out


def run_sft(run: RunConfig, ds_config_path: str, resume: str | None = None, dry_run: bool = False) -> dict:
    """Build everything in the ZeRO-3 order and train. Call inside `engine.distributed_session`
    (except dry runs, which build on the meta device and need no process group)."""
    from transformers import AutoTokenizer

    from mdlmpe_ds.data.fingerprint import sft_fingerprint
    from mdlmpe_ds.data.sampler import LengthGroupedSampler
    from mdlmpe_ds.data.sft import SFTCollator, build_sft_dataset, eos_pad_id
    from mdlmpe_ds.hub.resolve import resolve_run_names

    world, rank = eng.world_size(), eng.rank()
    t = run.train
    resolve_run_names(run)  # hub ids -> local snapshots (rank 0 downloads first)
    tok_dir, source = resolve_sources(run)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    model_config = model_config_for(run, tokenizer)
    ds_config = eng.prepare_ds_config(ds_config_path, run, world)
    resume_from = prepare_resume(resume, run, model_config, ds_config, dry_run)

    dataset, stats = rank_zero_first(
        lambda: build_sft_dataset(
            source,
            tokenizer,
            model_config.family,
            run.data.max_len,
            split=run.data.split,
            skip_malformed=run.data.skip_malformed,
            multiturn=run.data.multiturn,
            # keyed by source (its datasets fingerprint), tokenizer, template and settings; built by
            # each node's first rank, loaded by the others; data.store_dir shares it across runs
            cache_dir=Path(run.data.store_dir or Path(t.output_dir) / "data_cache"),
            seed=run.train.seed,  # the turn drawn by multiturn="sample"
        )
    )
    fingerprint = sft_fingerprint(dataset, tokenizer)  # one digest: ranks agree, the checkpoint matches
    assert_same_on_all_ranks(fingerprint, f"{source}: the ranks built different SFT datasets")
    _log(f"data {source}: {stats.summary()}")
    if len(dataset) == 0:
        raise ValueError(f"{source}: no usable SFT examples")
    check_resume_data(resume_from, fingerprint, run)
    lengths = dataset.lengths
    sampler = LengthGroupedSampler(lengths, t.micro_batch_size, rank=rank, world_size=world, seed=t.seed)
    total = total_updates_for(run, len(sampler))
    collator = SFTCollator(
        eos_pad_id(tokenizer),
        max_len=run.data.max_len,
        attend_padding=run.data.attend_padding,
        perbatch_cutoff=run.data.perbatch_cutoff,
        resp_cutoff_ratio=run.data.resp_cutoff_ratio,
        pad_to_multiple_of=run.data.pad_to_multiple_of,
        seed=t.seed,
    )
    compiled = model_config.position_encoding == "mdlmpe" and run.attention.compile
    if compiled and not run.data.pad_to_multiple_of and run.data.perbatch_cutoff == "none":
        _log(
            "warning: attention.compile with batches as wide as their longest row: every new width "
            "compiles the attention again (eager after 8); set data.pad_to_multiple_of, e.g. 64"
        )
    engine, built = build_engine(run, model_config, ds_config, total, len(dataset), dry_run, resume_from)
    if engine is None:
        return built
    trainer = SFTTrainer(
        run, engine, model_config, dataset, sampler, collator, total, resume_from, str(tok_dir), fingerprint
    )
    summary = trainer.train()
    summary.update({"total_updates": total, "tokenizer": str(tok_dir), "output_dir": t.output_dir})
    return summary
