"""The suite printed with its sources, the plan, and the results as the paper lays them out.

The JSON report holds every per-item result of every model (document and prompt hashes, target,
response, score), so a comparison can be re-analysed without re-running anything.
"""

from __future__ import annotations

from typing import Any

from mdlmpe_ds.evaluation.benchmark import stats
from mdlmpe_ds.evaluation.benchmark.cache import ModelRef
from mdlmpe_ds.evaluation.benchmark.runner import Job
from mdlmpe_ds.evaluation.benchmark.suites import Suite


# ------------------------------------------------------------------------------------ the suite
def describe_suite(suite: Suite, families: list[str]) -> str:
    """Every setting of every row, with its source (the families present decide which decoding)."""
    lines = [f"suite {suite.name}: {suite.title}"]
    for spec in suite.tasks:
        lines.append(f"\n{spec.group} / {spec.row_label()} {spec.variant}".rstrip())
        for what, value in (
            ("lm-eval task", spec.task),
            ("few-shot", spec.num_fewshot),
            ("metric,filter", spec.metric),
            ("items", spec.items),
        ):
            lines.append(f"  {what:20s} {value.value!s:16s} <- {value.source}")
        for family in sorted(set(families)):
            for key, value in spec.decoding[family].items():
                lines.append(f"  {family + ' ' + key:20s} {value.value!s:16s} <- {value.source}")
    return "\n".join(lines)


def describe_plan(jobs: list[Job], overrides: dict[str, Any]) -> str:
    """Per model: its family, identity, and the forward passes still to run (cached rows cost 0)."""
    lines = []
    if overrides:
        lines.append(f"decoding overridden on the command line (every model alike): {overrides}")
    by_model: dict[str, list[Job]] = {}
    for job in jobs:
        by_model.setdefault(job.model.name, []).append(job)
    for name, mine in by_model.items():
        model = mine[0].model
        todo = [j for j in mine if j.cached is None]
        where = "local" if model.local else "hub id (not on disk; resolved when run)"
        lines.append(
            f"{name}: {model.path} [{model.family}, {where}]: {len(todo)} of {len(mine)} tasks to run, "
            f"~{sum(j.passes for j in todo):,} sequence forwards"
        )
        for job in mine:
            state = "cached" if job.cached is not None else f"~{job.passes:,} forwards"
            lines.append(f"  {job.spec.row_label():18s} {job.spec.variant:6s} {state}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ results
def build(
    suite: Suite,
    models: list[ModelRef],
    jobs: list[Job],
    results: dict[str, dict[str, list[dict]]],
    resamples: int = stats.DEFAULT_RESAMPLES,
    seed: int = 0,
) -> dict[str, Any]:
    """Per row: each model's score, every further model paired with the first, every item."""
    base = models[0].name
    settings = {(j.spec.key, j.model.name): j.settings for j in jobs}
    rows = []
    for spec in suite.tasks:
        per_model = results[spec.key]
        scores = {m.name: [i["score"] for i in per_model[m.name]] for m in models}
        paired = [
            {
                "a": base,
                "b": m.name,
                **stats.paired(scores[base], scores[m.name], resamples, seed=seed).to_dict(),
            }
            for m in models[1:]
        ]
        items = []
        for k, first in enumerate(per_model[base]):
            record = {key: first[key] for key in ("subtask", "doc_id", "doc_hash", "prompt_hash", "target")}
            record["models"] = {
                m.name: {"score": per_model[m.name][k]["score"], "response": per_model[m.name][k]["response"]}
                for m in models
            }
            items.append(record)
        rows.append(
            {
                "key": spec.key,
                "label": spec.row_label(),
                "group": spec.group,
                "variant": spec.variant,
                "settings": settings[(spec.key, base)],
                "n": len(items),
                "scores": {name: sum(s) / len(s) for name, s in scores.items()},
                "paired": paired,
                "items": items,
            }
        )
    return {
        "suite": suite.name,
        "title": suite.title,
        "models": [m.to_dict() for m in models],
        "baseline": base,
        "statistics": {
            "interval": "percentile bootstrap over items, 95%",
            "resamples": resamples,
            "seed": seed,
            "test": "exact McNemar (two-sided) on 0/1 scores",
        },
        "rows": rows,
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _delta(p: dict) -> str:
    return f"{100 * p['diff']:+.1f} [{100 * p['ci_low']:+.1f}, {100 * p['ci_high']:+.1f}]"


def _pvalue(p: dict) -> str:
    return "–" if p["mcnemar_p"] is None else f"{p['mcnemar_p']:.3g}"


def _only(p: dict) -> str:
    return "–" if p["only_a"] is None else f"{p['only_a']} / {p['only_b']}"


def _score_cells(row: dict, names: list[str]) -> list[str]:
    values = [row["scores"][n] for n in names]
    best = max(values)
    unique = values.count(best) == 1
    return [f"**{_pct(v)}**" if unique and v == best else _pct(v) for v in values]


def markdown(report: dict[str, Any]) -> str:
    names = [m["name"] for m in report["models"]]
    base = report["baseline"]
    head = ["Metric", *names]
    for other in names[1:]:
        head += [f"Δ {other} − {base} [95% CI]", "McNemar p", f"only {base} / only {other}"]
    head.append("n")
    out = [
        f"**{report['title']}** (scores in %)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    group = variant = None
    for row in report["rows"]:
        marker = row["variant"] or row["group"]
        if marker != (variant or group):
            out.append("| *" + marker + "* |" + " |" * (len(head) - 1))
            group, variant = row["group"], row["variant"]
        cells = [row["label"], *_score_cells(row, names)]
        for p in row["paired"]:
            cells += [_delta(p), _pvalue(p), _only(p)]
        cells.append(str(row["n"]))
        out.append("| " + " | ".join(cells) + " |")
    s = report["statistics"]
    out += [
        "",
        f"Δ: paired difference, {s['interval']} ({s['resamples']} resamples, seed {s['seed']}); "
        f"p: {s['test']}; only A / only B: items one model alone got right. "
        "Bold: the best score, where one model has it.",
    ]
    if any(r["variant"] for r in report["rows"]):
        out += ["", _by_variant(report, names)]
    return "\n".join(out)


def _by_variant(report: dict[str, Any], names: list[str]) -> str:
    """The paper's Table 3 layout: one row per (model, variant), one column per task."""
    labels = list(dict.fromkeys(r["label"] for r in report["rows"]))
    variants = list(dict.fromkeys(r["variant"] for r in report["rows"]))
    cell = {(r["variant"], r["label"]): r for r in report["rows"]}
    out = ["| Pos. | Variant | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 2)]
    for v in variants:
        for n in names:
            out.append(
                f"| {n} | {v} | " + " | ".join(_pct(cell[(v, lab)]["scores"][n]) for lab in labels) + " |"
            )
    return "\n".join(out)
