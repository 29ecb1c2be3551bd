"""Diffusion-ELBO perplexity of trained models on text corpora, as a markdown + JSON table.

    python launch/evaluate.py outputs/pretrain-demo
    python launch/evaluate.py runA/ runB/export --names rope mdlmpe \\
        --corpora ptb enwiki-excerpt news-excerpt shakespeare-heldout --num_samples 8 --out results/ppl

MODEL is an exported directory (config.json + safetensors + tokenizer) or a training run
(output_dir, checkpoints/, a step directory: the newest complete ZeRO-3 checkpoint is consolidated
in this process). Corpora are named offline corpora, local text files or hub datasets
(mdlmpe_ds/data/corpora.py). The masks depend only on (--seed, window index, sample), so models
with the same tokenizer are scored on the same tokens and masks. Writes <out>.md and <out>.json.

``--corruption iid semi_ar spans`` scores under structured mask layouts instead
(diffusion/layouts.py): the NLL per layout at matched noise levels, and every further model's
paired difference to the first one with its standard error over windows
(evaluation/layout_eval.py)::

    python launch/evaluate.py runs/rope-seed0 runs/mdlmpe-seed0 --names rope mdlmpe \
        --corpora shakespeare-heldout --corruption iid semi_ar spans --num_samples 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

#: Where results go without --out. A second evaluation there would replace the first one's files.
DEFAULT_OUT = "outputs/eval/perplexity"


def keep_earlier(prefix: Path) -> None:
    """Move an earlier evaluation's ``<prefix>.md`` / ``.json`` aside to ``<prefix>-<mtime>.*``
    (the default --out only: a path the user names is theirs to overwrite)."""
    import time

    for suffix in (".md", ".json"):
        old = prefix.with_suffix(suffix)
        if old.is_file():
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(old.stat().st_mtime))
            kept = old.with_name(f"{prefix.name}-{stamp}{suffix}")
            old.rename(kept)
            print(f"kept the earlier results {old} as {kept}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from mdlmpe_ds.data.corpora import EVAL_CORPORA
    from mdlmpe_ds.diffusion.elbo import T_SAMPLING
    from mdlmpe_ds.diffusion.layouts import LAYOUTS
    from mdlmpe_ds.evaluation.loading import load_model, load_tokenizer
    from mdlmpe_ds.evaluation.perplexity import EvalSettings, markdown_table, score_corpus, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="exported directories or training output dirs")
    parser.add_argument("--names", nargs="+", help="row names (default: the directories' names)")
    parser.add_argument("--corpora", nargs="+", default=list(EVAL_CORPORA))
    parser.add_argument(
        "--seq_len",
        type=int,
        default=None,
        help="window length, at most the model's max_seq_len (default: it)",
    )
    parser.add_argument("--max_sequences", type=int, default=64)
    parser.add_argument("--num_samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--t_sampling", choices=T_SAMPLING, default="antithetic")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--device", default=None, help="torch device (default: cuda when available, else cpu)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help=f"output prefix (.md / .json); default {DEFAULT_OUT}, whose earlier results are kept "
        "beside it with their time",
    )
    parser.add_argument(
        "--corruption", nargs="+", default=None, choices=LAYOUTS, help="score by mask layout (paired)"
    )
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = DEFAULT_OUT
        keep_earlier(Path(DEFAULT_OUT))
    from mdlmpe_ds.training.log_setup import configure

    configure(stream="stderr")  # stdout holds the results table
    check_arguments(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.corruption:
        return evaluate_layouts(args, device)
    scores, settings = [], None
    for i, path in enumerate(args.models):
        model, tok_dir = load_model(path, device=device, dtype=args.dtype)
        if tok_dir is None:
            raise SystemExit(f"{path}: no tokenizer recorded with this model")
        check_length(args.seq_len, model, path)
        tokenizer = load_tokenizer(tok_dir)
        name = args.names[i] if args.names else Path(path).resolve().name
        settings = EvalSettings(
            seq_len=args.seq_len or model.config.max_seq_len,
            max_sequences=args.max_sequences,
            num_samples=args.num_samples,
            seed=args.seed,
            t_sampling=args.t_sampling,
            batch_size=args.batch_size,
        )
        for corpus in args.corpora:
            score = score_corpus(model, tokenizer, corpus, settings, name)
            print(
                f"{name:24s} {corpus:22s} ppl {score.perplexity:10.2f} "
                f"[{score.ppl_low:.2f}, {score.ppl_high:.2f}]  {score.tokens} tokens",
                flush=True,
            )
            scores.append(score)
    md, js = write_results(scores, settings, args.out)
    print("\n" + markdown_table(scores) + f"\n\nwritten: {md}, {js}")
    return 0


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The arguments that can be checked before a model is loaded: counts, corpus names, device
    (--num_samples is checked against --t_sampling by diffusion/elbo.py)."""
    from mdlmpe_ds.data.corpora import unknown_corpus
    from mdlmpe_ds.models.device import check_device

    if args.names and len(args.names) != len(args.models):
        parser.error(f"--names has {len(args.names)} entries for {len(args.models)} models")
    for flag, value, low, why in (
        ("--max_sequences", args.max_sequences, 1, "windows scored per corpus"),
        ("--batch_size", args.batch_size, 1, "windows per forward pass"),
        ("--seq_len", args.seq_len, 2, "tokens per window"),
    ):
        if value is not None and value < low:
            parser.error(f"{flag} {value}: must be >= {low} ({why})")
    for corpus in args.corpora:
        error = unknown_corpus(corpus)
        if error is not None:
            parser.error(f"--corpora: {error}")
    if args.device is not None:
        try:
            check_device(args.device)
        except ValueError as err:
            parser.error(str(err))


