"""The mechanism study's evaluation and report (launch/mechanism_study.py).

For every trained run: the paired layout evaluation (``layout_eval.score_layouts``) on the same
windows and masks, and again under the knockouts (``knockout.py``): the two layout knockouts and
MDLMPE off (MDLMPE runs), the context knockout (visible tokens shuffled; every run: it shows whether
a model uses its context at all), and the shuffle knockout on RoPE runs as the control that must
change nothing. Beside them the reference lines of the same windows and masks
(``reference_lines.py``: unigram, bigram), which a model must beat before its knockouts mean
anything. Each
run's sums are cached in ``<run>/mechanism_eval.json`` keyed by the settings and the corpus, so a
re-run scores only what is missing. The report pairs, per seed, MDLMPE against RoPE (same seed:
same initial-weight seed, data order and training masks) and each knockout against the plain
MDLMPE model, per layout and per local-density bucket, with paired standard errors over windows;
across seeds it gives the mean and the spread of the per-seed differences.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from mdlmpe_ds.data.corpora import load_packed_corpus
from mdlmpe_ds.evaluation.loading import load_model, load_tokenizer
from mdlmpe_ds.experiments.knockout import KNOCKOUTS, knockout, shuffle_context
from mdlmpe_ds.experiments.layout_eval import (
    LayoutEvalSettings,
    WindowScores,
    corpus_batches,
    paired_difference,
    ratio_se,
    score_layouts,
    scores_from_json,
    scores_to_json,
)
from mdlmpe_ds.experiments.reference_lines import REFERENCE_FIT_TOKENS, ngram_log_probs, reference_scores
from mdlmpe_ds.models.config import ModelConfig
from mdlmpe_ds.training import checkpoint as ckpt

CACHE = "mechanism_eval.json"
REFERENCE_CACHE = "reference_lines.json"
# Every knockout of an MDLMPE run; a RoPE run gets the shuffle control and the context knockout.
MDLMPE_MODES = (*KNOCKOUTS, "off", "context")
ROPE_MODES = ("shuffle", "context")


def _modes(encoding: str) -> tuple[str, ...]:
    return MDLMPE_MODES if encoding == "mdlmpe" else ROPE_MODES


def evaluate_run(
    directory: Path,
    corpus: str,
    settings: LayoutEvalSettings,
    device: str = "cpu",
    store_dir: Path | None = None,
) -> dict[str, dict[str, WindowScores]]:
    """``{"plain": scores, "shuffle": ..., "constant": ...}`` of one run (``constant`` for MDLMPE
    only), from the cache when it was made with the same settings and corpus. The model runs on
    ``device`` in fp32 (not part of the cache key: the device changes the sums by rounding only);
    ``store_dir``: where the scored corpus is tokenised once for every run (None: in memory)."""

    wanted = {"settings": asdict(settings), "corpus": corpus}
    cache = directory / CACHE
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if json.loads(json.dumps(wanted)) == {k: saved.get(k) for k in wanted} and set(
            _modes(saved.get("encoding", "mdlmpe"))
        ) <= set(saved["scores"]):
            return {name: scores_from_json(s) for name, s in saved["scores"].items()}, True
    model, tok_dir = load_model(directory, device=device)
    tokenizer = load_tokenizer(tok_dir)
    batches = corpus_batches(corpus, tokenizer, settings, model.config.family, store_dir)
    mask_id = model.config.mask_token_id

    def logits(ids, valid):
        return model(ids.to(device), valid=valid.to(device))

    out = {"plain": score_layouts(logits, batches, mask_id, settings)}
    encoding = model.config.position_encoding
    for mode in _modes(encoding):
        if mode == "context":
            generator = torch.Generator().manual_seed(settings.seed)

            def shuffled(ids, valid, generator=generator):
                return logits(shuffle_context(ids, valid, mask_id, generator), valid)

            out[mode] = score_layouts(shuffled, batches, mask_id, settings)
        else:
            with knockout(model, mode, seed=settings.seed):
                out[mode] = score_layouts(logits, batches, mask_id, settings)
    tmp = cache.with_suffix(".tmp")
    payload = {**wanted, "encoding": encoding, "scores": {k: scores_to_json(v) for k, v in out.items()}}
    tmp.write_text(json.dumps(payload) + "\n")
    tmp.replace(cache)
    return out, False


def reference_lines(
    out: Path, directory: Path, corpus: str, settings: LayoutEvalSettings, store_dir: Path | None = None
) -> dict[str, dict[str, WindowScores]]:
    """The unigram and bigram reference lines (reference_lines.py) of ``corpus``'s scored windows,
    fitted on the training windows of the run in ``directory`` (its corpus, document split and
    token store, read from its checkpoint) with its tokenizer; cached in
    ``<out>/reference_lines.json`` under the settings, the scored corpus, the training data and the
    tokenizer."""

    # the checkpoint's metadata holds all of it: the model's config, its tokenizer, its training data
    # (no weights are consolidated, and a cache hit reads nothing else)
    saved = ckpt.read_saved_run(ckpt.resolve_checkpoint(directory))
    cfg, tok_dir = ModelConfig.from_dict(saved.model_config, stored=True), saved.tokenizer
    data = saved.run_config["data"]
    train = {k: data.get(k) for k in ("dataset", "text_split", "text_column", "max_documents")}
    wanted = json.loads(
        json.dumps(
            {
                "settings": asdict(settings),
                "corpus": corpus,
                "train": train,
                "fit_tokens": REFERENCE_FIT_TOKENS,
                "tokenizer": str(tok_dir),
            }
        )
    )
    cache = out / REFERENCE_CACHE
    if cache.is_file():
        saved_lines = json.loads(cache.read_text())
        if {k: saved_lines.get(k) for k in wanted} == wanted:
            return {name: scores_from_json(s) for name, s in saved_lines["scores"].items()}
    tokenizer = load_tokenizer(tok_dir)
    # the run's own training windows, from the token store its training built (same key: reused);
    # runs.assembly.store_dir's rule, with the run's folder where it is now
    store = Path(data["store_dir"]) if data.get("store_dir") else directory / "data_cache"
    windows = load_packed_corpus(
        train["dataset"], tokenizer, settings.seq_len, split=train["text_split"],
        text_column=train["text_column"], max_documents=train["max_documents"], cache_dir=store,
        role="train",
    )  # fmt: skip
    log_uni, log_bi = ngram_log_probs(windows, cfg.vocab_size, max_tokens=REFERENCE_FIT_TOKENS)
    batches = corpus_batches(corpus, tokenizer, settings, cfg.family, store_dir)
    scores = reference_scores(batches, cfg.mask_token_id, settings, log_uni, log_bi)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({**wanted, "scores": {k: scores_to_json(v) for k, v in scores.items()}}) + "\n")
    tmp.replace(cache)
    return scores


def _pair(a: WindowScores, b: WindowScores, nb: int) -> dict:
    if a.tokens != b.tokens or a.bucket_n != b.bucket_n:
        raise ValueError("paired scores come from different windows or masks")
    delta, se = paired_difference(a.loss, b.loss, a.tokens)
    buckets = []
    for j in range(nb):
        xa = [row[j] for row in a.bucket_ce]
        xb = [row[j] for row in b.bucket_ce]
        n = [row[j] for row in a.bucket_n]
        d, s = paired_difference(xa, xb, n)
        buckets.append({"delta": d, "se": s, "tokens": sum(n)})
    return {"delta": delta, "se": se, "buckets": buckets}


def _across(cells: list[dict]) -> dict:
    """Mean over seeds of the per-seed differences, their sd, and the mean's within-seed SE. A
    bucket no window reached has a NaN difference; its mean and sd are NaN too (``statistics``
    cannot take a NaN)."""
    deltas = [c["delta"] for c in cells]
    finite = all(math.isfinite(d) for d in deltas)
    spread = (statistics.stdev(deltas) if finite else math.nan) if len(deltas) > 1 else None
    return {
        "mean": statistics.fmean(deltas) if finite else math.nan,
        "sd_over_seeds": spread,
        "paired_se_of_mean": (sum(c["se"] ** 2 for c in cells) ** 0.5) / len(cells),
        "per_seed": deltas,
        "per_seed_se": [c["se"] for c in cells],
    }


def summarise_study(
    evaluated: dict[tuple[str, int], dict[str, dict[str, WindowScores]]],
    settings: LayoutEvalSettings,
    reference: dict[str, dict[str, WindowScores]] | None = None,
) -> dict:
    """Every number of the report from ``{(encoding, seed): evaluate_run(...)}`` and the reference
    lines ``{"unigram": {layout: scores}, ...}`` of the same windows and masks."""
    layouts, nb = list(settings.layouts), len(settings.buckets) - 1
    seeds = sorted({seed for _, seed in evaluated})
    labels = [f"[{lo:g}, {hi:g})" for lo, hi in zip(settings.buckets[:-1], settings.buckets[1:])]
    nll: dict = {}
    for (encoding, seed), runs in evaluated.items():
        for layout in layouts:
            s = runs["plain"][layout]
            value, se = ratio_se(s.loss, s.tokens)
            nll.setdefault(encoding, {}).setdefault(layout, []).append(
                {"seed": seed, "nll": value, "se": se, "tokens": sum(s.tokens)}
            )
    out: dict = {"layouts": layouts, "buckets": labels, "seeds": seeds, "nll": nll, "reference": {}}
    for name, scores in (reference or {}).items():
        out["reference"][name] = {}
        for layout in layouts:
            value, se = ratio_se(scores[layout].loss, scores[layout].tokens)
            out["reference"][name][layout] = {"nll": value, "se": se}
    paired_seeds = [s for s in seeds if ("rope", s) in evaluated and ("mdlmpe", s) in evaluated]
    if paired_seeds:
        out["mdlmpe_minus_rope"] = {}
        for layout in layouts:
            cells = [
                _pair(evaluated[("mdlmpe", s)]["plain"][layout], evaluated[("rope", s)]["plain"][layout], nb)
                for s in paired_seeds
            ]
            buckets = [
                {**_across([c["buckets"][j] for c in cells]), "tokens": cells[0]["buckets"][j]["tokens"]}
                for j in range(nb)
            ]
            out["mdlmpe_minus_rope"][layout] = {**_across(cells), "buckets": buckets}
    knock_seeds = [s for s in seeds if ("mdlmpe", s) in evaluated]
    out["knockout"] = {}
    for mode in MDLMPE_MODES:
        if not all(mode in evaluated[("mdlmpe", s)] for s in knock_seeds):
            continue  # scored before this knockout existed
        out["knockout"][mode] = {}
        for layout in layouts:
            cells = [
                _pair(evaluated[("mdlmpe", s)][mode][layout], evaluated[("mdlmpe", s)]["plain"][layout], nb)
                for s in knock_seeds
            ]
            if cells:
                out["knockout"][mode][layout] = _across(cells)
    control = [
        _pair(evaluated[("rope", s)]["shuffle"][layout], evaluated[("rope", s)]["plain"][layout], nb)["delta"]
        for s in seeds
        if ("rope", s) in evaluated
        for layout in layouts
    ]
    if control:  # a RoPE model has no availability features: its knockout must change nothing
        out["rope_knockout_max_abs_delta"] = max(abs(d) for d in control)
    rope_seeds = [s for s in seeds if ("rope", s) in evaluated and "context" in evaluated[("rope", s)]]
    if rope_seeds:
        out["rope_context"] = {
            layout: _across(
                [
                    _pair(
                        evaluated[("rope", s)]["context"][layout], evaluated[("rope", s)]["plain"][layout], nb
                    )
                    for s in rope_seeds
                ]
            )
            for layout in layouts
        }
    return out


def _pm(cell: dict) -> str:
    text = f"{cell['mean']:+.4f} ± {cell['paired_se_of_mean']:.4f}"
    if cell.get("sd_over_seeds") is not None:
        text += f" (sd over seeds {cell['sd_over_seeds']:.4f})"
    return text


def markdown(summary: dict, settings: LayoutEvalSettings, meta: dict) -> str:
    layouts = summary["layouts"]
    lines = [
        "# Does MDLMPE use the mask layout?",
        "",
        f"Training: {meta['training']}; seeds {summary['seeds']}; wall time {meta['wall_time_s']:.0f} s "
        f"({meta['environment']}).",
        f"Scored: the first {settings.windows} windows of {settings.seq_len} tokens of {meta['corpus']}, "
        f"{settings.draws} {settings.t_sampling} draws per window and layout (eval seed {settings.seed}); "
        "the same windows, masks and noise levels for every model and layout.",
        "",
        "## NLL per token by layout (nats; ± s.e. over windows)",
        "",
        "| model | " + " | ".join(layouts) + " |",
        "|---|" + "---|" * len(layouts),
    ]
    for encoding, cells in summary["nll"].items():
        for seed in summary["seeds"]:
            row = []
            for layout in layouts:
                hit = [c for c in cells[layout] if c["seed"] == seed]
                row.append(f"{hit[0]['nll']:.4f} ± {hit[0]['se']:.4f}" if hit else "–")
            if any(r != "–" for r in row):
                lines.append(f"| {encoding} seed {seed} | " + " | ".join(row) + " |")
    for name, cells in summary.get("reference", {}).items():
        row = [f"{cells[layout]['nll']:.4f} ± {cells[layout]['se']:.4f}" for layout in layouts]
        lines.append(f"| reference: {name} | " + " | ".join(row) + " |")
    tokens = [str(int(summary["nll"][next(iter(summary["nll"]))][lay][0]["tokens"])) for lay in layouts]
    lines.append("| tokens scored per model | " + " | ".join(tokens) + " |")
    if summary.get("reference"):
        lines += [
            "",
            "Reference lines (same windows, masks and weights): `unigram` ignores all context; "
            "`bigram` sees each token's clean left neighbour even when it is masked. A model at the "
            "unigram line has not learned to use context, so no knockout below can show anything.",
        ]
    if "mdlmpe_minus_rope" in summary:
        diff = summary["mdlmpe_minus_rope"]
        lines += [
            "",
            "## MDLMPE − RoPE (nats per token; negative: MDLMPE better)",
            "",
            "Mean over seeds of the paired per-seed difference ± its paired s.e. over windows "
            "(Monte-Carlo and window sampling, given the trained models); the sd over seeds is the "
            "training-seed variation.",
            "",
            "| layout | ΔNLL |",
            "|---|---|",
            *[f"| {layout} | {_pm(diff[layout])} |" for layout in layouts],
            "",
            "Masked-token CE difference by |local visible fraction − (1 − p)|:",
            "",
            "| layout | " + " | ".join(summary["buckets"]) + " |",
            "|---|" + "---|" * len(summary["buckets"]),
        ]
        for layout in layouts:
            cells = [
                f"{b['mean']:+.3f} ± {b['paired_se_of_mean']:.3f} ({int(b['tokens'])})"
                if b["tokens"]
                else "–"
                for b in diff[layout]["buckets"]
            ]
            lines.append(f"| {layout} | " + " | ".join(cells) + " |")
    if summary["knockout"].get("shuffle"):
        lines += [
            "",
            "## Layout knockout on the trained MDLMPE models (NLL(knocked) − NLL, nats per token)",
            "",
            "shuffle / constant: A and D rebuilt from the visible indicator shuffled within each row "
            "(same count) or made constant at the row's visible fraction; token ids unchanged. "
            "Positive: the model uses where the visible tokens are. off: gamma and delta set to 0 "
            "(the RoPE backbone of the trained weights). context: the visible tokens shuffled among "
            "the visible positions (the layout kept): what the model gets from its context at all."
            + (
                f" Control: the shuffle knockout of the RoPE models changes their NLL by at most "
                f"{summary['rope_knockout_max_abs_delta']:.1e} nats (no features to knock out)."
                if "rope_knockout_max_abs_delta" in summary
                else ""
            ),
            "",
            "| layout | " + " | ".join(summary["knockout"]) + " |",
            "|---|" + "---|" * len(summary["knockout"]),
        ]
        for layout in layouts:
            lines.append(
                f"| {layout} | "
                + " | ".join(_pm(summary["knockout"][m][layout]) for m in summary["knockout"])
                + " |"
            )
    if summary.get("rope_context"):
        lines += ["", "Context knockout on the RoPE models (NLL(knocked) − NLL):", ""]
        lines += [f"- {layout}: {_pm(summary['rope_context'][layout])}" for layout in layouts]
    return "\n".join(lines) + "\n"


def figure(summary: dict, path: Path, title: str) -> Path:
    """Left: MDLMPE − RoPE per layout; middle: the knockouts per layout (per-seed points, mean ±
    2 paired s.e.); right: MDLMPE − RoPE masked-token CE per local-density-deviation bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = summary["layouts"]
    panels = [("MDLMPE − RoPE", {"mdlmpe − rope": summary.get("mdlmpe_minus_rope", {})})]
    panels.append(("layout knockout (MDLMPE)", {m: summary["knockout"][m] for m in summary["knockout"]}))
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.6), sharey=False)
    for ax, (name, series) in zip(axes, panels):
        width = 0.8 / max(1, len(series))
        for k, (label, cells) in enumerate(series.items()):
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(layouts))]
            for x, layout in zip(xs, layouts):
                cell = cells.get(layout)
                if not cell:
                    continue
                ax.errorbar(x, cell["mean"], yerr=2 * cell["paired_se_of_mean"], fmt="o", capsize=3,
                            color=f"C{k}", label=label if layout == layouts[0] else None)  # fmt: skip
                ax.plot([x] * len(cell["per_seed"]), cell["per_seed"], "x", color=f"C{k}", alpha=0.6)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(layouts)), layouts)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("Δ NLL (nats / token)")
        if series:
            ax.legend(fontsize=7)
    ax = axes[2]
    diff = summary.get("mdlmpe_minus_rope", {})
    for k, layout in enumerate(layouts):
        cells = diff.get(layout, {}).get("buckets", [])
        xs = [j + (k - (len(layouts) - 1) / 2) * 0.2 for j, c in enumerate(cells) if c["tokens"]]
        kept = [c for c in cells if c["tokens"]]
        if kept:
            ax.errorbar(xs, [c["mean"] for c in kept], yerr=[2 * c["paired_se_of_mean"] for c in kept],
                        fmt="o-", capsize=3, color=f"C{k}", label=layout)  # fmt: skip
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(summary["buckets"])), summary["buckets"], fontsize=7)
    ax.set_xlabel("|local visible fraction − (1 − t)|", fontsize=8)
    ax.set_ylabel("Δ masked-token CE (nats)")
    ax.set_title("MDLMPE − RoPE by local-density deviation", fontsize=9)
    if diff:
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(summary: dict, settings: LayoutEvalSettings, out: Path, meta: dict) -> None:
    """mechanism.md, mechanism.json and mechanism.png under ``out``."""
    (out / "mechanism.md").write_text(markdown(summary, settings, meta))
    payload = {"summary": summary, "settings": asdict(settings), "meta": meta}
    (out / "mechanism.json").write_text(json.dumps(payload, indent=1) + "\n")
    title = f"{meta.get('title', '')}; seeds {summary['seeds']}; mean ± 2 paired s.e., x: per seed"
    figure(summary, out / "mechanism.png", title)
