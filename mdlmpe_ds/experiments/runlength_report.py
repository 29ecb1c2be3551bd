"""The run-length study's numbers, its decision rule and its report (markdown, JSON, figure).

Every table starts from the baselines the result must beat: the Bayes cross-entropy (0), the
layout-blind entropy of the answer, and the probes of how much of the answer the feature A
carries (layout_probe.py). The decision rule is the README's, fixed before the study ran; it is
applied per geometry to the ``runs`` task with the ``iid`` control of the same geometry.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from mdlmpe_ds.experiments.layout_probe import probe_layout
from mdlmpe_ds.experiments.runlength_data import GEOMETRIES, layout_blind_entropy
from mdlmpe_ds.experiments.runlength_train import area_log_ce, updates_to

THRESHOLD = 0.1  # "learned": evaluated masked CE below this
WORKS_RATIO, FAILS_RATIO, ORACLE_RATIO, ERASED, SEEDS_BELOW = 0.6, 0.9, 1 / 3, 0.5, 0.8


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarise_arm(runs: list[dict]) -> dict:
    """Per-seed and median numbers of one arm (runs of one geometry and masking)."""
    runs = sorted(runs, key=lambda r: r["seed"])
    last = [r["history"][-1] for r in runs]
    out = {
        "seeds": [r["seed"] for r in runs],
        "updates_to": [updates_to(r["history"], THRESHOLD) for r in runs],
        "area_log_ce": [area_log_ce(r["history"]) for r in runs],
        "final_ce": [e["ce"] for e in last],
        "final_acc": [e["acc"] for e in last],
        "wall_s": sum(r["wall_s"] for r in runs),
        "diverged": [r["seed"] for r in runs if r.get("diverged_at") is not None],
        "final_gamma": [r.get("final_gamma") for r in runs],
    }
    for mode in ("shuffle", "constant", "off"):
        if all(mode in r["history"][-1] for r in runs):
            out[f"area_{mode}"] = [area_log_ce(r["history"], mode) for r in runs]
            out[f"final_{mode}"] = [r["history"][-1][mode] for r in runs]
    out["median_updates"] = _median(out["updates_to"])
    return out


def _ratio(a: float, b: float) -> float:
    if math.isinf(a) and math.isinf(b):
        return math.nan
    return a / b if b else math.inf


def decide(task: dict[str, dict], control: dict[str, dict] | None) -> dict:
    """The README's decision rule on one geometry: each criterion with its number, and the verdict."""
    rope, mdl, oracle = task.get("rope"), task.get("mdlmpe"), task.get("oracle")
    if rope is None or mdl is None:
        return {"verdict": "incomplete: needs the rope and mdlmpe arms"}
    ratio = _ratio(mdl["median_updates"], rope["median_updates"])
    below = sum(u < rope["median_updates"] for u in mdl["updates_to"])
    paired = [s for s in mdl["seeds"] if s in rope["seeds"]]
    r_area = {s: a for s, a in zip(rope["seeds"], rope["area_log_ce"])}
    lead = statistics.fmean(r_area[s] - a for s, a in zip(mdl["seeds"], mdl["area_log_ce"]) if s in paired)
    shuffled = statistics.fmean(
        r_area[s] - a for s, a in zip(mdl["seeds"], mdl["area_shuffle"]) if s in paired
    )
    erased = 1.0 - shuffled / lead if lead > 0 else math.nan
    reliance = statistics.fmean(a - b for a, b in zip(mdl["area_shuffle"], mdl["area_log_ce"]))
    control_ratio = math.nan
    if control and "rope" in control and "mdlmpe" in control:
        control_ratio = _ratio(control["mdlmpe"]["median_updates"], control["rope"]["median_updates"])
    oracle_ratio = _ratio(oracle["median_updates"], rope["median_updates"]) if oracle else math.nan
    criteria = {
        "median_ratio": ratio,
        "seeds_below_rope_median": f"{below} of {len(mdl['updates_to'])}",
        "lead_area_log_ce": lead,
        "lead_erased_by_shuffle": erased,
        "shuffle_cost_area_log_ce": reliance,
        "control_median_ratio": control_ratio,
        "oracle_median_ratio": oracle_ratio,
    }
    works = (
        ratio <= WORKS_RATIO
        and below >= SEEDS_BELOW * len(mdl["updates_to"])
        and erased >= ERASED
        and control_ratio >= FAILS_RATIO
    )
    oracle_pays = oracle_ratio <= ORACLE_RATIO
    fails = ratio >= FAILS_RATIO or (reliance > 0.1 and ratio > WORKS_RATIO)
    if works:
        verdict = "it works: MDLMPE learns the task faster, through the layout, and not on the control"
    elif fails and oracle_pays:
        verdict = (
            "it does not work: MDLMPE is not faster than RoPE, while a usable layout feature (the oracle) "
            "would have paid"
        )
    elif fails:
        verdict = "not faster than RoPE, but the oracle did not pay either: the task does not decide"
    else:
        verdict = "between the two rules: reported as measured"
    return {"criteria": criteria, "verdict": verdict}


def summarise(plan, runs: dict[tuple, dict]) -> dict:
    """Every number of the report, from ``{(geometry, masking, arm, seed): run}``."""
    out: dict = {"settings": runs and next(iter(runs.values()))["settings"], "geometries": {}}
    for geometry in plan.geometries:
        entry: dict = {"layout_blind_entropy": layout_blind_entropy(GEOMETRIES[geometry].max_run)}
        for masking in plan.maskings:
            arms: dict[str, dict] = {}
            for arm in plan.arms:
                chosen = [r for (g, m, a, _), r in runs.items() if (g, m, a) == (geometry, masking, arm)]
                if chosen:
                    arms[arm] = summarise_arm(chosen)
            entry[masking] = arms
        entry["decision"] = decide(entry.get("runs", {}), entry.get("iid"))
        out["geometries"][geometry] = entry
    return out


