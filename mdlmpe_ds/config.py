"""Typed training configuration for SFT and pretraining runs: model choice, data, optimisation, loop.

One `RunConfig` (five sections) is built from dataclass defaults (the embedded CPU demo), then an
optional `--config file.json|yaml`, then `--key value` command-line overrides, and is validated
before anything is built. It is saved as `config.json` into every checkpoint, so a resume can
check that it continues the same model.

Keys are addressed as `section.key` (`--optim.lr 1e-5`) or, when unambiguous, by the bare key
(`--lr 1e-5`, `--model_name_or_path DIR`, `--dataset FILE`). An unknown key is an error that lists
the valid ones.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mdlmpe_ds.attention.impl import AttentionImpl
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


@dataclass
class ModelChoice:
    """Which backbone: a preset name (from-scratch/tiny), a local Hugging Face directory or hub id."""

    preset: str = "llada-tiny"
    # A local LLaDA-8B / Dream-7B directory (config.json + safetensors) or a hub id such as
    # GSAI-ML/LLaDA-8B-Instruct (snapshot_download; HF_HUB_OFFLINE honoured); overrides `preset`.
    model_name_or_path: str | None = None
    # Hub revision (branch, tag or commit) of a hub-id model_name_or_path / tokenizer.
    revision: str | None = None
    position_encoding: str = "mdlmpe"
    # Vocabulary and special ids of a preset model; None derives them from the tokenizer (vocab
    # rounded up to a multiple of 64; mask = the tokenizer's mask token or <|mask|>; eos; pad = eos).
    # A pretrained directory always keeps its own.
    vocab_size: int | None = None
    mask_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # MDLMPE's method keys (pe/config.py MDLMPEConfig): a JSON object merged into the defaults
    # (--model.mdlmpe '{"tau_max": 0.2}') or one key (--model.mdlmpe.tau_max 0.2); max_seq_len -1
    # follows data.max_len. How the attention runs is the `attention` section, not a model key.
    mdlmpe: MDLMPEConfig = field(default_factory=lambda: MDLMPEConfig(max_seq_len=FOLLOW_MODEL))
    # Run-time memory choices, passed at model build (RunConfig.recompute(), models/recompute.py),
    # never stored in the model's config: checkpoint every layer; with it, also recompute the
    # MDLMPE attention in the layer checkpoint (less memory, one more attention forward per layer).
    gradient_checkpointing: bool = True
    recompute_mdlmpe_attention: bool = False
    # LoRA SFT (mdlmpe_ds/lora.py), e.g. "r=16,alpha=32,dropout=0.05,targets=q,k,v,o,gate,up,down"
    # (a config file may give the mapping {r, alpha, dropout, targets}): the backbone frozen, LoRA
    # adapters on the target projections, the MDLMPE parameters trained in full. None: full fine-tune.
    lora: str | None = None


@dataclass
class DataConfig:
    """SFT chat data in the `messages` format (hub name or local json/jsonl/parquet)."""

    # "chat-demo" = the chatterbot-corpus dialogues prepared offline (data/assets.py).
    dataset: str = "chat-demo"
    # A hub dataset's config name (HuggingFaceTB/smoltalk needs "all"); `dataset` may also say
    # "name:config". `--dataset_split` is another spelling of `split`.
    dataset_config: str | None = None
    split: str = "train"
    # Tokenizer directory; None = the model directory, or the offline Qwen2.5 tokenizer for presets.
    tokenizer: str | None = None
    max_len: int = 128
    skip_malformed: bool = False
    multiturn: str = "last"
    # Mark EOS padding invalid (not attended, not in the loss) instead of the official convention.
    attend_padding: bool = True
    # Dream-train's per-batch cutoff (its OptimizedCollateFunction; data/sft.py SFTCollator). Off
    # ("none") for both families here; Dream-train's official Tulu-3 recipe turns it on with
    # "random_with_input_pad": prompts are left-padded to the batch's longest (those pads are never
    # attended, masked or trained; RoPE and MDLMPE positions start at each row's first real token)
    # and every response is cut to, or EOS-padded up to, the response length of one row drawn from
    # the batch, which trains less on EOS padding. "random": every row is cut to the length of one
    # drawn row. The draw is keyed by the batch (sampler epoch, sample indices): resumable.
    perbatch_cutoff: str = "none"
    # Dream-train's resp_cutoff_ratio: the probability, per batch, of also cutting c ~ U{1..m-1}
    # columns off the end of the batch (m = the smallest answer length in it). 0 = never.
    resp_cutoff_ratio: float = 0.0
    # Round each batch's width (longest row) up to a multiple of this, capped at max_len; the extra
    # columns are EOS padding like the rest. With the compiled MDLMPE attention
    # (attention.compile) every distinct width is a new graph, so a multiple such as 64 bounds
    # the compiles (torch.compile stops at 8 per graph and falls back to eager). None: no rounding.
    pad_to_multiple_of: int | None = None
    # ---- pretraining only (launch/pretrain.py; SFT ignores these) ----
    # `dataset` is then a text corpus: a named one of data/corpora.py ("shakespeare", "ptb", ...),
    # local .txt files (comma-separated, or a directory), a local .jsonl/.parquet file or a hub
    # corpus with a `text_column`. `max_len` is the packed sequence length.
    # How a .txt file is cut into documents: "file", "paragraph" or "line"; None = the named
    # corpus's own convention ("file" for unnamed files).
    text_split: str | None = None
    text_column: str = "text"
    max_documents: int | None = None
    # Held-out corpus for the validation perplexity logged during pretraining (same forms as `dataset`).
    validation: str | None = None
    # SentencePiece BPE size when no `tokenizer` is given: one is trained on the corpus and cached.
    tokenizer_vocab: int = 4096
    # Where corpora are tokenised into token stores (data/token_store.py); None = <output_dir>/data_cache.
    # Runs sharing one (the encodings of a comparison) tokenise OpenWebText once.
    store_dir: str | None = None
    # Processes tokenising a store's build on each node's first rank (same ids as one process);
    # None: the node's CPUs (up to 32) for the named hub corpora (openwebtext...), else 1.
    build_workers: int | None = None


@dataclass
class OptimConfig:
    """AdamW + linear warmup + cosine decay, gradient clipping (Dream SFT defaults where sensible)."""

    # None: 3e-3 for a from-scratch preset (the CPU demo), 1e-5 for a pretrained directory (an 8B
    # model must never get the demo's rate by default). See `RunConfig.lr`.
    lr: float | None = None
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    # Warmup length: warmup_steps if set, else round(warmup_ratio * total updates).
    warmup_ratio: float = 0.1
    warmup_steps: int | None = None
    cosine: bool = True
    # Cosine floor as a fraction of lr.
    min_lr_ratio: float = 0.1
    clip: float = 1.0


@dataclass
class TrainConfig:
    """The loop: batch arithmetic, length, checkpoints, logging, loss family, head schedule."""

    micro_batch_size: int = 4
    grad_accum: int = 1
    # Optimizer updates; when None, `epochs` over the data decides.
    max_steps: int | None = 40
    epochs: float = 1.0
    # Stop (with a checkpoint) after this update although the schedule spans max_steps: for jobs in
    # time-limited slots; continue later with --resume auto. None = run to the end.
    stop_at: int | None = None
    seed: int = 1234
    save_every: int = 20
    keep_last: int = 2
    output_dir: str = "outputs/sft-demo"
    # A run without --resume refuses an output_dir that already holds checkpoints; true deletes that
    # earlier run's checkpoints, metrics and TensorBoard logs first (the Trainer convention).
    overwrite_output_dir: bool = False
    # Resuming on other data or another tokenizer than the checkpoint's is refused unless true.
    allow_data_change: bool = False
    # SIGTERM/SIGINT (a preemption): finish the update, save a checkpoint, exit with code 143/130.
    # A rank whose launcher died stops the same way, then exits after at most this many seconds.
    orphan_grace_s: float = 60.0
    # What a stopped run (SIGTERM/SIGINT, a lost launcher) writes after its last update: "full" (a
    # checkpoint that resumes exactly), "model" (the model weights only, one file per rank, a sixth
    # of a full checkpoint in bf16: exported like a checkpoint, never resumed; docs/resume.md) or
    # "none" (stop at once; resume from the last periodic checkpoint).
    save_on_signal: str = "full"
    log_every: int = 1
    # Loss family: "auto" follows the model family (LLaDA: 1/p weighted, answer-length normalised;
    # Dream: 1/t / CART weighting normalised by masked-token count).
    loss: str = "auto"
    # Dream's official SFT weighting is CART with p = 0.1 (docs/models.md §3.5).
    dream_weighting: str = "cart"
    cart_p: float = 0.1
    noise_eps: float = 1e-3
    # Pretraining corruption layout (diffusion/layouts.py): "iid" (LLaDA's), "semi_ar", "spans", "mix".
    corruption: str = "iid"
    # Block-diffusion SFT (paper §3.4, §4.4): one active response block per example, earlier blocks
    # clean, later blocks masked ("full") or hidden from attention and availability ("blocked").
    # None trains on the whole response at once.
    block_size: int | None = None
    block_context: str = "full"
    head_schedule: bool = True
    max_consecutive_nonfinite: int = 3
    # "auto": the ds config's precision on GPU, fp32 on a CPU-only machine (bf16 there is slow).
    precision: str = "auto"
    # Distributed timeout (minutes): a collective reached by one rank only fails instead of hanging.
    dist_timeout_min: float = 10.0
    # How long (minutes) the other ranks wait while each node's first rank builds the data
    # (tokenising a large corpus once, into the cache); training collectives keep dist_timeout_min.
    setup_timeout_min: float = 60.0
    # Pretraining validation: diffusion-ELBO perplexity on the first `eval_sequences` packed sequences
    # of data.validation, `eval_samples` (t, mask) draws each, every `eval_every` updates (0 = only at
    # the end). The draws depend on (seed, sequence index, sample) only: every run sees the same masks.
    eval_every: int = 0
    eval_sequences: int = 16
    eval_samples: int = 4


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
        if m.model_name_or_path is not None and not Path(m.model_name_or_path).is_dir():
            from mdlmpe_ds.hub.resolve import looks_like_hub_id

            if not looks_like_hub_id(m.model_name_or_path):
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
            from mdlmpe_ds.lora_spec import parse

            m.lora = parse(m.lora, "model.lora").text()
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
        if not o.clip > 0:
            raise bad("optim.clip", o.clip, "must be > 0")
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
        from mdlmpe_ds.models.recompute import Recompute

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

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> RunConfig:
        config = cls()
        apply_overrides(config, flatten(data, source), source)
        return config


SECTIONS = ("model", "data", "optim", "train", "attention")


def _numbers(tree: Any, prefix: str = "") -> list[tuple[str, float]]:
    """Every float of a nested config dict (tuples included) with its dotted key."""
    if isinstance(tree, dict):
        return [n for k, v in tree.items() for n in _numbers(v, f"{prefix}.{k}" if prefix else k)]
    if isinstance(tree, (list, tuple)):
        return [n for v in tree for n in _numbers(v, prefix)]
    return [(prefix, tree)] if isinstance(tree, float) else []


KEY_ALIASES = {"dataset_split": "data.split"}  # the spelling of the issue tracker / HF scripts


def flatten(data: dict[str, Any], source: str) -> dict[str, Any]:
    """{"optim": {"lr": 1}} or {"optim.lr": 1} or {"lr": 1} -> {"optim.lr"/"lr": 1} (mdlmpe kept whole)."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            for sub, subvalue in value.items():
                flat[f"{key}.{sub}"] = subvalue
        else:
            flat[key] = value
    return flat


