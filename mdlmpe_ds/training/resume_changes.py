"""What a resumed run may change: one table, the one place that decides, for every run-config key.

A resumed run compares its run config with the one its checkpoint recorded (``config.json``) before
any data or engine work. Every changed key falls into one of four kinds:

- ``applied``: the new value takes effect from the resumed update on. For the optimizer keys this
  needs work: DeepSpeed restores the optimizer's param groups and the LambdaLR's base lrs from the
  checkpoint, so the trainer writes the new values back after loading (engine.apply_optim_settings);
- ``runtime``: how the run executes, not what it computes (paths, timeouts, the attention
  backend): used as given;
- ``checked``: what it decides is compared by content elsewhere -- the model config
  (checkpoint.check_same_model) or the data fingerprint (checkpoint.check_same_data) -- so a moved
  dataset or model directory resumes, and other content is refused there by name;
- ``refused``: it changes what the run trains (objective, corruption, batch arithmetic, data order,
  precision); refused naming the key, unless ``--allow_config_change KEY`` forces it (then the new
  value is used and the change is logged as forced). ``NEVER_FORCED`` keys cannot be forced: the
  checkpoint would not load, or the sampler could not continue at its position.

A key whose value may be "auto" (``RESOLVED_KEYS``: train.precision) is compared by what it
resolved to on each side when both are known (the checkpoint records it in config.json's
"resolved"): "auto" that meant bf16 at save and means fp32 here is a change, shown as
``auto (resolved to bf16) -> auto (resolved to fp32)``.

Every change that is not refused is logged as ``changed on resume: KEY OLD -> NEW (kind)``.
tests/unit/test_resume_changes.py fails when a run-config key has no entry here, and checks that
docs/resume.md shows this table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mdlmpe_ds.config.cli import canonical_key

APPLIED, RUNTIME, CHECKED, REFUSED = "applied", "runtime", "checked", "refused"
#: Refused keys that --allow_config_change cannot force: the checkpoint could not be loaded at all
#: (LoRA shapes, precision), or the sampler could not continue at its position
#: (data/sampler.py:load_state_dict refuses another micro_batch_size or seed once the engine is
#: built, minutes later on a large model: refused here instead, before any data or engine work).
NEVER_FORCED = ("model.lora", "train.precision", "train.micro_batch_size", "train.seed")
#: Keys that may say "auto": compared by what they resolved to (the machine, the ds config).
RESOLVED_KEYS = ("train.precision",)
AUTO = "auto"
#: (at save, now): what each of RESOLVED_KEYS resolved to on either side (None: not known).
Resolved = tuple[Mapping[str, Any], Mapping[str, Any]]

_MODEL = "compared through the model config (checkpoint.check_same_model)"
_DATA = "compared through the data fingerprint (--allow_data_change true to continue on other data)"
_WHERE = "where files go or how long to wait; the numbers do not change"
_SCHEDULE = "the lr schedule is rebuilt with it and continues at the resumed update"
_PRECISION = "DeepSpeed's optimizer state differs between fp32 and bf16"
_MICRO_BATCH = "the sampler position counts micro-batches of the saved size"
_SEED = "decides the data order and every noise draw"

#: key -> (kind, what happens). Keys of model.mdlmpe are listed one by one.
RESUME_CHANGES: dict[str, tuple[str, str]] = {
    "model.preset": (CHECKED, _MODEL),
    "model.model_name_or_path": (CHECKED, _MODEL + "; a moved directory resumes"),
    "model.revision": (CHECKED, _MODEL),
    "model.position_encoding": (CHECKED, _MODEL),
    "model.vocab_size": (CHECKED, _MODEL),
    "model.mask_token_id": (CHECKED, _MODEL),
    "model.eos_token_id": (CHECKED, _MODEL),
    "model.pad_token_id": (CHECKED, _MODEL),
    "model.mdlmpe.max_seq_len": (CHECKED, _MODEL),
    "model.mdlmpe.window_ratio": (CHECKED, _MODEL),
    "model.mdlmpe.rho": (CHECKED, _MODEL),
    "model.mdlmpe.eps": (CHECKED, _MODEL),
    "model.mdlmpe.clip_kappa": (CHECKED, _MODEL),
    "model.mdlmpe.gamma_max": (CHECKED, _MODEL),
    "model.mdlmpe.gamma_init": (CHECKED, _MODEL),
    "model.mdlmpe.tau_max": (CHECKED, _MODEL),
    "model.mdlmpe.phase_hidden": (CHECKED, _MODEL),
    "model.mdlmpe.use_gaussian": (CHECKED, _MODEL),
    "model.mdlmpe.coordinate": (CHECKED, _MODEL),
    "model.mdlmpe.use_embedding": (CHECKED, _MODEL),
    "model.mdlmpe.phase_mlp": (CHECKED, _MODEL),
    "model.gradient_checkpointing": (RUNTIME, "backward recomputes the same forward: same numbers"),
    "model.recompute_mdlmpe_attention": (RUNTIME, "backward recomputes the same forward: same numbers"),
    "model.lora": (
        REFUSED,
        "a LoRA and a full fine-tune checkpoint hold different parameters, as do two LoRA runs of "
        "another r or targets (never forced); another alpha or dropout may be forced",
    ),
    "data.dataset": (CHECKED, _DATA + "; a moved file resumes"),
    "data.dataset_config": (CHECKED, _DATA),
    "data.split": (CHECKED, _DATA),
    "data.tokenizer": (CHECKED, _DATA + "; a moved directory resumes"),
    "data.max_len": (CHECKED, _MODEL + " and the data fingerprint"),
    "data.skip_malformed": (CHECKED, _DATA),
    "data.multiturn": (CHECKED, _DATA),
    "data.text_split": (CHECKED, _DATA),
    "data.text_column": (CHECKED, _DATA),
    "data.max_documents": (CHECKED, _DATA),
    "data.tokenizer_vocab": (CHECKED, _DATA),
    "data.attend_padding": (REFUSED, "changes which positions are attended and trained"),
    "data.perbatch_cutoff": (REFUSED, "changes the batches trained on"),
    "data.resp_cutoff_ratio": (REFUSED, "changes the batches trained on"),
    "data.pad_to_multiple_of": (REFUSED, "with attended padding, the extra EOS columns are trained"),
    "data.validation": (APPLIED, "the validation set from the resumed update on (the curve restarts)"),
    "data.store_dir": (RUNTIME, _WHERE),
    "data.build_workers": (RUNTIME, "the token ids are the same with any number of workers"),
    "optim.lr": (APPLIED, "the peak lr; " + _SCHEDULE),
    "optim.betas": (APPLIED, "written into the optimizer's param groups after loading"),
    "optim.eps": (APPLIED, "written into the optimizer's param groups after loading"),
    "optim.weight_decay": (APPLIED, "written into the optimizer's param groups after loading"),
    "optim.warmup_ratio": (APPLIED, _SCHEDULE),
    "optim.warmup_steps": (APPLIED, _SCHEDULE),
    "optim.cosine": (APPLIED, _SCHEDULE),
    "optim.min_lr_ratio": (APPLIED, _SCHEDULE),
    "optim.clip": (APPLIED, "DeepSpeed's gradient_clipping, read at every step"),
    "train.micro_batch_size": (
        REFUSED,
        _MICRO_BATCH + " (never forced); train.grad_accum may be forced to change the global batch",
    ),
    "train.grad_accum": (REFUSED, "the sampler position and the noise stream count micro-batches"),
    "train.max_steps": (APPLIED, "the new total: the lr cosine and the head schedule stretch to it"),
    "train.epochs": (APPLIED, "the new total: the lr cosine and the head schedule stretch to it"),
    "train.stop_at": (APPLIED, "this job's stopping update"),
    "train.seed": (
        REFUSED,
        _SEED + " (never forced): the sampler position is a place in the saved seed's order",
    ),
    "train.save_every": (APPLIED, "checkpoint cadence"),
    "train.keep_last": (APPLIED, "checkpoints kept"),
    "train.output_dir": (RUNTIME, _WHERE + "; a copied run resumes"),
    "train.overwrite_output_dir": (RUNTIME, "only read by a run that does not resume"),
    "train.allow_data_change": (RUNTIME, "this job's permission"),
    "train.orphan_grace_s": (RUNTIME, _WHERE),
    "train.save_on_signal": (RUNTIME, "what this job writes when it is stopped"),
    "train.log_every": (
        APPLIED,
        "cadence of the MDLMPE gamma and phase delta statistics (the other metrics: every update)",
    ),
    "train.loss": (REFUSED, "changes the objective"),
    "train.dream_weighting": (REFUSED, "changes the objective"),
    "train.cart_p": (REFUSED, "changes the objective"),
    "train.noise_eps": (REFUSED, "changes the corruption"),
    "train.corruption": (REFUSED, "changes the corruption"),
    "train.block_size": (REFUSED, "changes what is trained"),
    "train.block_context": (REFUSED, "changes what is trained"),
    "train.head_schedule": (REFUSED, "changes which MDLMPE heads are active"),
    "train.max_consecutive_nonfinite": (APPLIED, "this job's stopping rule"),
    "train.precision": (
        REFUSED,
        "compared as resolved (auto: bf16 or fp32, recorded at save); " + _PRECISION,
    ),
    "train.dist_timeout_min": (RUNTIME, _WHERE),
    "train.setup_timeout_min": (RUNTIME, _WHERE),
    "train.eval_every": (APPLIED, "validation cadence"),
    "train.eval_sequences": (APPLIED, "the validation set from the resumed update on (the curve restarts)"),
    "train.eval_samples": (APPLIED, "draws per validation sequence"),
    "attention.backend": (RUNTIME, "every backend computes the spec's numbers"),
    "attention.query_block": (RUNTIME, "every backend computes the spec's numbers"),
    "attention.tile": (RUNTIME, "every backend computes the spec's numbers"),
    "attention.compile": (RUNTIME, "every backend computes the spec's numbers"),
    "attention.pair_buffer_gib": (RUNTIME, "every backend computes the spec's numbers"),
}


@dataclass(frozen=True)
class Change:
    """``before`` and ``after`` as written; ``resolved``: (at save, now) for a key compared by what
    it resolved to (RESOLVED_KEYS), else None."""

    key: str
    before: Any
    after: Any
    kind: str
    resolved: tuple[Any, Any] | None = None

    def values(self) -> str:
        """``OLD -> NEW``, each with what it resolved to when that is not the value as written."""
        was, now = self.resolved or (None, None)
        return f"{_show(self.before, was)} -> {_show(self.after, now)}"

    def describe(self) -> str:
        return f"{self.key} {self.values()} ({self.kind})"


def _show(value: Any, resolved: Any = None) -> str:
    shown = "null" if value is None else str(value) if not isinstance(value, list) else json.dumps(value)
    return shown if resolved is None or resolved == value else f"{shown} (resolved to {resolved})"


def flat(run_config: dict[str, Any]) -> dict[str, Any]:
    """{"optim": {"lr": 1}, "model": {"mdlmpe": {"rho": 1}}} -> {"optim.lr": 1, "model.mdlmpe.rho": 1},
    values as JSON stores them (tuples -> lists), optim.lr as the effective peak lr."""
    out: dict[str, Any] = {}
    for section, values in json.loads(json.dumps(run_config, default=str)).items():
        for key, value in (values or {}).items():
            if isinstance(value, dict):
                out.update({f"{section}.{key}.{sub}": v for sub, v in value.items()})
            else:
                out[f"{section}.{key}"] = value
    if out.get("optim.lr", 0) is None:  # RunConfig.lr: the default depends on the model source
        out["optim.lr"] = 1e-5 if out.get("model.model_name_or_path") is not None else 3e-3
    return out


def changes(saved: dict[str, Any], now: dict[str, Any], resolved: Resolved | None = None) -> list[Change]:
    """The keys whose value differs between the checkpoint's run config and this run's (of
    RESOLVED_KEYS: what they resolved to, where both sides know it). A key the checkpoint did not
    record (added since) is not a change."""
    before, after = flat(saved), flat(now)
    out = []
    for key in sorted(after):
        if key not in before:
            continue
        kind = RESUME_CHANGES.get(key, (REFUSED, ""))[0]
        pair = _resolved_pair(key, before[key], after[key], resolved)
        if pair is not None and pair[0] != pair[1]:
            out.append(Change(key, before[key], after[key], kind, pair))
        elif pair is None and before[key] != after[key]:
            out.append(Change(key, before[key], after[key], kind))
    return out


def _resolved_pair(key: str, before: Any, after: Any, resolved: Resolved | None) -> tuple[Any, Any] | None:
    """(at save, now) that ``key`` resolved to, or None when it is not one of RESOLVED_KEYS or a side
    is unknown: "auto" in a checkpoint written before the record (compared as written, as then)."""
    if key not in RESOLVED_KEYS or resolved is None:
        return None
    pair = (_resolution(before, resolved[0].get(key)), _resolution(after, resolved[1].get(key)))
    return None if None in pair else pair


def _resolution(written: Any, record: Any) -> Any:
    """What one side resolved to: its record, else the value as written unless that is "auto"
    (None: unknown)."""
    if record is not None:
        return record
    return None if written == AUTO else written


def parse_allowed(values: list[str] | None) -> set[str]:
    """``--allow_config_change`` values (repeated and/or comma lists) -> full key names; an unknown
    key is an error listing the refused ones."""

    out = set()
    for value in values or []:
        for item in filter(None, (v.strip() for v in value.split(","))):
            out.add(canonical_key(item, "--allow_config_change"))
    return out


def check_resume_config(
    saved: dict[str, Any],
    now: dict[str, Any],
    allowed: set[str],
    checkpoint,
    resolved: Resolved | None = None,
) -> list[str]:
    """The lines to log for the changes a resume makes; raises ValueError naming every refused key
    that ``allowed`` does not force. ``resolved``: what RESOLVED_KEYS resolved to at save (the
    checkpoint's record) and now (this run's ds config)."""
    found = changes(saved, now, resolved)
    refused = [c for c in found if c.kind == REFUSED and (c.key not in allowed or _never_forced(c))]
    if refused:
        lines = "\n  ".join(f"{c.key}: {c.values()} ({_why(c)})" for c in refused)
        forceable = [c.key for c in refused if not _never_forced(c)]
        force = f", or pass --allow_config_change {','.join(forceable)} to continue with the new ones"
        raise ValueError(
            f"checkpoint {checkpoint} was trained with other settings that a resume may not change "
            f"(docs/resume.md):\n  {lines}\nResume with the checkpoint's values"
            f"{force if forceable else ''}"
        )
    return [
        f"changed on resume: {c.describe()}"
        if c.kind != REFUSED
        else f"changed on resume: {c.key} {c.values()} (forced by --allow_config_change)"
        for c in found
    ]


#: LoRA settings that leave the adapters' shapes alone (the checkpoint still loads): a resume may be
#: forced across them. r and targets decide which adapter tensors exist and their shapes.
LORA_SCALE_KEYS = ("alpha", "dropout")


def _lora_differences(change: Change) -> dict[str, tuple[Any, Any]]:
    """{LoRA setting: (before, after)} of a change of model.lora between two LoRA runs."""
    from mdlmpe_ds.lora import spec as lora_spec

    was, now = lora_spec.parse(change.before).to_dict(), lora_spec.parse(change.after).to_dict()
    return {k: (was[k], now[k]) for k in was if was[k] != now[k]}


def _never_forced(change: Change) -> bool:
    """A refused change that --allow_config_change cannot force: NEVER_FORCED keys, except a LoRA
    run's alpha or dropout (the adapters load; the change is the user's to make)."""
    if change.key not in NEVER_FORCED:
        return False
    if change.key == "model.lora" and change.before is not None and change.after is not None:
        return not set(_lora_differences(change)) <= set(LORA_SCALE_KEYS)
    return True


def _why(change: Change) -> str:
    if change.key == "model.lora" and change.before is not None and change.after is not None:
        diff = _lora_differences(change)
        shown = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items())
        if not _never_forced(change):
            return (
                f"the LoRA settings differ: {shown}; alpha scales the adapters' output and dropout "
                "regularises their input, so the run would continue under another objective"
            )
        return (
            f"the LoRA settings differ: {shown}; r and targets decide which adapter tensors exist and "
            "their shapes, so the checkpoint's adapters cannot load; cannot be forced: resume with "
            f"--lora {change.before}, or export it and start a new LoRA run from the export"
        )
    if change.key == "model.lora" and change.before is None:
        return (
            "it is a full fine-tune checkpoint, which cannot continue as a LoRA run: resume it without "
            "--lora, or export it (launch/export.py) and start a LoRA run from the export"
        )
    if change.key == "model.lora" and change.after is None:
        return f"it is a LoRA checkpoint: resume it with --lora {change.before}"
    if change.key == "train.precision":  # the checkpoint's precision, whatever "auto" means here
        saved = change.resolved[0] if change.resolved else change.before
        return f"{_PRECISION}; cannot be forced: resume with --precision {saved}"
    if change.key in _SAMPLER_KEYS:
        return _SAMPLER_KEYS[change.key](change)
    if change.key in NEVER_FORCED:
        return RESUME_CHANGES[change.key][1] + "; cannot be forced"
    return RESUME_CHANGES.get(change.key, (REFUSED, "a key this version does not know"))[1]


def _why_micro_batch(change: Change) -> str:
    """The sampler would refuse the position after the engine is built; say what can change the
    batch instead: grad_accum, whose change the sampler accepts (it counts micro-batches)."""
    return (
        f"{_MICRO_BATCH}, so it cannot continue at another size; cannot be forced: resume with "
        f"--micro_batch_size {change.before}. To change the sequences per update, change --grad_accum "
        "instead (forced with --allow_config_change train.grad_accum), or export the checkpoint "
        "(launch/export.py) and start a new run from the export"
    )


def _why_seed(change: Change) -> str:
    """The sampler's position only means something in the saved seed's order."""
    return (
        f"{_SEED}; the sampler position is a place in the saved seed's order, so it cannot continue "
        f"in another; cannot be forced: resume with --seed {change.before}, or export the checkpoint "
        "(launch/export.py) and start a new run from the export with the new seed"
    )


#: NEVER_FORCED keys that the sampler's position depends on -> why, with what to do instead.
_SAMPLER_KEYS = {"train.micro_batch_size": _why_micro_batch, "train.seed": _why_seed}


def markdown_table() -> str:
    """The table as docs/resume.md shows it (a test compares the two)."""
    rows = ["| key | on resume | what happens |", "|---|---|---|"]
    rows += [f"| `{key}` | {kind} | {why} |" for key, (kind, why) in RESUME_CHANGES.items()]
    return "\n".join(rows)
