"""Does MDLMPE use the mask layout? One command: train, pair, knock out, report.

Pretrains a RoPE and an MDLMPE model per seed, matched in everything but the position module (as
launch/compare_pe.py), on the ``mix`` corruption (50% iid, 25% semi-autoregressive blocks, 25%
contiguous spans; diffusion/layouts.py), at a size where MDLMPE's topology features vary inside
its window (``llada-mech``: d 96, 3 layers, 3 heads of d_h 32, so F = 16, at L = 128 with W = 24);
then scores every model on the same held-out windows and masks under each layout, and the MDLMPE
models again with their availability layout knocked out (evaluation/knockout.py)::

    python launch/mechanism_study.py                 # 5 seeds x {rope, mdlmpe}, 600 updates, CPU
    python launch/mechanism_study.py --toy --out /tmp/mech   # seconds-sized models, for the tests
    python launch/mechanism_study.py --seeds 0 1 2 --max_steps 1200   # flags it does not know go to
                                                                      # every launch/pretrain.py run

Writes <out>/mechanism.md, mechanism.json and mechanism.png; one run directory per (encoding,
seed) under <out>/runs. Running it again reuses finished runs (summary.json) and evaluations
(mechanism_eval.json with the same settings), and resumes an interrupted run from its checkpoint.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The study's training (launch/pretrain.py keys) and scoring; --toy swaps in seconds-sized values.
# Why these settings (docs/results.md "Does MDLMPE use the mask layout?"): with LLaDA's 1/p-weighted
# loss, 2k or 512 pieces and 600-800 updates of 16 windows, RoPE stayed on the unigram line of its
# scored windows, where no knockout can show anything; the unweighted masked-token mean (Dream's
# loss with no weight) left it within the same 600 updates. L 128 with 512 pieces keeps the ten runs
# near an hour on 2 CPU cores (MDLMPE's blocked attention compiled: the same numbers, ~1.8x faster).
STUDY = {
    "train": {
        "preset": "llada-mech", "dataset": "shakespeare", "validation": "shakespeare-heldout",
        "max_len": 128, "tokenizer_vocab": 512, "corruption": "mix", "max_steps": 600,
        "save_every": 200, "eval_every": 0, "micro_batch_size": 8, "lr": 3e-3, "warmup_ratio": 0.05,
        "loss": "dream", "dream_weighting": "none", "compile": "true",
    },
    "corpus": "shakespeare-heldout", "windows": 128, "draws": 4,
}  # fmt: skip
TOY = {
    "train": {
        "preset": "llada-tiny", "dataset": "botchan", "validation": "botchan", "text_split": "paragraph",
        "max_len": 64, "tokenizer_vocab": 400, "corruption": "mix", "max_steps": 2, "save_every": 2,
        "eval_every": 0, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 1, "eval_sequences": 2,
        "eval_samples": 2,
    },
    "corpus": "botchan", "windows": 4, "draws": 2,
}  # fmt: skip


def training_flags(base: dict, forwarded: list[str]) -> list[str]:
    """The study's pretraining flags, minus every key the user passes (theirs win)."""
    given = {t.lstrip("-").split("=", 1)[0].split(".")[-1] for t in forwarded if t.startswith("--")}
    flags = []
    for key, value in base.items():
        if key not in given:
            flags += [f"--{key}", str(value)]
    return [*flags, *forwarded]


