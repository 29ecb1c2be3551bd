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
    python launch/mechanism_study.py --paper --out outputs/mechanism-100m   # GPU nodes: the paper's
                                                                   # 100M pretraining recipe on OWT
    python launch/mechanism_study.py --paper --dry-run   # each run's plan; trains and scores nothing

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
# The paper-scale study (docs/results.md "The paper-scale run"): the llada-100m recipe (App. B.3:
# OpenWebText, L 1024, 200K updates of 16 windows, LLaDA's loss, MDLMPE on every head) with the
# study's `mix` corruption, scored on 256 windows x 8 draws of OWT's held-out slice.
PAPER = {
    "train": {"preset": "llada-100m", "corruption": "mix"},
    "corpus": "openwebtext", "windows": 256, "draws": 8,
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
    from mdlmpe_ds.experiments import compare, run_plan
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
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--toy", action="store_true", help="seconds-sized runs and scoring (tests)")
    scale.add_argument("--paper", action="store_true", help="the paper's 100M recipe on OpenWebText (GPUs)")
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
    parser.add_argument("--device", default=None, help="where runs are scored (default: cuda if present)")
    parser.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="print each run's plan; do nothing",
    )
    args, forwarded = parser.parse_known_args(argv)
    plan = TOY if args.toy else PAPER if args.paper else STUDY
    flags = training_flags(plan["train"], forwarded)
    out = Path(args.out)
    launcher = shlex.split(args.launcher) if args.launcher else compare.default_launcher()
    device = args.device or _default_device()
    # the run launch/pretrain.py will build (a recipe or the user's flags resolved as it resolves them)
    run, _ = run_plan.planned_run(flags, args.encodings[0], args.seeds[0], out, args.deepspeed)
    corpus = args.corpus or plan["corpus"]
    if args.dry_run:
        run_plan.print_plans("mechanism", args.encodings, args.seeds, flags, out, args.deepspeed, launcher)
        print(
            f"[mechanism] scoring on {device}: {args.windows or plan['windows']} windows of {corpus} x "
            f"{args.draws or plan['draws']} draws per layout {args.layouts}, every knockout",
            flush=True,
        )
        return 0
    out.mkdir(parents=True, exist_ok=True)
    with WallClock(out) as clock:  # this call's time is kept even if it fails or is killed
        if not args.evaluate_only:
            compare.train_all(args.encodings, args.seeds, out, args.deepspeed, flags, launcher)
        seq_len = run.data.max_len
        settings = LayoutEvalSettings(
            seq_len=seq_len,
            windows=args.windows or plan["windows"],
            draws=args.draws or plan["draws"],
            seed=args.score_seed,
            t_sampling=args.t_sampling,
            layouts=tuple(args.layouts),
        ).validate()
        evaluated = {}
        scored = out / "data_cache"  # the scored corpus, tokenised once into a token store
        for seed in args.seeds:
            for encoding in args.encodings:
                directory = compare.run_dir(out, encoding, seed)
                began = time.perf_counter()
                evaluated[(encoding, seed)], reused = evaluate_run(
                    directory, corpus, settings, device, scored
                )
                what = "scores reused" if reused else f"scored in {time.perf_counter() - began:.0f} s"
                print(f"[mechanism] {encoding} seed {seed}: {what}", flush=True)
        first = compare.run_dir(out, args.encodings[0], args.seeds[0])
        reference = reference_lines(out, first, corpus, settings, scored)
        summary = summarise_study(evaluated, settings, reference)
        meta = {
            "training": "launch/pretrain.py " + " ".join(flags),
            "corpus": corpus,
            "wall_time_s": clock.tick(),
            "environment": compare.environment_note(),
            "encodings": args.encodings,
            "title": f"{run.model.preset}, {run.train.max_steps} updates on {run.train.corruption} "
            f"corruption, L {seq_len}",
        }
        write_report(summary, settings, out, meta)
    print(
        "\n"
        + (out / "mechanism.md").read_text()
        + f"\nwritten: {out / 'mechanism.md'}, mechanism.json, mechanism.png"
    )
    return 0


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class WallClock:
    """Seconds spent by every invocation of the study in ``out``, kept in ``<out>/wall_time.json``:
    this call's entry is rewritten every ``every`` seconds and at the end, so a call that is killed
    (and resumed by the next) still counts up to its last write."""

    def __init__(self, out: Path, every: float = 30.0):
        import json
        import threading

        self.path = out / "wall_time.json"
        self.calls = json.loads(self.path.read_text())["calls"] if self.path.is_file() else []
        self.calls.append(0.0)
        self.start = time.perf_counter()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._every = every
        self.tick()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._done.wait(self._every):
            self.tick()

    def tick(self) -> float:
        """Write this call's time so far; return the total over every call."""
        import json

        with self._lock:
            self.calls[-1] = round(time.perf_counter() - self.start, 1)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"calls": self.calls}) + "\n")
            tmp.replace(self.path)
            return sum(self.calls)

    def stop(self) -> float:
        self._done.set()
        return self.tick()

    def __enter__(self) -> WallClock:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
