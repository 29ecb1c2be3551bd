"""Run a suite for several models through lm-eval and the ``mdlmpe`` adapter, one cached result per
(model, task, settings).

Matched by construction: every model is scored under settings computed from the same suite row and
the same options; only the model differs. ``check_matched`` refuses to compare when the settings or
the items (lm-eval's document and prompt hashes) differ, which happens when the families differ
(their official decoding settings differ) or a task definition changed between runs.

Data parallel: under ``torchrun`` each process loads the model on its own GPU and lm-eval shards the
documents by rank (the adapter's hooks gather them); rank 0 writes the cache and the report.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mdlmpe_ds.evaluation.benchmark.cache import ModelRef, ResultCache, digest
from mdlmpe_ds.evaluation.benchmark.suites import CODE, Suite, TaskSpec, decoding_for, forward_passes


@dataclass(frozen=True)
class RunOptions:
    """What, besides the suite row, decides a result (all of it goes into the settings)."""

    limit: int | None = None
    seed: int = 1234
    dtype: str = "fp32"
    device: str | None = None  # default: cuda (cuda:LOCAL_RANK under torchrun) if available, else cpu
    batch_size: int = 1  # not part of the settings: results do not depend on it (adapter docstring)
    mc_batch_size: int = 32
    task_dir: str | None = None  # local task definitions instead of lm-eval's registry
    overrides: dict[str, Any] = field(default_factory=dict)  # decoding values set on the command line
    allow_code: bool = False
    chat_template: bool = False  # prompts through the model's chat template, few-shot as turns


@dataclass
class Job:
    model: ModelRef
    spec: TaskSpec
    settings: dict[str, Any]
    passes: int  # estimated sequence forwards
    cached: dict[str, Any] | None = None


def device_for(opts: RunOptions) -> str:
    import torch

    if opts.device:
        return opts.device
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def task_source(opts: RunOptions) -> str:
    """Where the task definitions come from; a local directory is identified by its contents."""
    import importlib.metadata

    harness = f"lm-eval=={importlib.metadata.version('lm_eval')}"
    if not opts.task_dir:
        return harness
    root = Path(opts.task_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"--task_dir {root}: no such directory")
    files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    contents = digest([(str(p.relative_to(root)), p.read_text()) for p in files])
    return f"{harness}; {root.resolve()} sha256:{contents[:16]}"


def settings_for(spec: TaskSpec, family: str, opts: RunOptions, source: str, device: str) -> dict[str, Any]:
    decoding = decoding_for(spec, family)
    decoding.update({k: v for k, v in opts.overrides.items() if k in decoding})
    return {
        "task": spec.task.value,
        "num_fewshot": spec.num_fewshot.value,
        "metric": spec.metric.value,
        "decoding": decoding,
        "seed": opts.seed,
        "limit": opts.limit,
        "dtype": opts.dtype,
        "chat_template": opts.chat_template,
        "device_type": device.split(":")[0],
        "tasks_from": source,
    }


def estimated_items(spec: TaskSpec, limit: int | None) -> int:
    """lm-eval's ``limit`` applies to every subtask of a group (MMLU: 57 subtasks)."""
    n = int(spec.items.value)
    return n if limit is None else min(n, limit * spec.subtasks)


def plan(suite: Suite, models: list[ModelRef], opts: RunOptions, cache: ResultCache | None) -> list[Job]:
    """One job per (model, suite row), with its settings, estimate and any cached result."""
    source, device = task_source(opts), device_for(opts)
    jobs = []
    for model in models:
        for spec in suite.tasks:
            settings = settings_for(spec, model.family, opts, source, device)
            passes = forward_passes(spec, settings["decoding"], estimated_items(spec, opts.limit))
            cached = cache.load(model, spec.key, settings) if cache is not None else None
            jobs.append(Job(model, spec, settings, passes, cached))
    return jobs


def check_matched(suite: Suite, jobs: list[Job]) -> None:
    """Refuse rows whose models were (or would be) scored under different settings."""
    for spec in suite.tasks:
        rows = [j for j in jobs if j.spec is spec]
        first = rows[0]
        for other in rows[1:]:
            if other.settings != first.settings:
                diff = _differences(first.settings, other.settings)
                raise ValueError(
                    f"{spec.display()}: {first.model.name} ({first.model.family}) and "
                    f"{other.model.name} ({other.model.family}) would be scored under different settings "
                    f"({diff}); a paired comparison needs the same family and options"
                )


