"""Typed training configuration for SFT and pretraining runs: model choice, data, optimisation, loop.

One `RunConfig` (five sections) holds a run: every field carries its ``--help`` text (``doc``), so
the command line, config files and ``--help`` come from these types (mdlmpe_ds/config/cli.py, through
jsonargparse). A launcher's complete config comes from a function (recipes.py); ``validate`` checks
one without changing it. It is saved as `config.json` into every checkpoint, so a resume can check
that it continues the same model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mdlmpe_ds.attention.impl import AttentionImpl
from mdlmpe_ds.hub.resolve import looks_like_hub_id
from mdlmpe_ds.lora import spec as lora_spec
from mdlmpe_ds.models.recompute import Recompute
from mdlmpe_ds.pe.config import FOLLOW_MODEL, MDLMPEConfig

if TYPE_CHECKING:
    from mdlmpe_ds.models.recompute import Recompute

POSITION_ENCODINGS = ("rope", "mdlmpe", "alibi", "absolute")
LOSS_FAMILIES = ("auto", "llada", "dream")
DREAM_WEIGHTINGS = ("original", "cart", "linear", "none")
PRECISIONS = ("auto", "fp32", "bf16")
MULTITURN = ("last", "expand", "sample")  # sample: LLaDA's one turn per dialogue (App. B.1)
PERBATCH_CUTOFFS = ("none", "random", "random_with_input_pad")
TEXT_SPLITS = ("file", "paragraph", "line")
SAVE_ON_SIGNAL = ("full", "model", "none")


def doc(default: Any = dataclasses.MISSING, help: str = "", pretrain_only: bool = False, **kw: Any) -> Any:
    """A dataclass field with its ``--help`` text (``metadata["help"]``, read by mdlmpe_ds/config/cli.py);
    ``pretrain_only``: a key only launch/pretrain.py reads (SFT accepts and ignores it)."""
    return field(default=default, metadata={"help": help, "pretrain_only": pretrain_only}, **kw)


@dataclass
class ModelChoice:
    """Which backbone: a preset name (from-scratch/tiny), a local Hugging Face directory or hub id."""

    preset: str = doc("llada-tiny", "named backbone (models/presets.py) when no model_name_or_path is given")
    model_name_or_path: str | None = doc(
        None,
        "pretrained LLaDA-8B / Dream-7B: a local directory (config.json + safetensors) or a hub id such "
        "as GSAI-ML/LLaDA-8B-Instruct (snapshot_download; HF_HUB_OFFLINE honoured); overrides preset",
    )
    revision: str | None = doc(None, "hub revision (branch, tag or commit) of a hub-id model / tokenizer")
    position_encoding: str = doc("mdlmpe", f"one of {POSITION_ENCODINGS}")
    # A pretrained directory always keeps its own vocabulary and special ids.
    vocab_size: int | None = doc(
        None, "preset vocabulary; None: the tokenizer's size rounded up to a multiple of 64"
    )
    mask_token_id: int | None = doc(
        None, "preset mask id; None: the tokenizer's mask token, else the preset's own"
    )
    eos_token_id: int | None = doc(None, "preset EOS id; None: the tokenizer's")
    pad_token_id: int | None = doc(None, "preset pad id; None: the EOS id")
    mdlmpe: MDLMPEConfig = field(
        default_factory=lambda: MDLMPEConfig(max_seq_len=FOLLOW_MODEL),
        metadata={
            "help": "MDLMPE method keys (pe/config.py) as a JSON object merged into the defaults, e.g. "
            "'{\"tau_max\": 0.2}'; one key is --model.mdlmpe.KEY; max_seq_len -1 follows data.max_len"
        },
    )
    # Run-time memory choices, passed at model build (RunConfig.recompute(), models/recompute.py),
    # never stored in the model's config.
    gradient_checkpointing: bool = doc(True, "activation checkpointing: recompute every layer in backward")
    recompute_mdlmpe_attention: bool = doc(
        False,
        "with gradient_checkpointing, also recompute the MDLMPE attention inside the layer checkpoint "
        "(less memory, one more attention forward per layer)",
    )
    lora: str | None = doc(
        None,
        "LoRA SFT (lora.py), e.g. 'r=16,alpha=32,dropout=0.05,targets=q,k,v,o,gate,up,down' (a config "
        "file may give the mapping {r, alpha, dropout, targets}): backbone frozen, adapters on the "
        "targets, MDLMPE parameters trained in full; None: full fine-tune",
    )


@dataclass
class DataConfig:
    """SFT chat data in the `messages` format (hub name or local json/jsonl/parquet)."""

    dataset: str = doc(
        "chat-demo",
        "SFT: 'chat-demo' (chatterbot dialogues prepared offline), a .json/.jsonl/.parquet file, a "
        "directory or a hub name[:config]; pretraining: a text corpus (named, .txt files, "
        ".jsonl/.parquet, hub)",
    )
    dataset_config: str | None = doc(
        None,
        "a hub dataset's config name (HuggingFaceTB/smoltalk needs 'all'); or write dataset as name:config",
    )
    split: str = doc("train", "dataset split to train on (also --dataset_split)")
    tokenizer: str | None = doc(
        None, "tokenizer directory or hub id; None: the model's, or the offline Qwen2.5 one for presets"
    )
    max_len: int = doc(128, "sequence length: SFT rows are truncated to it; pretraining packs windows of it")
    skip_malformed: bool = doc(False, "count and skip malformed rows instead of failing on the first")
    multiturn: str = doc(
        "last", "multi-turn rows: 'last' answer, 'expand' to every turn, 'sample' one turn (LLaDA App. B.1)"
    )
    attend_padding: bool = doc(
        True, "true: EOS padding is attended and trained (official); false: padding is invalid"
    )
    # Dream-train's OptimizedCollateFunction (data/sft_collate.py SFTCollator); its official Tulu-3 recipe
    # uses "random_with_input_pad": prompts left-padded to the batch's longest (never attended,
    # masked or trained; positions start at each row's first real token), every response cut to,
    # or EOS-padded up to, the response length of one drawn row. The draw is keyed by the batch.
    perbatch_cutoff: str = doc(
        "none",
        f"Dream-train's per-batch response cutoff, one of {PERBATCH_CUTOFFS}: 'random' cuts every row to "
        "one drawn row's length, 'random_with_input_pad' left-pads prompts and cuts responses",
    )
    resp_cutoff_ratio: float = doc(
        0.0, "Dream-train's probability per batch of also cutting c ~ U{1..m-1} end columns (0: never)"
    )
    pad_to_multiple_of: int | None = doc(
        None,
        "round each batch's width up to a multiple of this (capped at max_len; bounds torch.compile "
        "graphs with attention.compile); None: no rounding",
    )
    text_split: str | None = doc(
        None,
        f"how a .txt file is cut into documents: one of {TEXT_SPLITS}; None: the named corpus's own",
        pretrain_only=True,
    )
    text_column: str = doc(
        "text", "column holding the text of a .jsonl/.parquet or hub corpus", pretrain_only=True
    )
    max_documents: int | None = doc(None, "keep only the first N documents of the corpus", pretrain_only=True)
    validation: str | None = doc(
        None,
        "held-out corpus for the validation perplexity logged during pretraining (same forms as dataset)",
        pretrain_only=True,
    )
    tokenizer_vocab: int = doc(
        4096,
        "SentencePiece BPE size when no tokenizer is given (one is trained on the corpus and cached)",
        pretrain_only=True,
    )
    store_dir: str | None = doc(
        None,
        "folder of the token stores (share it across runs to tokenise a corpus once); "
        "None: <output_dir>/data_cache",
        pretrain_only=True,
    )
    build_workers: int | None = doc(
        None,
        "processes tokenising a token store on each node's first rank; None: the CPUs (<= 32) "
        "for named hub corpora, else 1",
        pretrain_only=True,
    )


@dataclass
class OptimConfig:
    """AdamW + linear warmup + cosine decay, gradient clipping (Dream SFT defaults where sensible)."""

    lr: float | None = doc(
        None,
        "peak learning rate; None: 3e-3 for a from-scratch preset, 1e-5 for a pretrained model "
        "(an 8B model never gets the demo's rate by default)",
    )
    betas: tuple[float, float] = doc((0.9, 0.95), "AdamW (beta1, beta2), e.g. '[0.9, 0.95]'")
    eps: float = doc(1e-8, "AdamW epsilon")
    weight_decay: float = doc(0.01, "AdamW weight decay")
    warmup_ratio: float = doc(0.1, "warmup as a fraction of the total updates (unless warmup_steps is set)")
    warmup_steps: int | None = doc(None, "warmup updates (overrides warmup_ratio)")
    cosine: bool = doc(True, "cosine decay after warmup (false: constant)")
    min_lr_ratio: float = doc(0.1, "cosine floor as a fraction of lr")
    clip: float = doc(
        1.0,
        "gradient-norm clipping threshold (DeepSpeed's gradient_clipping); 0 turns clipping off, as "
        "HF's max_grad_norm=0 does (the grad norm is still logged, and a non-finite one still skips "
        "the update)",
    )


@dataclass
class TrainConfig:
    """The loop: batch arithmetic, length, checkpoints, logging, loss family, head schedule."""

    micro_batch_size: int = doc(4, "sequences per rank per forward (must agree with the ds config)")
    grad_accum: int = doc(1, "micro-batches accumulated per optimizer update")
    max_steps: int | None = doc(40, "optimizer updates; None: `epochs` over the data decide")
    epochs: float = doc(
        1.0, "passes over the data when max_steps is None (giving epochs without max_steps sets it None)"
    )
    stop_at: int | None = doc(
        None,
        "stop with a checkpoint after this update though the schedule spans max_steps (time-limited "
        "slots; continue with --resume auto); None: run to the end",
    )
    seed: int = doc(1234, "seed of initialisation, data order and corruption draws")
    save_every: int = doc(20, "checkpoint every N updates")
    keep_last: int = doc(2, "complete checkpoints kept")
    output_dir: str = doc("outputs/sft-demo", "run directory: checkpoints, metrics, TensorBoard logs")
    overwrite_output_dir: bool = doc(
        False,
        "a run without --resume refuses an output_dir holding checkpoints; true deletes that earlier "
        "run's checkpoints, metrics and TensorBoard logs first",
    )
    allow_data_change: bool = doc(False, "resume although the data or tokenizer differ from the checkpoint's")
    orphan_grace_s: float = doc(
        60.0,
        "seconds a rank whose launcher died waits before exiting (it stops like a SIGTERM: finish the "
        "update, save, exit)",
    )
    save_on_signal: str = doc(
        "full",
        f"what a stopped run (SIGTERM/SIGINT, lost launcher) writes, one of {SAVE_ON_SIGNAL}: a full "
        "resumable checkpoint, the model weights only (exportable, never resumed; docs/resume.md) or nothing",
    )
    log_every: int = doc(
        1,
        "compute and log the MDLMPE statistics (gate gamma, phase |delta| per layer; they gather "
        "the MDLMPE weights on every rank) every N updates and after the last; loss, lr, grad norm "
        "and the other metrics go to TensorBoard and metrics.jsonl every update",
    )
    loss: str = doc(
        "auto",
        f"loss family, one of {LOSS_FAMILIES}: 'auto' follows the model (LLaDA: 1/p weighted, "
        "answer-length normalised; Dream: 1/t or CART, normalised by masked tokens)",
    )
    dream_weighting: str = doc(
        "cart", f"Dream loss weighting, one of {DREAM_WEIGHTINGS} (official SFT: cart; docs/models.md §3.5)"
    )
    cart_p: float = doc(0.1, "CART geometric-kernel p (official 0.1)")
    noise_eps: float = doc(1e-3, "LLaDA's mask-probability floor p = (1 - eps) t + eps")
    corruption: str = doc(
        "iid", "pretraining corruption layout (diffusion/layouts.py): iid (LLaDA's), semi_ar, spans, mix"
    )
    block_size: int | None = doc(
        None,
        "block-diffusion SFT (paper §3.4, §4.4): one active response block per example; None: the "
        "whole response at once",
    )
    block_context: str = doc(
        "full", "block diffusion: later blocks 'full' (masked) or 'blocked' (hidden from attention)"
    )
    head_schedule: bool = doc(True, "SFT: switch MDLMPE on head by head between 10% and 90% of training")
    max_consecutive_nonfinite: int = doc(3, "stop after this many non-finite updates in a row")
    precision: str = doc(
        "auto", f"one of {PRECISIONS}; auto: the ds config's on GPU, fp32 on a CPU-only machine"
    )
    dist_timeout_min: float = doc(
        10.0, "distributed timeout (minutes): a collective reached by one rank only fails instead of hanging"
    )
    setup_timeout_min: float = doc(
        60.0,
        "minutes the other ranks wait while each node's first rank builds the data "
        "(tokenising a corpus once)",
    )
    # The validation draws depend on (seed, sequence index, sample) only: every run sees the same masks.
    eval_every: int = doc(
        0, "pretraining validation perplexity every N updates (0: only at the end)", pretrain_only=True
    )
    eval_sequences: int = doc(
        16, "packed sequences of data.validation scored by the validation", pretrain_only=True
    )
    eval_samples: int = doc(4, "(t, mask) draws per validation sequence", pretrain_only=True)


@dataclass
class RunConfig:
    model: ModelChoice = field(default_factory=ModelChoice)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # How MDLMPE attention is computed on this run (passed to DiffusionLM, never saved in the model).
    attention: AttentionImpl = field(default_factory=AttentionImpl)

    # ------------------------------------------------------------------ validation
    def validate(self) -> RunConfig:
        m, d, o, t = self.model, self.data, self.optim, self.train

        def bad(key: str, value: Any, why: str) -> ValueError:
            return ValueError(f"training config: {key}={value!r} {why}")

        for key, value in _numbers(self.to_dict()):
            if not math.isfinite(value):
                raise bad(key, value, "must be a finite number")
        if m.position_encoding not in POSITION_ENCODINGS:
            raise bad("model.position_encoding", m.position_encoding, f"must be one of {POSITION_ENCODINGS}")
        local = m.model_name_or_path is None or Path(m.model_name_or_path).is_dir()
        if not local and not looks_like_hub_id(m.model_name_or_path):
            raise bad("model.model_name_or_path", m.model_name_or_path, "is not a directory or hub id")
        if not isinstance(m.mdlmpe, MDLMPEConfig):
            raise bad("model.mdlmpe", m.mdlmpe, "must be an MDLMPEConfig")
        try:
            self.mdlmpe_config().validate()
        except ValueError as err:
            raise ValueError(f"training config: model.mdlmpe: {err}") from err
        try:
            self.attention.validate()
        except ValueError as err:
            raise ValueError(f"training config: {err}") from err
        if m.lora is not None:
            lora_spec.parse(m.lora, "model.lora")
        if d.max_len < 8:
            raise bad("data.max_len", d.max_len, "must be >= 8")
        if d.multiturn not in MULTITURN:
            raise bad("data.multiturn", d.multiturn, f"must be one of {MULTITURN}")
        if d.perbatch_cutoff not in PERBATCH_CUTOFFS:
            raise bad("data.perbatch_cutoff", d.perbatch_cutoff, f"must be one of {PERBATCH_CUTOFFS}")
        if not 0.0 <= d.resp_cutoff_ratio <= 1.0:
            raise bad("data.resp_cutoff_ratio", d.resp_cutoff_ratio, "must be in [0, 1] (a probability)")
        if d.pad_to_multiple_of is not None and d.pad_to_multiple_of < 1:
            raise bad("data.pad_to_multiple_of", d.pad_to_multiple_of, "must be >= 1 or null")
        if d.pad_to_multiple_of and (d.perbatch_cutoff != "none" or d.resp_cutoff_ratio > 0):
            raise bad(
                "data.pad_to_multiple_of",
                d.pad_to_multiple_of,
                "cannot be combined with data.perbatch_cutoff / data.resp_cutoff_ratio (the rounding "
                "pads would be trained EOS right after a truncated response)",
            )
        if d.perbatch_cutoff == "random_with_input_pad" and m.position_encoding == "absolute":
            raise bad(
                "data.perbatch_cutoff",
                d.perbatch_cutoff,
                "needs per-row positions, which the absolute position table does not take",
            )
        if d.perbatch_cutoff == "random" and t.block_size is not None:
            raise bad(
                "data.perbatch_cutoff",
                d.perbatch_cutoff,
                "can cut a row inside its prompt, leaving no response block; use random_with_input_pad",
            )
        if o.lr is not None and not o.lr > 0:
            raise bad("optim.lr", o.lr, "must be > 0")
        if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
            raise bad("optim.betas", o.betas, "must be two numbers in [0, 1)")
        if not 0 <= o.warmup_ratio < 1:
            raise bad("optim.warmup_ratio", o.warmup_ratio, "must be in [0, 1)")
        if o.warmup_steps is not None and o.warmup_steps < 0:
            raise bad("optim.warmup_steps", o.warmup_steps, "must be >= 0")
        if not 0 <= o.min_lr_ratio <= 1:
            raise bad("optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
        if not o.clip >= 0:
            raise bad("optim.clip", o.clip, "must be >= 0 (0 turns gradient clipping off)")
        for key in ("micro_batch_size", "grad_accum", "save_every", "keep_last", "log_every"):
            if getattr(t, key) < 1:
                raise bad(f"train.{key}", getattr(t, key), "must be >= 1")
        if t.max_steps is not None and t.max_steps < 1:
            raise bad("train.max_steps", t.max_steps, "must be >= 1 or null")
        if t.stop_at is not None and t.stop_at < 1:
            raise bad("train.stop_at", t.stop_at, "must be >= 1 or null")
        if t.max_steps is None and not t.epochs > 0:
            raise bad("train.epochs", t.epochs, "must be > 0 when max_steps is null")
        if t.loss not in LOSS_FAMILIES:
            raise bad("train.loss", t.loss, f"must be one of {LOSS_FAMILIES}")
        if t.dream_weighting not in DREAM_WEIGHTINGS:
            raise bad("train.dream_weighting", t.dream_weighting, f"must be one of {DREAM_WEIGHTINGS}")
        if not 0 < t.cart_p < 1:
            raise bad("train.cart_p", t.cart_p, "must be in (0, 1)")
        if not 0 < t.noise_eps < 1:
            raise bad("train.noise_eps", t.noise_eps, "must be in (0, 1)")
        if t.block_size is not None and t.block_size < 1:
            raise bad("train.block_size", t.block_size, "must be >= 1 or null")
        if t.block_context not in ("full", "blocked"):
            raise bad("train.block_context", t.block_context, "must be one of ('full', 'blocked')")
        if t.corruption not in ("iid", "semi_ar", "spans", "mix"):  # diffusion/layouts.py LAYOUTS
            raise bad("train.corruption", t.corruption, "must be one of ('iid', 'semi_ar', 'spans', 'mix')")
        if t.max_consecutive_nonfinite < 1:
            raise bad("train.max_consecutive_nonfinite", t.max_consecutive_nonfinite, "must be >= 1")
        if t.save_on_signal not in SAVE_ON_SIGNAL:
            raise bad("train.save_on_signal", t.save_on_signal, f"must be one of {SAVE_ON_SIGNAL}")
        if t.precision not in PRECISIONS:
            raise bad("train.precision", t.precision, f"must be one of {PRECISIONS}")
        if not t.dist_timeout_min > 0:
            raise bad("train.dist_timeout_min", t.dist_timeout_min, "must be > 0")
        if not t.orphan_grace_s > 0:
            raise bad("train.orphan_grace_s", t.orphan_grace_s, "must be > 0")
        if not t.setup_timeout_min > 0:
            raise bad("train.setup_timeout_min", t.setup_timeout_min, "must be > 0")
        if d.text_split is not None and d.text_split not in TEXT_SPLITS:
            raise bad("data.text_split", d.text_split, f"must be one of {TEXT_SPLITS} or null")
        if d.max_documents is not None and d.max_documents < 1:
            raise bad("data.max_documents", d.max_documents, "must be >= 1 or null")
        if d.tokenizer_vocab < 300:
            raise bad("data.tokenizer_vocab", d.tokenizer_vocab, "must be >= 300 (byte fallback uses 261)")
        if t.eval_every < 0:
            raise bad("train.eval_every", t.eval_every, "must be >= 0")
        if t.eval_sequences < 1 or t.eval_samples < 2:
            raise bad(
                "train.eval_sequences/eval_samples",
                (t.eval_sequences, t.eval_samples),
                "need >= 1 sequence and >= 2 samples (for a standard error)",
            )
        return self

    def mdlmpe_config(self) -> MDLMPEConfig:
        """model.mdlmpe with L_ref = data.max_len unless set (not validated)."""
        mdlmpe = self.model.mdlmpe
        if mdlmpe.max_seq_len != FOLLOW_MODEL:
            return mdlmpe
        return dataclasses.replace(mdlmpe, max_seq_len=self.data.max_len)

    def recompute(self) -> Recompute:
        """What backward recomputes, from model.gradient_checkpointing and
        model.recompute_mdlmpe_attention: passed at build, not part of the model's config (imported
        here: importing the models package loads the transformer and its checkpoint I/O)."""

        return Recompute(self.model.gradient_checkpointing, self.model.recompute_mdlmpe_attention)

    @property
    def lr(self) -> float:
        """The peak learning rate: optim.lr, else 3e-3 for presets and 1e-5 for pretrained models."""
        if self.optim.lr is not None:
            return self.optim.lr
        return 1e-5 if self.model.model_name_or_path is not None else 3e-3

    def warmup_updates(self, total_updates: int) -> int:
        if self.optim.warmup_steps is not None:
            return self.optim.warmup_steps
        return round(self.optim.warmup_ratio * total_updates)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def flat(self) -> dict[str, Any]:
        """{"section.key": value} of every key (model.mdlmpe as its MDLMPEConfig)."""
        return {f"{s}.{k}": v for s in SECTIONS for k, v in vars(getattr(self, s)).items()}


SECTIONS: dict[str, type] = {
    "model": ModelChoice,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "attention": AttentionImpl,
}


def _numbers(tree: Any, prefix: str = "") -> list[tuple[str, float]]:
    """Every float of a nested config dict (tuples included) with its dotted key."""
    if isinstance(tree, dict):
        return [n for k, v in tree.items() for n in _numbers(v, f"{prefix}.{k}" if prefix else k)]
    if isinstance(tree, (list, tuple)):
        return [n for v in tree for n in _numbers(v, prefix)]
    return [(prefix, tree)] if isinstance(tree, float) else []


KEY_ALIASES = {"dataset_split": "data.split"}  # the spelling of the issue tracker / HF scripts
