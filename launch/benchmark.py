"""The paper's benchmark tables for two or more checkpoints, paired: RoPE vs MDLMPE side by side.

    python launch/benchmark.py --suite paper-table1 outputs/llada-rope outputs/llada-mdlmpe \\
        --names rope mdlmpe --allow_code_execution --out outputs/benchmark/table1
    python launch/benchmark.py --suite paper-table1 GSAI-ML/LLaDA-8B-Instruct outputs/llada-mdlmpe --dry-run
    torchrun --nproc_per_node 8 launch/benchmark.py --suite paper-table3 runA runB --dtype bf16

MODEL: an export, a training run (output_dir, checkpoints/, a step directory; LoRA runs merged onto
their base) or a hub id. The first model is the baseline; every other is paired with it on the same
items, prompts, seeds and decoding budget (the suite's settings for the models' family, printed with
their sources at the start). Results are cached per (model, task, settings) under ``--cache`` and
reused on a rerun. Writes <out>.md (the paper's layout) and <out>.json (every per-item result).

``--task_dir DIR`` loads task definitions of the same names from DIR instead of lm-eval's registry
(tests/data/benchmark_tasks holds small offline copies of every task of the suites). ``--dry-run``
prints the suite and the plan (estimated sequence forwards per model) without loading a model or
reaching the network. This is its own script, not an ``evaluate.py`` mode: it needs the lm-eval
extra and shares none of the perplexity tool's flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from mdlmpe_ds.evaluation.benchmark.suites import SUITES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "models", nargs="+", help="exports, training runs or hub ids; the first is the baseline"
    )
    parser.add_argument("--suite", choices=sorted(SUITES), default="paper-table1")
    parser.add_argument("--names", nargs="+", help="column names (default: the directories' names)")
    parser.add_argument("--family", choices=["llada", "dream"], help="when it cannot be read from the model")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (per subtask of a group)")
    parser.add_argument("--only", nargs="+", help="rows to run: labels, lm-eval tasks, groups or variants")
    parser.add_argument("--set", nargs="+", dest="overrides", metavar="KEY=VALUE", help="decoding override")
    parser.add_argument("--task_dir", help="local task definitions instead of lm-eval's registry")
    parser.add_argument("--allow_code_execution", action="store_true", help="run the code tasks' programs")
    parser.add_argument(
        "--chat_template",
        action="store_true",
        help="prompts through the model's chat template (few-shot as turns)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the suite and the plan, run nothing")
    parser.add_argument("--out", default=None, help="output prefix (default outputs/benchmark/<suite>)")
    parser.add_argument("--cache", default=None, help="result cache (default: <out's directory>/cache)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--device", default=None, help="default: cuda (cuda:LOCAL_RANK) if available, else cpu"
    )
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--mc_batch_size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234, help="requests, few-shot draws, sampling")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--no_progress", action="store_true")
    args = parser.parse_args(argv)
    from mdlmpe_ds.training.log_setup import configure

    configure(stream="stderr")  # stdout holds the suite, the plan and the table
    if args.names and len(args.names) != len(args.models):
        parser.error(f"--names has {len(args.names)} entries for {len(args.models)} models")
    try:
        return _run(args)
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"benchmark: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from mdlmpe_ds.evaluation.benchmark import report, session
    from mdlmpe_ds.evaluation.benchmark.cache import describe_model, resolve_hub
    from mdlmpe_ds.evaluation.benchmark.runner import RunOptions
    from mdlmpe_ds.evaluation.benchmark.suites import get_suite, parse_overrides, select

    suite = select(get_suite(args.suite), args.only)
    opts = RunOptions(
        limit=args.limit,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        batch_size=args.batch_size,
        mc_batch_size=args.mc_batch_size,
        task_dir=args.task_dir,
        overrides=parse_overrides(
            args.overrides, get_suite(args.suite)
        ),  # a key of any row: --only may drop it
        allow_code=args.allow_code_execution,
        chat_template=args.chat_template,
    )
    session.check_overrides(opts.overrides)  # before a hub id is downloaded
    names = args.names or session.default_names(args.models)
    describe = describe_model if args.dry_run else resolve_hub  # a real run downloads hub ids first
    models = [describe(p, names[i], args.family) for i, p in enumerate(args.models)]
    out = Path(args.out or f"outputs/benchmark/{suite.name}")
    cache_root = Path(args.cache) if args.cache else out.parent / "cache"
    first = session.rank() == 0
    if first:
        print(report.describe_suite(suite, [m.family for m in models]) + "\n", flush=True)
    if args.dry_run:
        jobs = session.prepare_plan(suite, models, opts, cache_root)
        print(report.describe_plan(jobs, opts.overrides))
        return 0
    jobs = session.prepare(suite, models, opts, cache_root)
    if first:
        print(report.describe_plan(jobs, opts.overrides) + "\n", flush=True)
    results = session.run(suite, models, opts, cache_root, progress=not args.no_progress)
    if results is None:  # another rank of a data-parallel run: rank 0 reports
        return 0
    built = report.build(suite, models, jobs, results, resamples=args.resamples, seed=0)
    table = report.markdown(built)
    out.parent.mkdir(parents=True, exist_ok=True)
    md, js = out.with_suffix(".md"), out.with_suffix(".json")
    md.write_text(table + "\n")
    js.write_text(json.dumps(built, indent=1, default=str) + "\n")
    print(table + f"\n\nwritten: {md}, {js}")
    return 0


if __name__ == "__main__":
    code = main()
    if "LOCAL_RANK" in os.environ:  # a torchrun worker: tear the process group down, then exit cleanly
        from mdlmpe_ds.distributed.process_group import exit_after_teardown

        exit_after_teardown(code)
    sys.exit(code)