def valid_keys() -> list[str]:
    return [f"{section}.{f.name}" for section in SECTIONS for f in fields(_section_type(section))]


def _section_type(section: str) -> type:
    types_ = {"model": ModelChoice, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig}
    return {**types_, "attention": AttentionImpl}[section]


def resolve_key(key: str, source: str) -> tuple[str, str]:
    """'optim.lr' or 'lr' -> ('optim', 'lr'); unknown or ambiguous keys raise listing valid keys."""
    key = KEY_ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
    if key.startswith("model.mdlmpe."):  # one MDLMPE method key
        return "model", key.removeprefix("model.")
    if "." in key:
        section, name = key.split(".", 1)
        if section in SECTIONS and name in {f.name for f in fields(_section_type(section))}:
            return section, name
    else:
        owners = [s for s in SECTIONS if key in {f.name for f in fields(_section_type(s))}]
        if len(owners) == 1:
            return owners[0], key
        if len(owners) > 1:
            raise ValueError(
                f"{source}: key {key!r} is ambiguous, write one of {[f'{s}.{key}' for s in owners]}"
            )
    raise ValueError(f"{source}: unknown key {key!r}; valid keys are {', '.join(valid_keys())}")


def _field_type(section: str, name: str) -> Any:
    hints = typing.get_type_hints(_section_type(section))
    return hints[name]