def _fmt(x: float, digits: int = 3) -> str:
    if isinstance(x, str):
        return x
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if math.isinf(x):
        return f">{'max'}"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"


def _updates(values: list[float], cap: int) -> str:
    return ", ".join(f">{cap}" if math.isinf(v) else f"{v:.0f}" for v in values)


def render_markdown(summary: dict, probes: dict[str, list[dict]]) -> str:
    settings = summary["settings"] or {}
    cap = settings.get("updates", 0)
    lines = [
        "# Run-length study",
        "",
        f"Settings: {settings.get('updates')} updates of {settings.get('batch')} rows, AdamW lr "
        f"{settings.get('lr')}, weight decay {settings.get('weight_decay')}, "
        f"warm-up {settings.get('warmup')}; "
        f"evaluation on {settings.get('eval_rows')} fixed rows at updates {settings.get('eval_at')}. "
        f"'Updates' = updates until the evaluated masked CE < {THRESHOLD} (interpolated in log CE).",
    ]
    for geometry, entry in summary["geometries"].items():
        lines += ["", f"## {geometry}", "", "Baselines (nats per scored token):", ""]
        lines += [
            "| reference | CE |",
            "|---|---|",
            "| Bayes (the layout gives the answer) | 0 |",
            f"| layout-blind (size-biased entropy of k) | {entry['layout_blind_entropy']:.3f} |",
        ]
        for p in probes.get(geometry, []):
            lines.append(
                f"| probe {p['probe']} on {p['inputs']} (held out; recovers {100 * p['recovered']:.0f}% "
                f"of the prior's CE) | {p['ce']:.3f} |"
            )
        for masking in ("runs", "iid"):
            arms = entry.get(masking)
            if not arms:
                continue
            title = "task (whole runs masked)" if masking == "runs" else "control (iid masking)"
            lines += ["", f"### {title}", ""]
            lines += [
                "| arm | seeds | updates to CE < 0.1 (per seed) | median | ratio to RoPE | final CE "
                "(median) | final acc | area log CE | final CE: shuffle / constant / off | wall s |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            rope = arms.get("rope")
            for arm, s in arms.items():
                ratio = _ratio(s["median_updates"], rope["median_updates"]) if rope else math.nan
                knock = " / ".join(
                    _fmt(_median(s[f"final_{m}"])) if f"final_{m}" in s else "–"
                    for m in ("shuffle", "constant", "off")
                )
                median = f">{cap}" if math.isinf(s["median_updates"]) else f"{s['median_updates']:.0f}"
                lines.append(
                    f"| {arm} | {len(s['seeds'])} | {_updates(s['updates_to'], cap)} | {median} | "
                    f"{_fmt(ratio)} | "
                    f"{_fmt(_median(s['final_ce']))} | {_fmt(_median(s['final_acc']))} | "
                    f"{_fmt(_median(s['area_log_ce']))} | {knock} | {s['wall_s']:.0f} |"
                )
        decision = entry["decision"]
        lines += ["", "Decision rule (README, fixed before the run):", ""]
        for key, value in decision.get("criteria", {}).items():
            lines.append(f"- {key.replace('_', ' ')}: {_fmt(value)}")
        lines += ["", f"**Verdict ({geometry}): {decision['verdict']}.**"]
    return "\n".join(lines) + "\n"


def draw(summary: dict, runs: dict[tuple, dict], path: Path) -> None:
    """Median evaluated CE over seeds against updates, one panel per (geometry, masking)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [(g, m) for g, e in summary["geometries"].items() for m in ("runs", "iid") if e.get(m)]
    fig = Figure(figsize=(5 * max(len(panels), 1), 4))
    FigureCanvasAgg(fig)
    for i, (geometry, masking) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for arm in summary["geometries"][geometry][masking]:
            chosen = [r for (g, m, a, _), r in runs.items() if (g, m, a) == (geometry, masking, arm)]
            updates = [e["update"] for e in chosen[0]["history"]]
            curve = [_median([r["history"][j]["ce"] for r in chosen]) for j in range(len(updates))]
            ax.plot(updates, curve, label=arm)
            if arm == "mdlmpe" and "shuffle" in chosen[0]["history"][0]:
                knocked = [_median([r["history"][j]["shuffle"] for r in chosen]) for j in range(len(updates))]
                ax.plot(updates, knocked, linestyle=":", color="grey", label="mdlmpe, b shuffled")
        ax.axhline(THRESHOLD, linestyle="--", color="black", linewidth=0.8)
        ax.axhline(summary["geometries"][geometry]["layout_blind_entropy"], linestyle="-.", color="red",
                   linewidth=0.8, label="layout-blind")  # fmt: skip
        ax.set_yscale("log")
        ax.set_xlabel("updates")
        ax.set_ylabel("masked CE (median over seeds)")
        ax.set_title(f"{geometry}, {masking}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(out: Path, plan, runs: dict[tuple, dict], probe_rows: int = 768) -> str:
    """runlength.md, runlength.json and runlength.png under ``out``; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(plan, runs)
    probes = {g: probe_layout(GEOMETRIES[g], rows=probe_rows) for g in plan.geometries}
    summary["probes"] = probes
    text = render_markdown(summary, probes)
    (out / "runlength.md").write_text(text)
    (out / "runlength.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    if runs:
        draw(summary, runs, out / "runlength.png")
    return text
