"""The controlled position-encoding comparison (paper §4.3, Table 2): pretrain one model per
encoding and seed on the same data, order and corruption, then score every model zero-shot on the
same corpora with the same masks, and summarise mean ± std over seeds.

Matched runs differ only in the position module: for one seed, every encoding gets the same
``train.seed`` (initial-weight RNG, data order, corruption draws keyed by window index), the same
tokenizer, optimizer, schedule and length. Each run is its own pretraining job, the user's pretraining
command ``launch/pretrain.py`` run as a subprocess (its own processes, checkpoints and TensorBoard under
``<out>/runs/<encoding>-seed<seed>``) started with ``--resume auto``: an interrupted comparison
picks up where it stopped, finished runs (a ``summary.json``) and finished evaluations (an
``eval.json`` with the same settings) are reused.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mdlmpe_ds.evaluation.loading import load_model, load_tokenizer
from mdlmpe_ds.evaluation.perplexity import CorpusScore, EvalSettings, score_corpus

REPO = Path(__file__).resolve().parents[2]
# The pretraining command every run executes, from the repository root (a subprocess, never imported).
PRETRAIN_SCRIPT = "launch/pretrain.py"
SUMMARY = "summary.json"
#: The pretraining command (script and flags) a run finished with, written by ``train_all``.
COMMAND = "compare_command.json"
EVAL = "eval.json"

# Encoding name -> pretraining overrides. The mdlmpe-{binary,gaussian,basis} rows are paper Table 4's
# ablation ladder: availability bit only, + Gaussian window, + sine basis, + embedding path (= mdlmpe);
# mdlmpe-shared is the method with one phase MLP for all layers (docs/method.md).
ENCODINGS: dict[str, dict[str, Any]] = {
    "rope": {"position_encoding": "rope"},
    "alibi": {"position_encoding": "alibi"},
    "absolute": {"position_encoding": "absolute"},
    "mdlmpe": {"position_encoding": "mdlmpe"},
    "mdlmpe-binary": {
        "position_encoding": "mdlmpe",
        "mdlmpe": {"use_gaussian": False, "coordinate": "none", "use_embedding": False},
    },
    "mdlmpe-gaussian": {
        "position_encoding": "mdlmpe",
        "mdlmpe": {"use_gaussian": True, "coordinate": "none", "use_embedding": False},
    },
    "mdlmpe-basis": {
        "position_encoding": "mdlmpe",
        "mdlmpe": {"use_gaussian": True, "coordinate": "sine", "use_embedding": False},
    },
    # The full method with one phase MLP for the whole model instead of one per layer.
    "mdlmpe-shared": {"position_encoding": "mdlmpe", "mdlmpe": {"phase_mlp": "shared"}},
}
MAIN_ENCODINGS = ("rope", "alibi", "absolute", "mdlmpe")


def run_dir(out: Path, encoding: str, seed: int) -> Path:
    return out / "runs" / f"{encoding}-seed{seed}"


def pretrain_command(
    launcher: list[str], encoding: str, seed: int, directory: Path, ds_config: str, forwarded: list[str]
) -> list[str]:
    """The pretraining command of one matched run (``forwarded``: the user's extra flags):
    launch/pretrain.py under ``launcher`` (python, or a distributed launcher)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; choose from {', '.join(ENCODINGS)}")
    spec = ENCODINGS[encoding]
    cmd = [*launcher, PRETRAIN_SCRIPT, "--deepspeed", ds_config, *forwarded]
    cmd += ["--position_encoding", spec["position_encoding"]]
    if "mdlmpe" in spec:
        cmd += ["--model.mdlmpe", json.dumps(spec["mdlmpe"])]
    return [*cmd, "--seed", str(seed), "--output_dir", str(directory), "--resume", "auto"]


def default_launcher() -> list[str]:
    """CPU: plain python (the pretraining command re-launches itself on 2 CPU ranks); GPU: the
    deepspeed launcher."""
    import torch

    if torch.cuda.is_available():
        return ["deepspeed"]
    return [sys.executable]


def _finished_with(directory: Path) -> list[str] | None:
    """The flags the run in ``directory`` finished with (None: not recorded, or unreadable)."""
    try:
        return json.loads((directory / COMMAND).read_text())
    except (OSError, ValueError):
        return None


def train_all(
    encodings: list[str],
    seeds: list[int],
    out: Path,
    ds_config: str,
    forwarded: list[str],
    launcher: list[str],
) -> None:
    """Pretrain every (encoding, seed) that has not finished with this command (its summary.json
    and ``COMMAND``); a failure names its log.

    A run that finished with other flags (e.g. a smaller --max_steps) is run again with these: its
    ``--resume auto`` continues it to the new length, or refuses a change a resume may not make
    (resume_changes.py). Reusing it by its summary alone reported it as trained with these flags."""
    for seed in seeds:
        for encoding in encodings:
            directory = run_dir(out, encoding, seed)
            cmd = pretrain_command(launcher, encoding, seed, directory, ds_config, forwarded)
            flags = cmd[len(launcher) :]  # the script and its flags, not how it is launched
            if (directory / SUMMARY).is_file() and _finished_with(directory) == flags:
                print(f"[compare] {encoding} seed {seed}: finished earlier, reusing {directory}", flush=True)
                continue
            directory.mkdir(parents=True, exist_ok=True)
            log = directory / "train.log"
            print(f"[compare] {encoding} seed {seed}: training ({shlex.join(cmd)}), log {log}", flush=True)
            start = time.perf_counter()
            with open(log, "a") as fh:
                code = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
            if code != 0 or not (directory / SUMMARY).is_file():
                tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
                raise RuntimeError(
                    f"pretraining {encoding} seed {seed} failed (exit {code}); last lines of {log}:\n{tail}\n"
                    "fix the cause and run the same command again: finished runs are reused and this "
                    "one resumes from its last complete checkpoint"
                )
            tmp = directory / f"{COMMAND}.tmp"
            tmp.write_text(json.dumps(flags) + "\n")
            tmp.replace(directory / COMMAND)
            summary = json.loads((directory / SUMMARY).read_text())
            val = (summary.get("validation") or {}).get("val/ppl")
            print(
                f"[compare] {encoding} seed {seed}: done in {time.perf_counter() - start:.0f} s"
                + (f", validation perplexity {val:.2f}" if val is not None else ""),
                flush=True,
            )


def evaluate_all(
    encodings: list[str], seeds: list[int], out: Path, corpora: list[str], settings: EvalSettings
) -> list[CorpusScore]:
    """Score every run on every corpus (cached per run in eval.json, keyed by the settings)."""

    scores: list[CorpusScore] = []
    wanted = {"settings": asdict(settings), "corpora": list(corpora)}
    for seed in seeds:
        for encoding in encodings:
            directory = run_dir(out, encoding, seed)
            cache = directory / EVAL
            if cache.is_file():
                saved = json.loads(cache.read_text())
                if {k: saved.get(k) for k in wanted} == wanted:
                    scores += [CorpusScore(**s) for s in saved["scores"]]
                    continue
            model, tok_dir = load_model(directory)
            tokenizer = load_tokenizer(tok_dir)
            name = f"{encoding}/seed{seed}"
            mine = [score_corpus(model, tokenizer, c, settings, name) for c in corpora]
            cache.write_text(json.dumps({**wanted, "scores": [asdict(s) for s in mine]}, indent=1) + "\n")
            print(
                f"[compare] evaluated {name}: " + ", ".join(f"{s.corpus} {s.perplexity:.2f}" for s in mine),
                flush=True,
            )
            scores += mine
    return scores


def aggregate(scores: list[CorpusScore]) -> dict[str, dict[str, dict[str, float]]]:
    """encoding -> corpus -> {mean, std, n, mean_nll, tokens} of the perplexity over seeds."""
    groups: dict[tuple[str, str], list[CorpusScore]] = {}
    for s in scores:
        groups.setdefault((s.model.split("/")[0], s.corpus), []).append(s)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (encoding, corpus), items in groups.items():
        ppl = [s.perplexity for s in items]
        out.setdefault(encoding, {})[corpus] = {
            "mean": statistics.fmean(ppl),
            "std": statistics.stdev(ppl) if len(ppl) > 1 else 0.0,
            "n": len(ppl),
            "mean_nll": statistics.fmean(s.nll for s in items),
            "mc_stderr_nll": math.sqrt(sum(s.stderr**2 for s in items)) / len(items),
            "tokens": items[0].tokens,
        }
    return out


def summary_markdown(table: dict[str, dict[str, dict[str, float]]], corpora: list[str]) -> str:
    """Encodings as rows, corpora as columns, ``mean ± std`` over seeds; the best mean in bold."""
    best = {c: min(table[e][c]["mean"] for e in table if c in table[e]) for c in corpora}
    lines = ["| encoding | " + " | ".join(corpora) + " |", "|---|" + "---|" * len(corpora)]
    for encoding, cells in table.items():
        row = []
        for c in corpora:
            if c not in cells:
                row.append("–")
                continue
            text = f"{cells[c]['mean']:.2f} ± {cells[c]['std']:.2f}"
            row.append(f"**{text}**" if cells[c]["mean"] == best[c] else text)
        lines.append(f"| {encoding} | " + " | ".join(row) + " |")
    seeds = max(cells[c]["n"] for cells in table.values() for c in cells)
    tokens = [str(next(iter(table.values()))[c]["tokens"]) for c in corpora]
    lines.append(f"| tokens scored (seeds: {seeds}) | " + " | ".join(tokens) + " |")
    return "\n".join(lines)


def bar_chart(
    table: dict[str, dict[str, dict[str, float]]], corpora: list[str], path: Path, title: str
) -> Path:
    """Grouped bars: one group per corpus, one bar per encoding, error bars = std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    encodings = list(table)
    width = 0.8 / max(1, len(encodings))
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(corpora), 3.6))
    for k, encoding in enumerate(encodings):
        xs = [i + (k - (len(encodings) - 1) / 2) * width for i in range(len(corpora))]
        means = [table[encoding].get(c, {}).get("mean", float("nan")) for c in corpora]
        stds = [table[encoding].get(c, {}).get("std", 0.0) for c in corpora]
        ax.bar(xs, means, width, yerr=stds, capsize=3, label=encoding)
    ax.set_xticks(range(len(corpora)), corpora)
    ax.set_ylabel("diffusion-ELBO perplexity (lower is better)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(
    scores: list[CorpusScore], corpora: list[str], settings: EvalSettings, out: Path, meta: dict
) -> dict:
    """compare.md / compare.json / compare.png under ``out``; returns the aggregate table."""
    table = aggregate(scores)
    md = summary_markdown(table, corpora)
    note = (
        f"Diffusion-ELBO perplexity bound, mean ± std over seeds {meta['seeds']}; "
        f"{settings.num_samples} {settings.t_sampling} draws per window (eval seed {settings.seed}), "
        f"first {settings.max_sequences} windows of {settings.seq_len} tokens per corpus, the same "
        f"masks for every model. Training: {meta['training']}."
    )
    (out / "compare.md").write_text(md + "\n\n" + note + "\n")
    (out / "compare.json").write_text(
        json.dumps(
            {
                "table": table,
                "settings": asdict(settings),
                "meta": meta,
                "scores": [asdict(s) for s in scores],
            },
            indent=1,
        )
        + "\n"
    )
    bar_chart(
        table, corpora, out / "compare.png", f"{meta['training']}; mean ± std over {len(meta['seeds'])} seeds"
    )
    return table


def environment_note() -> str:
    import torch

    return f"torch {torch.__version__}, {os.cpu_count()} CPUs" + (
        ", CUDA" if torch.cuda.is_available() else ""
    )