def coerce(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Convert a CLI string / JSON value to the field's type; None allowed for `X | None` fields."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return coerce(value, non_none[0], key, source)
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError("expected true/false")
        if annotation is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            return int(value)
        if annotation is float:
            return float(value)
        if annotation is str:
            if not isinstance(value, str):
                raise ValueError("expected a string")
            return value
        if origin is tuple:
            items = json.loads(value) if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)) or len(items) != len(args):
                raise ValueError(f"expected {len(args)} values")
            return tuple(coerce(v, a, key, source) for v, a in zip(items, args))
        if origin is dict:
            items = json.loads(value) if isinstance(value, str) else value
            if not isinstance(items, dict):
                raise ValueError("expected a mapping (JSON object)")
            return dict(items)
    except (ValueError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"{source}: bad value {value!r} for {key}: {err}") from err
    raise TypeError(f"{source}: no conversion for {key} of type {annotation}")


def apply_overrides(config: RunConfig, overrides: dict[str, Any], source: str) -> None:
    for key, value in overrides.items():
        section, name = resolve_key(key, source)
        target = getattr(config, section)
        if section == "model" and name == "lora" and isinstance(value, dict):  # a config-file section
            from mdlmpe_ds.lora_spec import from_mapping

            target.lora = from_mapping(value, f"{source}: model.lora").text()
            continue
        if section == "model" and name.startswith("mdlmpe"):
            changes = {name.removeprefix("mdlmpe."): value} if "." in name else None
            if changes is None:
                changes = coerce(value, dict[str, Any], "model.mdlmpe", source)
            target.mdlmpe = _updated_mdlmpe(target.mdlmpe, changes, source)
            continue
        setattr(target, name, coerce(value, _field_type(section, name), f"{section}.{name}", source))


