"""One command for the controlled position-encoding comparison (paper §4.3, Table 2).

Pretrains one model per encoding and seed with the same data, order, initialisation seed and
corruption draws, then scores every model zero-shot with the same masks on the Penn Treebank, the
enwiki-2014 excerpt, the news excerpt and the held-out works of Shakespeare (training corpus:
the other works of Shakespeare), and writes mean ± std over seeds as a table and a bar chart::

    python launch/compare_pe.py                  # tiny preset on CPU: 4 encodings x 3 seeds, < 30 min
    python launch/compare_pe.py --encodings rope mdlmpe mdlmpe-binary --seeds 0 1 --max_steps 500
    python launch/compare_pe.py --preset llada-100m --dataset Skylion007/openwebtext \\
        --tokenizer /models/LLaDA-8B-Base --max_steps 200000 --out outputs/compare-100m   # GPU node

Writes <out>/compare.md, compare.json, compare.png and one run directory per (encoding, seed)
under <out>/runs (checkpoints, TensorBoard, train.log, eval.json). Running the same command again
reuses finished runs and evaluations and resumes an interrupted run from its last checkpoint.
Flags this script does not know are passed to every launch/pretrain.py run (training-config keys).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The tiny CPU comparison: launch/pretrain.py's demo defaults, trained longer.
COMPARE_DEFAULTS = ["--max_steps", "300", "--save_every", "150"]


def main(argv: list[str] | None = None) -> int:
    from mdlmpe_ds import compare
    from mdlmpe_ds.data.corpora import EVAL_CORPORA
    from mdlmpe_ds.diffusion.elbo import T_SAMPLING
    from mdlmpe_ds.evaluation.perplexity import EvalSettings

    # No prefix matching: --seed (a training key, forwarded) must not be read as --seeds.
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
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
    args, forwarded = parser.parse_known_args(argv)
    unknown = [e for e in args.encodings if e not in compare.ENCODINGS]
    if unknown:
        parser.error(f"unknown encodings {unknown}; choose from {', '.join(compare.ENCODINGS)}")
    forwarded = [*COMPARE_DEFAULTS, *forwarded]  # later flags win
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launcher = shlex.split(args.launcher) if args.launcher else compare.default_launcher()

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
    from mdlmpe_ds import checkpoint as ckpt
    from mdlmpe_ds import compare

    directory = compare.run_dir(out, encodings[0], seeds[0])
    newest = ckpt.newest_complete(directory)
    if newest is None:
        raise SystemExit(f"{directory}: no complete checkpoint to evaluate")
    return int(ckpt.read_saved_run(newest).run_config["data"]["max_len"])


if __name__ == "__main__":
    sys.exit(main())