def check_length(seq_len: int | None, model, path: str) -> None:
    """Refuse windows longer than the model was trained for (as launch/generate.py does): positions
    past max_seq_len were never trained (no row of an absolute table, MDLMPE's L_ref), so the
    perplexity printed would describe untrained positions."""
    limit = model.config.max_seq_len
    if seq_len is not None and seq_len > limit:
        raise SystemExit(
            f"--seq_len {seq_len} is longer than the maximum length {limit} of {path} (max_seq_len in its "
            f"config): positions past it were never trained; use --seq_len {limit} or less (the default is "
            "the model's own)"
        )


def check_same_tokenizer(models: list[tuple[str, Any]]) -> None:
    """Refuse to pair models whose tokenizers differ: each model's windows are cut from its own
    token stream, so window i holds different text for each, and the paired difference (printed
    with a small standard error) would compare different text."""
    base_name, base = models[0]
    for name, tokenizer in models[1:]:
        if tokenizer.get_vocab() != base.get_vocab():
            raise SystemExit(
                f"--corruption pairs every model with the first one ({base_name}) on the same windows, but "
                f"{name}'s tokenizer ({len(tokenizer):,} tokens) is not {base_name}'s ({len(base):,} "
                "tokens): their windows would hold different text, so a paired difference would mean "
                "nothing. Pair only models that share a tokenizer (run evaluate.py once per tokenizer), "
                "or leave out --corruption to score each model on its own"
            )


def evaluate_layouts(args: argparse.Namespace, device: str) -> int:
    """Paired scoring by corruption layout (module doc); writes <out>.md and <out>.json."""
    import json
    from dataclasses import asdict

    from mdlmpe_ds.evaluation.loading import load_model, load_tokenizer, tokenizer_dir_of
    from mdlmpe_ds.experiments.layout_eval import (
        LayoutEvalSettings,
        corpus_batches,
        layout_markdown,
        score_layouts,
        summarise,
    )

    names = [args.names[i] if args.names else Path(path).resolve().name for i, path in enumerate(args.models)]
    tokenizers: dict[str, Any] = {}  # each tokenizer directory read once

    def tokenizer_at(directory: str) -> Any:
        if directory not in tokenizers:
            tokenizers[directory] = load_tokenizer(directory)
        return tokenizers[directory]

    recorded = [tokenizer_dir_of(path) for path in args.models]
    if len(recorded) > 1 and all(recorded):  # before minutes of loading weights
        check_same_tokenizer([(name, tokenizer_at(d)) for name, d in zip(names, recorded)])
    models = []
    for name, path in zip(names, args.models):
        model, tok_dir = load_model(path, device=device, dtype=args.dtype)
        if tok_dir is None:
            raise SystemExit(f"{path}: no tokenizer recorded with this model")
        check_length(args.seq_len, model, path)
        models.append((name, model, tokenizer_at(tok_dir)))
    check_same_tokenizer([(name, tokenizer) for name, _, tokenizer in models])  # hub ids: known only now
    settings = LayoutEvalSettings(
        seq_len=args.seq_len or models[0][1].config.max_seq_len,
        windows=args.max_sequences,
        draws=args.num_samples,
        seed=args.seed,
        t_sampling=args.t_sampling,
        batch_size=args.batch_size,
        layouts=tuple(args.corruption),
    ).validate()
    sections, tables = [], {}
    for corpus in args.corpora:
        scores = {}
        for name, model, tokenizer in models:
            batches = corpus_batches(corpus, tokenizer, settings, model.config.family)

            def logits(ids, valid, model=model):
                return model(ids.to(device), valid=valid.to(device))

            scores[name] = score_layouts(logits, batches, model.config.mask_token_id, settings)
        tables[corpus] = summarise(scores, settings)
        sections.append(layout_markdown(tables[corpus], corpus))
        print(sections[-1] + "\n", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md, js = out.with_suffix(".md"), out.with_suffix(".json")
    note = (
        f"{settings.draws} {settings.t_sampling} draws per window and layout (seed {settings.seed}), "
        f"the first {settings.windows} windows of {settings.seq_len} tokens; the same masks for every model."
    )
    md.write_text("\n\n".join(sections) + "\n\n" + note + "\n")
    js.write_text(json.dumps({"settings": asdict(settings), "tables": tables}, indent=1) + "\n")
    print(f"written: {md}, {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