def _updated_mdlmpe(mdlmpe: MDLMPEConfig, changes: dict[str, Any], source: str) -> MDLMPEConfig:
    """``mdlmpe`` with ``changes`` applied, each value converted to its field's type; a moved key
    (backend, block_size, ...) says where it went, an unknown one lists the known keys."""
    try:
        MDLMPEConfig.check_keys(changes)
    except ValueError as err:
        raise ValueError(f"{source}: model.mdlmpe: {err}") from err
    hints = typing.get_type_hints(MDLMPEConfig)
    typed = {k: coerce(v, hints[k], f"model.mdlmpe.{k}", source) for k, v in changes.items()}
    return dataclasses.replace(mdlmpe, **typed)


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training config file not found: {path}")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml  # PyYAML comes with transformers/datasets; only needed for YAML files

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:  # its own text names "<unicode string>", not the file
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"{path}:{where}: not valid YAML: {problem}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON: {err}") from err
    return flatten(data or {}, str(path))


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    """['--optim.lr', '1e-5', '--dataset=x.jsonl'] -> {'optim.lr': '1e-5', 'dataset': 'x.jsonl'}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise ValueError(f"command line: expected --key value, got {token!r}")
        if "=" in token:
            key, value = token[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise ValueError(f"command line: {token} needs a value")
            key, value = token[2:], tokens[i + 1]
            i += 2
        out[key] = value
    return out


def build_config(
    config_file: str | None, cli_tokens: list[str], defaults: dict[str, Any] | None = None
) -> RunConfig:
    """Dataclass defaults <- ``defaults`` (a launcher's own, e.g. pretraining's) <- config file <-
    command line, then validate()."""
    config = RunConfig()
    if defaults:
        apply_overrides(config, flatten(defaults, "launcher defaults"), "launcher defaults")
    if config_file is not None:
        apply_overrides(config, load_config_file(config_file), str(config_file))
    apply_overrides(config, parse_overrides(cli_tokens), "command line")
    return config.validate()


# ------------------------------------------------------------------ --help
# One line for the keys whose meaning has no comment above its field.
_KEY_HELP = {
    "model.preset": "named backbone (models/presets.py) when no model_name_or_path is given",
    "model.position_encoding": f"one of {POSITION_ENCODINGS}",
    "model.model_name_or_path": "pretrained LLaDA/Dream: a local directory or a hub id (overrides preset)",
    "model.vocab_size": "preset vocabulary; None: the tokenizer's size rounded up to a multiple of 64",
    "model.mask_token_id": "preset mask id; None: the tokenizer's mask token, else the preset's own",
    "model.eos_token_id": "preset EOS id; None: the tokenizer's",
    "model.pad_token_id": "preset pad id; None: the EOS id",
    "model.mdlmpe": "MDLMPE knobs as JSON, e.g. '{\"tau_max\": 0.2}'",
    "attention.backend": "MDLMPE attention: auto (triton on CUDA, else blocked), reference, blocked, triton",
    "attention.query_block": "query rows per block of the blocked MDLMPE attention",
    "attention.tile": "Triton kernel tile (power of 2, <= 64); None: chosen per GPU",
    "attention.compile": "run the blocked MDLMPE attention through torch.compile (same numbers)",
    "attention.pair_buffer_gib": "most GiB of the Triton kernels' transient pair buffers per launch",
    "model.gradient_checkpointing": "activation checkpointing per layer",
    "data.dataset": "chat data: 'chat-demo', a .json/.jsonl/.parquet file, a directory, a hub name[:config]",
    "data.tokenizer": "tokenizer directory or hub id; None: the model's (or the demo's)",
    "data.attend_padding": "true: EOS padding is attended and trained (official); false: invalid",
    "data.perbatch_cutoff": f"Dream-train's per-batch response cutoff, one of {PERBATCH_CUTOFFS}",
    "data.resp_cutoff_ratio": "Dream-train's probability per batch of cutting extra end columns",
    "data.text_split": f"pretraining .txt documents: one of {TEXT_SPLITS}; None: the corpus's own",
    "optim.warmup_steps": "warmup updates (overrides warmup_ratio)",
    "train.max_steps": "optimizer updates; None: `epochs` over the data decide",
    "train.epochs": "passes over the data when max_steps is None",
    "train.loss": f"loss family, one of {LOSS_FAMILIES} ('auto': the model's family)",
    "train.block_size": "block-diffusion SFT block length; None: the whole response at once",
    "train.eval_every": "pretraining validation perplexity every N updates (0: only at the end)",
    "train.eval_sequences": "packed validation sequences scored",
    "train.eval_samples": "(t, mask) draws per validation sequence",
    "data.split": "dataset split to train on (also --dataset_split)",
    "data.max_len": "sequence length: SFT rows are truncated to it; pretraining packs windows of it",
    "data.skip_malformed": "count and skip malformed rows instead of failing on the first",
    "data.multiturn": "multi-turn rows: 'last' answer, 'expand' to every turn, 'sample' one turn (LLaDA)",
    "data.text_column": "column holding the text of a .jsonl/.parquet or hub corpus",
    "data.build_workers": "processes tokenising a token store (None: the CPUs for named hub corpora, else 1)",
    "data.store_dir": "folder of the pretraining token stores (share it across runs); None: <run>/data_cache",
    "data.max_documents": "keep only the first N documents of the corpus",
    "optim.betas": "AdamW (beta1, beta2), e.g. '[0.9, 0.95]'",
    "optim.eps": "AdamW epsilon",
    "optim.weight_decay": "AdamW weight decay",
    "optim.cosine": "cosine decay after warmup (false: constant)",
    "optim.clip": "gradient-norm clipping threshold",
    "train.micro_batch_size": "sequences per rank per forward (must agree with the ds config)",
    "train.grad_accum": "micro-batches accumulated per optimizer update",
    "train.seed": "seed of initialisation, data order and corruption draws",
    "train.save_every": "checkpoint every N updates",
    "train.keep_last": "complete checkpoints kept",
    "train.output_dir": "run directory: checkpoints, metrics, TensorBoard logs",
    "train.log_every": "log metrics every N updates",
    "train.dream_weighting": f"Dream loss weighting, one of {DREAM_WEIGHTINGS} (official SFT: cart)",
    "train.cart_p": "CART geometric-kernel p (official 0.1)",
    "train.noise_eps": "LLaDA's mask-probability floor p = (1 - eps) t + eps",
    "train.block_context": "block diffusion: later blocks 'full' (masked) or 'blocked' (hidden)",
    "train.head_schedule": "SFT: switch MDLMPE on head by head between 10% and 90% of training",
    "train.max_consecutive_nonfinite": "stop after this many non-finite updates in a row",
}


def _field_comments(cls: type) -> dict[str, str]:
    """The comment lines right above each field of dataclass ``cls``, joined (its documentation)."""
    import inspect
    import re

    out: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        match = re.match(r"^(\w+): ", stripped)
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
        elif match:
            if pending:
                out[match.group(1)] = " ".join(p for p in pending if not p.startswith("----"))
            pending = []
        else:
            pending = []
    return out


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    return text or str(annotation).replace("typing.", "")


def _first_sentence(text: str, limit: int = 150) -> str:
    import re

    text = re.split(r"(?<!e\.g)(?<!i\.e)\. |; ", text, maxsplit=1)[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def help_text(defaults: dict[str, Any] | None = None, recipes: list[str] | None = None) -> str:
    """Every training-config key grouped by section: ``--key TYPE (default D)  meaning`` (the --help
    of the launchers). ``defaults``: a launcher's own defaults shown instead of the dataclass ones."""
    base = RunConfig()
    if defaults:
        apply_overrides(base, flatten(defaults, "launcher defaults"), "launcher defaults")
    lines = [
        "training-config keys (--key VALUE or --section.key VALUE; a --config file takes the same keys;",
        "the command line wins over the file, the file over --recipe, the recipe over these defaults):",
    ]
    if recipes:
        lines.append(
            f"  --recipe NAME     the paper's values for one run, printed at start: {', '.join(recipes)}"
        )
    for section in SECTIONS:
        cls = _section_type(section)
        comments = _field_comments(cls)
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        lines.append(f"\n{section}: {doc}")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            key = f"{section}.{f.name}"
            meaning = _KEY_HELP.get(key) or _first_sentence(comments.get(f.name, "")) or "-"
            default = getattr(getattr(base, section), f.name)
            lines.append(f"  --{f.name} {_type_name(hints[f.name])} (default {default!r})")
            lines.append(f"        {meaning}")
    aliases = ", ".join(f"--{a} = --{k}" for a, k in KEY_ALIASES.items())
    lines.append(f"\naliases: {aliases}")
    return "\n".join(lines)
