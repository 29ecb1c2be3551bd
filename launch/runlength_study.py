"""Does MDLMPE use the mask layout? The run-length infilling study, one command.

Trains every arm of mdlmpe_ds/experiments/runlength_arms.py on run-length infilling
(experiments/runlength_data.py) at matched initial weights, data and masks per seed, scores each
on a fixed evaluation set with knockouts at every evaluation, probes how much of the answer the
layout feature A carries, and writes the report with its decision rule (README "Does MDLMPE use the
mask layout?")::

    python launch/runlength_study.py                          # L64-K8, 5 seeds, then L128-K16
    python launch/runlength_study.py --geometries L64-K8 --seeds 0 1 2 3 4 --workers 2
    python launch/runlength_study.py --toy --out /tmp/runlength   # seconds: the whole pipeline
    python launch/runlength_study.py --report-only            # the report from finished runs

Writes <out>/runlength.md, runlength.json and runlength.png; one JSON per finished run under
<out>/runs. Running it again reuses every finished run made with the same settings; a run that
was interrupted is trained again from its start (each takes minutes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mdlmpe_ds.experiments.runlength_arms import ARMS, STUDY_ATTENTION  # noqa: E402
from mdlmpe_ds.experiments.runlength_data import GEOMETRIES  # noqa: E402
from mdlmpe_ds.experiments.runlength_report import write_report  # noqa: E402
from mdlmpe_ds.experiments.runlength_study import StudyPlan, run_study  # noqa: E402
from mdlmpe_ds.experiments.runlength_train import RunSettings  # noqa: E402

TOY_SETTINGS = RunSettings(
    updates=4, batch=4, warmup=1, eval_at=(0, 2, 4), eval_rows=8, eval_batch=8, eval_seed=1234
)


# What --toy fixes (the seconds-sized geometry; dense attention needs no C++ compiler) and the full
# study's defaults of the same flags. --seeds applies to both (the toy takes one seed by default).
TOY_FIXED = {"geometries": ["L16-K3"], "attention": "dense"}
FULL_DEFAULTS = {"geometries": ["L64-K8", "L128-K16"], "attention": "compiled", "seeds": [0, 1, 2, 3, 4]}


def build_parser() -> argparse.ArgumentParser:
    """The flags --toy fixes default to None, so that a value the user gave can be told apart."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "runlength")
    parser.add_argument(
        "--geometries", nargs="+", choices=sorted(GEOMETRIES), help="default: L64-K8 L128-K16 (--toy: L16-K3)"
    )
    parser.add_argument("--seeds", nargs="+", type=int, help="default: 0 1 2 3 4 (--toy: 0)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--maskings", nargs="+", default=["runs", "iid"], choices=["runs", "iid"])
    parser.add_argument("--workers", type=int, default=2, help="training processes, one thread each")
    parser.add_argument(
        "--attention",
        choices=list(STUDY_ATTENTION),
        help="MDLMPE attention of the runs still to train: compiled (the default; torch.compile, which "
        "needs a C++ compiler; faster after a few seconds of compilation) or dense (plain autograd); the "
        "same numbers to fp32 rounding (--toy: dense)",
    )
    parser.add_argument("--toy", action="store_true", help="a seconds-sized study (L 16, K 3, 4 updates)")
    parser.add_argument("--report-only", action="store_true", help="report the finished runs; train nothing")
    return parser


def resolve_toy(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RunSettings:
    """The run settings, with --toy's geometry and attention filled in, or the full study's defaults.
    A flag --toy would override is refused, naming it: --toy used to run L16-K3 whatever
    --geometries said, and report it as the study asked for."""
    if args.toy:
        clashes = [
            f"--{name} {' '.join(map(str, value)) if isinstance(value, list) else value}"
            for name, fixed in TOY_FIXED.items()
            if (value := getattr(args, name)) is not None and value != fixed
        ]
        if clashes:
            parser.error(
                f"--toy trains {TOY_FIXED['geometries'][0]} with {TOY_FIXED['attention']} attention, so it "
                f"cannot take {', '.join(clashes)}: drop {'them' if len(clashes) > 1 else 'it'}, or drop "
                "--toy for the full-size study"
            )
        defaults = {**TOY_FIXED, "seeds": [0]}
    else:
        defaults = FULL_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)
    return TOY_SETTINGS if args.toy else RunSettings()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = resolve_toy(parser, args)
    plan = StudyPlan(args.geometries, args.seeds, args.arms, args.maskings, settings, args.attention)
    if args.report_only:
        from mdlmpe_ds.experiments.runlength_train import load_finished, run_path

        runs = {job: load_finished(run_path(args.out, *job), settings) for job in plan.jobs()}
        runs = {job: r for job, r in runs.items() if r is not None}
    else:
        runs = run_study(args.out, plan, args.workers)
    report = write_report(args.out, plan, runs, probe_rows=32 if args.toy else 768)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