def main(argv: list[str] | None = None) -> int:
    from mdlmpe_ds.diffusion.elbo import T_SAMPLING
    from mdlmpe_ds.experiments import compare
    from mdlmpe_ds.experiments.layout_eval import LayoutEvalSettings
    from mdlmpe_ds.experiments.mechanism_study import (
        evaluate_run,
        reference_lines,
        summarise_study,
        write_report,
    )

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--toy", action="store_true", help="seconds-sized runs and scoring (tests)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--encodings", nargs="+", default=["rope", "mdlmpe"], choices=["rope", "mdlmpe"])
    parser.add_argument("--out", default="outputs/mechanism")
    parser.add_argument("--deepspeed", default=str(REPO / "ds_configs" / "zero3.json"))
    parser.add_argument("--corpus", default=None, help="held-out corpus scored (default: the study's)")
    parser.add_argument("--windows", type=int, default=None, help="windows scored")
    parser.add_argument("--draws", type=int, default=None, help="(t, mask) draws per window and layout")
    parser.add_argument("--score_seed", type=int, default=0)
    parser.add_argument("--t_sampling", choices=T_SAMPLING, default="antithetic")
    parser.add_argument("--layouts", nargs="+", default=["iid", "semi_ar", "spans"])
    parser.add_argument("--launcher", default=None, help='e.g. "deepspeed --num_gpus 8" (default: auto)')
    parser.add_argument("--evaluate_only", action="store_true", help="score the finished runs only")
    args, forwarded = parser.parse_known_args(argv)
    plan = TOY if args.toy else STUDY
    flags = training_flags(plan["train"], forwarded)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launcher = shlex.split(args.launcher) if args.launcher else compare.default_launcher()
    start = time.perf_counter()
    if not args.evaluate_only:
        compare.train_all(args.encodings, args.seeds, out, args.deepspeed, flags, launcher)
    seq_len = int(_flag(flags, "max_len"))
    settings = LayoutEvalSettings(
        seq_len=seq_len,
        windows=args.windows or plan["windows"],
        draws=args.draws or plan["draws"],
        seed=args.score_seed,
        t_sampling=args.t_sampling,
        layouts=tuple(args.layouts),
    ).validate()
    corpus = args.corpus or plan["corpus"]
    evaluated = {}
    for seed in args.seeds:
        for encoding in args.encodings:
            directory = compare.run_dir(out, encoding, seed)
            began = time.perf_counter()
            evaluated[(encoding, seed)], reused = evaluate_run(directory, corpus, settings)
            what = "scores reused" if reused else f"scored in {time.perf_counter() - began:.0f} s"
            print(f"[mechanism] {encoding} seed {seed}: {what}", flush=True)
    first = compare.run_dir(out, args.encodings[0], args.seeds[0])
    reference = reference_lines(out, first, corpus, _flag(flags, "dataset"), settings)
    summary = summarise_study(evaluated, settings, reference)
    meta = {
        "training": "launch/pretrain.py " + " ".join(flags),
        "corpus": corpus,
        "wall_time_s": _total_wall_time(out, time.perf_counter() - start),
        "environment": compare.environment_note(),
        "encodings": args.encodings,
        "title": f"{_flag(flags, 'preset')}, {_flag(flags, 'max_steps')} updates on "
        f"{_flag(flags, 'corruption')} corruption, L {seq_len}",
    }
    write_report(summary, settings, out, meta)
    print(
        "\n"
        + (out / "mechanism.md").read_text()
        + f"\nwritten: {out / 'mechanism.md'}, mechanism.json, mechanism.png"
    )
    return 0


def _flag(flags: list[str], key: str) -> str:
    """The value of the last ``--key`` in ``flags`` (the user's, when given)."""
    value = "?"
    for i, token in enumerate(flags):
        name, eq, given = token[2:].partition("=")
        if token.startswith("--") and name.split(".")[-1] == key:
            value = given if eq else (flags[i + 1] if i + 1 < len(flags) else value)
    return value


def _total_wall_time(out: Path, this_call: float) -> float:
    """Seconds spent by every invocation of the study in ``out`` (an interrupted study resumed
    later counts all its parts), kept in ``<out>/wall_time.json``."""
    import json

    path = out / "wall_time.json"
    calls = json.loads(path.read_text())["calls"] if path.is_file() else []
    calls.append(round(this_call, 1))
    path.write_text(json.dumps({"calls": calls}) + "\n")
    return sum(calls)


if __name__ == "__main__":
    sys.exit(main())