def check_same_items(spec: TaskSpec, results: dict[str, list[dict]]) -> None:
    """The same documents with the same prompts for every model, in the same order."""
    names = list(results)
    keys = {
        n: [(i["subtask"], i["doc_id"], i["doc_hash"], i["prompt_hash"]) for i in results[n]] for n in names
    }
    for n in names[1:]:
        if keys[n] != keys[names[0]]:
            raise ValueError(
                f"{spec.display()}: {names[0]} and {n} were scored on different items or "
                f"prompts ({len(keys[names[0]])} vs {len(keys[n])} items); the task definition changed "
                "between their runs: delete their cache entries and re-run"
            )


def _differences(a: dict, b: dict, prefix: str = "") -> str:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            inner = _differences(va, vb, f"{prefix}{k}.")
            out += [inner] if inner else []
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} vs {vb!r}")
    return "; ".join(out)


def items_from_samples(samples: dict[str, list[dict]], metric_key: str) -> list[dict]:
    """Per-item records of one task (or group) from lm-eval's logged samples, for the chosen
    ``metric,filter``; sorted by (subtask, doc_id) so every model lists the items in one order."""
    metric, filt = metric_key.split(",", 1)
    items = []
    for subtask, rows in samples.items():
        for row in rows:
            if row["filter"] != filt:
                continue
            if metric not in row:
                raise ValueError(
                    f"{subtask}: no metric {metric!r} in lm-eval's samples (has {row['metrics']})"
                )
            items.append(
                {
                    "subtask": subtask,
                    "doc_id": row["doc_id"],
                    "doc_hash": row["doc_hash"],
                    "prompt_hash": row["prompt_hash"],
                    "target": str(row["target"]),
                    "response": _plain(row["filtered_resps"]),
                    "score": float(row[metric]),
                }
            )
    if not items:
        raise ValueError(f"no samples with filter {filt!r}: check the suite's metric {metric_key!r}")
    return sorted(items, key=lambda i: (i["subtask"], i["doc_id"]))


def _plain(resps: Any) -> Any:
    """JSON-able responses: option log-likelihoods for multiple choice, text for generation."""
    if isinstance(resps, (list, tuple)):
        return [_plain(r) for r in resps]
    if isinstance(resps, (str, int, float, bool)) or resps is None:
        return resps
    return str(resps)


def evaluate_job(
    job: Job, make_lm: Callable[[dict[str, Any]], Any], opts: RunOptions, task_manager
) -> list | None:
    """Score one (model, row) through lm-eval; None on ranks other than 0 (lm-eval gathers to 0).

    lm-eval's ``evaluate`` on the task loaded here, rather than ``simple_evaluate``: the few-shot
    count is set on every (sub)task unconditionally (``simple_evaluate`` keeps a task's own 0 and
    ignores the request), and no environment report (a ``pip`` listing per call) is collected.
    """
    import random

    import numpy as np
    import torch
    from lm_eval.evaluator import evaluate

    lm = make_lm(job.settings["decoding"])
    lm.progress_desc = f"{job.model.name}: {job.spec.display()}"
    random.seed(opts.seed)
    np.random.seed(opts.seed)
    torch.manual_seed(opts.seed)
    loaded = task_manager.load([job.spec.task.value])
    for task in loaded["tasks"].values():
        task.set_config(key="num_fewshot", value=job.spec.num_fewshot.value)
        task.set_fewshot_seed(seed=opts.seed)
    out = evaluate(
        lm=lm,
        task_dict=loaded,
        limit=opts.limit,
        bootstrap_iters=0,
        log_samples=True,
        verbosity="WARNING",
        apply_chat_template=opts.chat_template,
        fewshot_as_multiturn=opts.chat_template,
        confirm_run_unsafe_code=opts.allow_code and job.spec.kind == CODE,
    )
    if out is None:
        return None
    return items_from_samples(out["samples"], job.settings["metric"])
