"""One command for the controlled position-encoding comparison (paper §4.3, Table 2).

Pretrains one model per encoding and seed with the same data, order, initialisation seed and
corruption draws, then scores every model zero-shot with the same masks on the Penn Treebank, the
enwiki-2014 excerpt, the news excerpt and the held-out works of Shakespeare (training corpus:
the other works of Shakespeare), and writes mean ± std over seeds as a table and a bar chart::

    python launch/compare_pe.py                  # tiny preset on CPU: 4 encodings x 3 seeds, < 30 min
    python launch/compare_pe.py --encodings rope mdlmpe mdlmpe-binary --seeds 0 1 --max_steps 500
    python launch/compare_pe.py --preset llada-100m --out outputs/compare-100m   # GPU node: App. B.3 recipe
    python launch/compare_pe.py --preset llada-100m --dry-run   # each run's plan (200K steps), trains nothing

Writes <out>/compare.md, compare.json, compare.png and one run directory per (encoding, seed)
under <out>/runs (checkpoints, TensorBoard, train.log, eval.json). Running the same command again
reuses finished runs and evaluations and resumes an interrupted run from its last checkpoint.
Flags this script does not know are passed to every launch/pretrain.py run (training-config keys).
The tiny default trains 300 updates (saving every 150) unless the user or a recipe sets those keys;
each such default is printed when it is applied.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def compare_overrides(forwarded: list[str]) -> tuple[list[str], list[str]]:
    """(flags compare adds to every run, one line naming each): recipes.COMPARE_LONGER's keys that
    neither the user (flags, --config) nor a recipe (--recipe, or --preset llada-100m|dream-100m) sets."""
    from mdlmpe_ds.config import cli, recipes
    from mdlmpe_ds.experiments import run_plan

    flags, overrides = cli.parse(run_plan.pretrain_parser(), forwarded)
    written = cli.load_config_file(flags["config"]) if flags["config"] is not None else {}
    given = set(overrides) | set(written)
    preset = overrides.get("model.preset", written.get("model.preset"))
    applied = recipes.pretrain_recipe(preset, flags["recipe"])
    if applied is not None:
        given |= set(recipes.get(applied).values)
    demo = recipes.pretrain_demo().flat()
    extra, notes = [], []
    for key, value in recipes.COMPARE_LONGER.items():
        if key in given:
            continue
        name = key.split(".", 1)[1]
        extra += [f"--{name}", str(value)]
        notes.append(
            f"[compare] sets --{name} {value} for every run (launch/pretrain.py's default is "
            f"{demo[key]}); pass --{name} to choose another value"
        )
    return extra, notes


def main(argv: list[str] | None = None) -> int:
    from mdlmpe_ds.data.corpora import EVAL_CORPORA
    from mdlmpe_ds.diffusion.elbo import T_SAMPLING
    from mdlmpe_ds.evaluation.perplexity import EvalSettings
    from mdlmpe_ds.experiments import compare, run_plan

    # No prefix matching: --seed (a training key, forwarded) must not be read as --seeds.
    epilog = None
    if {"-h", "--help"} & set(argv if argv is not None else sys.argv[1:]):
        epilog = (
            "every run also takes launch/pretrain.py's flags and keys:\n"
            + run_plan.pretrain_parser().format_help()
        )
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--encodings", nargs="+", default=list(compare.MAIN_ENCODINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", default="outputs/compare-pe")
    parser.add_argument("--deepspeed", default=str(REPO / "ds_configs" / "zero3.json"))
    parser.add_argument("--corpora", nargs="+", default=list(EVAL_CORPORA))
    # Zero-shot scoring after training (train.eval_* keys are the in-training validation's).
    parser.add_argument("--score_windows", type=int, default=64, help="windows scored per corpus")
    parser.add_argument("--score_draws", type=int, default=8, help="(t, mask) draws per window")
    parser.add_argument("--score_seed", type=int, default=0)
    parser.add_argument("--t_sampling", choices=T_SAMPLING, default="antithetic")
    parser.add_argument("--seq_len", type=int, default=None, help="evaluation window (default: max_len)")
    parser.add_argument("--launcher", default=None, help='e.g. "deepspeed --num_gpus 8" (default: auto)')
    parser.add_argument("--evaluate_only", action="store_true", help="score the finished runs only")
    parser.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="print each run's plan; train nothing",
    )
    args, forwarded = parser.parse_known_args(argv)
    from mdlmpe_ds.training.log_setup import configure

    configure()
    unknown = [e for e in args.encodings if e not in compare.ENCODINGS]
    if unknown:
        parser.error(f"unknown encodings {unknown}; choose from {', '.join(compare.ENCODINGS)}")
    extra, notes = compare_overrides(forwarded)
    for note in notes:
        print(note, flush=True)
    forwarded = [*extra, *forwarded]
    out = Path(args.out)
    launcher = shlex.split(args.launcher) if args.launcher else compare.default_launcher()
    if args.dry_run:
        run_plan.print_plans("compare", args.encodings, args.seeds, forwarded, out, args.deepspeed, launcher)
        return 0
    out.mkdir(parents=True, exist_ok=True)

    if not args.evaluate_only:
        compare.train_all(args.encodings, args.seeds, out, args.deepspeed, forwarded, launcher)
    settings = EvalSettings(
        seq_len=args.seq_len or _trained_length(out, args.encodings, args.seeds),
        max_sequences=args.score_windows,
        num_samples=args.score_draws,
        seed=args.score_seed,
        t_sampling=args.t_sampling,
    )
    scores = compare.evaluate_all(args.encodings, args.seeds, out, args.corpora, settings)
    meta = {
        "seeds": args.seeds,
        "encodings": args.encodings,
        "training": "launch/pretrain.py " + " ".join(forwarded),
        "environment": compare.environment_note(),
    }
    compare.write_report(scores, args.corpora, settings, out, meta)
    print(
        "\n"
        + (out / "compare.md").read_text()
        + f"\nwritten: {out / 'compare.md'}, compare.json, compare.png"
    )
    return 0


def _trained_length(out: Path, encodings: list[str], seeds: list[int]) -> int:
    """The packed length the runs trained with (data.max_len of the first run's last checkpoint)."""
    from mdlmpe_ds.experiments import compare
    from mdlmpe_ds.training import checkpoint as ckpt

    directory = compare.run_dir(out, encodings[0], seeds[0])
    newest = ckpt.newest_complete(directory)
    if newest is None:
        raise SystemExit(f"{directory}: no complete checkpoint to evaluate")
    return int(ckpt.read_saved_run(newest).run_config["data"]["max_len"])


if __name__ == "__main__":
    sys.exit(main())
