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


# Keys compare sets on every run's command line, after the forwarded flags (so they would win):
# config key -> the compare flag that chooses it.
COMPARE_OWNS = {
    "train.output_dir": "--out (each run goes to <out>/runs/<encoding>-seed<seed>)",
    "train.seed": "--seeds",
    "model.position_encoding": "--encodings",
}


def owned_keys(forwarded: list[str]) -> list[str]:
    """One line per forwarded key compare would silently replace (COMPARE_OWNS, and --resume: every
    run is started with --resume auto), naming the compare flag to use instead. Before, compare's
    own flags came later in each run's command and won, contrary to docs/training.md."""
    from mdlmpe_ds.config import cli
    from mdlmpe_ds.experiments import run_plan

    flags, overrides = cli.parse(run_plan.pretrain_parser(), forwarded)
    lines = [
        f"{key} (--{key.split('.', 1)[1]} {overrides[key]}): use compare's {flag}"
        for key, flag in COMPARE_OWNS.items()
        if key in overrides
    ]
    if flags.get("resume") is not None:
        lines.append(f"--resume {flags['resume']}: compare resumes every run itself (--resume auto)")
    return lines


def check_study(parser: argparse.ArgumentParser, args: argparse.Namespace, forwarded: list[str]) -> None:
    """What would waste the trainings, refused before the first one starts: a key compare replaces,
    a repeated seed or encoding (the same run scored twice, counted as n=2), a corpus that does not
    exist or an evaluation window longer than the runs train (both failed after all the trainings)."""
    from mdlmpe_ds.data.corpora import unknown_corpus

    owned = owned_keys(forwarded)
    if owned:
        parser.error("compare sets these itself for every run: " + "; ".join(owned))
    for flag, values in (("--seeds", args.seeds), ("--encodings", args.encodings)):
        repeated = sorted({v for v in values if values.count(v) > 1}, key=values.index)
        if repeated:
            parser.error(
                f"{flag} {' '.join(map(str, values))}: {', '.join(map(str, repeated))} given more than once; "
                "each value is one matched run, and a repeat would be scored again as another sample"
            )
    for corpus in args.corpora:
        error = unknown_corpus(corpus)
        if error is not None:
            parser.error(f"--corpora: {error}")
    if args.seq_len is not None:
        out = Path(args.out)
        trained = (
            _trained_length(out, args.encodings, args.seeds)
            if args.evaluate_only
            else _planned_length(args, forwarded)
        )
        check_seq_len(parser, args.seq_len, trained)


def check_seq_len(parser: argparse.ArgumentParser, seq_len: int, trained: int) -> None:
    """The evaluation window against the runs' data.max_len, as launch/evaluate.py checks it against
    the model's max_seq_len: positions past it are never trained."""
    if seq_len < 2:
        parser.error(f"--seq_len {seq_len}: must be >= 2 (tokens per window)")
    if seq_len > trained:
        parser.error(
            f"--seq_len {seq_len} is longer than the runs' training length {trained} (data.max_len): "
            f"positions past it are never trained; use --seq_len {trained} or less (default: {trained})"
        )


def _planned_length(args: argparse.Namespace, forwarded: list[str]) -> int:
    """data.max_len of the runs, as launch/pretrain.py will read it from the forwarded flags."""
    from mdlmpe_ds.experiments import run_plan

    run, _ = run_plan.planned_run(forwarded, args.encodings[0], args.seeds[0], Path(args.out), args.deepspeed)
    return int(run.data.max_len)


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
    check_study(parser, args, forwarded)
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
