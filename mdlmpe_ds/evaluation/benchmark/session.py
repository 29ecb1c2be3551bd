"""One benchmark invocation: plan, refuse mismatches, score what is not cached, report.

Jobs run model by model (each model is loaded once, and released before the next one is loaded);
a job whose (model, task, settings) result is cached is not run again.
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from typing import Any

from mdlmpe_ds.evaluation.benchmark.cache import ModelRef, ResultCache
from mdlmpe_ds.evaluation.benchmark.runner import (
    Job,
    RunOptions,
    check_matched,
    check_same_items,
    device_for,
    evaluate_job,
    plan,
)
from mdlmpe_ds.evaluation.benchmark.suites import CODE, Suite
from mdlmpe_ds.evaluation.lm_eval_adapter import MDLMPEEvalLM, check_model_args, parse_model_args
from mdlmpe_ds.evaluation.loading import load_model, load_tokenizer

logger = logging.getLogger(__name__)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def default_names(paths: list[str]) -> list[str]:
    """Column names: each directory's name, or ``parent/name`` where two would collide (two runs'
    ``export`` directories); hub ids as given."""
    short = [Path(p).resolve().name if Path(p).exists() else p for p in paths]
    if len(set(short)) == len(short):
        return short
    return [
        f"{Path(p).resolve().parent.name}/{Path(p).resolve().name}" if Path(p).exists() else p for p in paths
    ]


def check_models(models: list[ModelRef]) -> None:
    if len(models) < 2:
        raise ValueError("a paired comparison needs at least two models (the first is the baseline)")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must differ, got {names}; pass --names")


def check_overrides(overrides: dict[str, Any]) -> None:
    """Each ``--set`` value checked on its own, as the adapter checks its model_args (before any
    model is resolved or loaded: a real run used to fail only at the first model load, and the dry
    run printed a plan of ~0 forwards for ``steps=0``)."""
    parse_model_args(overrides, label="--set")


def check_decoding(jobs: list[Job], overrides: dict[str, Any]) -> None:
    """Every job's decoding (its suite row with the ``--set`` values merged in) checked as the
    adapter will check it, so that e.g. ``--set gen_length=5`` on a row with block_length 512 is
    refused in the plan rather than after the model loads."""
    where = " with --set" if overrides else ""
    for job in jobs:
        check_model_args(
            job.settings["decoding"], label=f"{job.spec.display()} ({job.model.family} decoding{where}):"
        )


def prepare_plan(suite: Suite, models: list[ModelRef], opts: RunOptions, cache_root: str | Path) -> list[Job]:
    """The jobs with their settings and cached results; refuses bad decoding values and unmatched
    settings."""
    check_models(models)
    check_overrides(opts.overrides)
    jobs = plan(suite, models, opts, ResultCache(cache_root))
    check_decoding(jobs, opts.overrides)
    check_matched(suite, jobs)
    return jobs


def prepare(suite: Suite, models: list[ModelRef], opts: RunOptions, cache_root: str | Path) -> list[Job]:
    """``prepare_plan``, and code execution allowed wherever a code task still has to run."""
    jobs = prepare_plan(suite, models, opts, cache_root)
    code = sorted({j.spec.task.value for j in jobs if j.spec.kind == CODE and j.cached is None})
    if code and not opts.allow_code:
        raise ValueError(
            f"tasks {code} run model-written programs; pass --allow_code_execution to run them "
            "(lm-eval's execution metric, HF_ALLOW_CODE_EVAL=1), or leave them out with --only"
        )
    return jobs


def run(
    suite: Suite, models: list[ModelRef], opts: RunOptions, cache_root: str | Path, progress: bool = True
) -> dict[str, dict[str, list[dict]]] | None:
    """{row key: {model name: per-item records}}, every row scored or read from the cache (rank 0;
    None on the other ranks of a data-parallel run)."""
    from tqdm.auto import tqdm

    jobs = prepare(suite, models, opts, cache_root)
    cache = ResultCache(cache_root)
    if opts.allow_code:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"  # lm-eval's code metrics refuse to run without it
    results: dict[str, dict[str, list[dict]]] = {spec.key: {} for spec in suite.tasks}
    task_manager, loaded = None, None
    bar = tqdm(jobs, desc="benchmark", unit="task", disable=not progress or rank() != 0)
    for job in bar:
        bar.set_postfix_str(f"{job.model.name} {job.spec.display()}")
        if job.cached is not None:
            results[job.spec.key][job.model.name] = job.cached["items"]
            continue
        if task_manager is None:
            from lm_eval.tasks import TaskManager

            task_manager = TaskManager(include_path=opts.task_dir, include_defaults=opts.task_dir is None)
        if loaded is None or loaded[0] is not job.model:
            loaded = None
            gc.collect()  # release the previous model before loading the next
            _empty_cuda_cache()
            loaded = (job.model, *_load(job.model, opts))
        items = evaluate_job(job, _lm_factory(loaded[1], loaded[2], opts), opts, task_manager)
        if items is not None:
            path = cache.store(job.model, job.spec.key, job.settings, items)
            logger.info("%s: %s scored on %d items -> %s", job.model.name, job.spec.key, len(items), path)
            results[job.spec.key][job.model.name] = items
    if rank() != 0:
        return None
    for spec in suite.tasks:
        check_same_items(spec, results[spec.key])
    return results


def _load(model: ModelRef, opts: RunOptions) -> tuple[Any, Any]:

    net, tok_dir = load_model(model.path, device=device_for(opts), dtype=opts.dtype)
    if tok_dir is None:
        raise ValueError(f"{model.path}: no tokenizer recorded with this model")
    return net, load_tokenizer(tok_dir)


def _lm_factory(net: Any, tokenizer: Any, opts: RunOptions):
    def make(decoding: dict[str, Any]):

        return MDLMPEEvalLM(
            net,
            tokenizer=tokenizer,
            device=device_for(opts),
            batch_size=opts.batch_size,
            mc_batch_size=opts.mc_batch_size,
            seed=opts.seed,
            **decoding,
        )

    return make


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
