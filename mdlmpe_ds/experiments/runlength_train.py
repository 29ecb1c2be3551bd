"""Train and evaluate one run of the run-length study: (geometry, masking, arm, seed).

Matched in everything but the position module: for one seed every arm starts from the same backbone
weights (runlength_arms.build_arm), sees the same training rows and masks in the same order (one
data generator per seed, not per arm) and is scored on the same fixed evaluation set at the same
updates. The loss is the mean cross-entropy over the scored masked tokens of a batch.

At every evaluation an MDLMPE arm is also scored under each knockout (runlength_arms.KNOCKOUTS),
so how much of its progress flows through the layout can be read along the whole run, not only at
its end. A finished run is one JSON file; its settings are stored with it, so a re-run reuses it
only when nothing that changes its numbers has changed.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mdlmpe_ds.experiments.knockout import knockout
from mdlmpe_ds.experiments.runlength_arms import KNOCKOUTS, build_arm
from mdlmpe_ds.experiments.runlength_data import GEOMETRIES, Batch, eval_batches, make_batch
from mdlmpe_ds.seeding import mix_seed

DATA_STREAM = 7  # the training rows of a seed: mix_seed(seed, DATA_STREAM)


@dataclass(frozen=True)
class RunSettings:
    """Training and evaluation of every run of one study (the same for every arm)."""

    updates: int = 600
    batch: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 20
    # Stability: gradient-norm clipping and a cosine decay to min_lr_ratio * lr after the warm-up
    # (at a constant 3e-3 without clipping the evaluated CE spiked by up to 100x between evaluations).
    clip: float = 1.0
    min_lr_ratio: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eval_at: tuple[int, ...] = (0, 50, 100, 150, 200, 250, 300, 350, 400, 500, 600)
    eval_rows: int = 96
    eval_batch: int = 32
    eval_seed: int = 1234

    def validate(self) -> RunSettings:
        if (
            not self.eval_at
            or self.eval_at[-1] != self.updates
            or list(self.eval_at) != sorted(set(self.eval_at))
        ):
            raise ValueError(f"eval_at {self.eval_at} must be increasing and end at updates={self.updates}")
        return self


def lr_factor(update: int, settings: RunSettings) -> float:
    """Linear warm-up over ``warmup`` updates, then a cosine from 1 to ``min_lr_ratio``."""
    if update < settings.warmup:
        return (update + 1) / settings.warmup
    progress = (update - settings.warmup) / max(settings.updates - settings.warmup, 1)
    return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (
        1 + math.cos(math.pi * min(progress, 1.0))
    )


def run_path(out: Path, geometry: str, masking: str, arm: str, seed: int) -> Path:
    return out / "runs" / geometry / masking / arm / f"seed{seed}.json"


def _scored_loss(model, oracle, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Summed CE and correct count over the scored tokens of ``batch``, and their count."""
    if oracle is not None:
        oracle.gap = batch.gap
    logits = model(batch.ids).float()  # [B, L, V]
    target = batch.clean[batch.scored]  # [n]
    chosen = logits[batch.scored]  # [n, V]
    ce = F.cross_entropy(chosen, target, reduction="sum")
    correct = (chosen.argmax(-1) == target).sum()
    return ce, correct, int(target.numel())


@torch.no_grad()
def evaluate(model, oracle, batches: list[Batch]) -> dict[str, float]:
    model.eval()
    ce = correct = n = 0.0
    for batch in batches:
        c, k, m = _scored_loss(model, oracle, batch)
        ce, correct, n = ce + float(c), correct + float(k), n + m
    model.train()
    return {"ce": ce / max(n, 1), "acc": correct / max(n, 1), "tokens": n}


def train_run(
    geometry_name: str, masking: str, arm: str, seed: int, settings: RunSettings, attention: str = "dense"
) -> dict:
    """Train one run from its matched start; every number of its report entry. ``attention``: how
    MDLMPE attention is computed (runlength_arms.STUDY_ATTENTION; same numbers to fp32 rounding, so
    it is recorded with the run but is not one of the settings a finished run must match)."""
    settings.validate()
    geometry = GEOMETRIES[geometry_name] if isinstance(geometry_name, str) else geometry_name
    start = time.perf_counter()
    model, oracle = build_arm(arm, geometry, seed, attention=attention)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: lr_factor(u, settings))
    data = torch.Generator().manual_seed(mix_seed(seed, DATA_STREAM))
    evals = eval_batches(geometry, masking, settings.eval_rows, settings.eval_batch, settings.eval_seed)
    knockouts = KNOCKOUTS if model.config.position_encoding == "mdlmpe" else ()
    history: list[dict] = []
    diverged = None
    for update in range(settings.updates + 1):
        if update in settings.eval_at:
            entry = {"update": update, **evaluate(model, oracle, evals)}
            for mode in knockouts:
                with knockout(model, mode, seed=settings.eval_seed):
                    entry[mode] = evaluate(model, oracle, evals)["ce"]
            history.append(entry)
        if update == settings.updates:
            break
        batch = make_batch(geometry, masking, settings.batch, data)
        ce, _, n = _scored_loss(model, oracle, batch)
        loss = ce / max(n, 1)
        if not torch.isfinite(loss):
            diverged = update
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip)
        optimizer.step()
        schedule.step()
    encoder = model.embed.mdlmpe
    gamma = float(encoder.gamma.detach()) if encoder is not None and encoder.gate_logit is not None else None
    return {
        "geometry": geometry.name,
        "masking": masking,
        "arm": arm,
        "seed": seed,
        "settings": asdict(settings),
        "attention": attention,
        "history": history,
        "diverged_at": diverged,
        "final_gamma": gamma,
        "backbone_parameters": model.num_backbone_parameters(),
        "position_parameters": sum(p.numel() for p in model.parameters()) - model.num_backbone_parameters(),
        "wall_s": time.perf_counter() - start,
    }


def load_finished(path: Path, settings: RunSettings) -> dict | None:
    """The stored run at ``path`` when it was made with ``settings``, else None."""
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # a torn write from a killed run: train it again
    wanted = json.loads(json.dumps(asdict(settings)))
    return stored if stored.get("settings") == wanted else None


def save_run(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result) + "\n")
    tmp.replace(path)


def updates_to(history: list[dict], threshold: float, key: str = "ce") -> float:
    """Updates until the evaluated CE first falls below ``threshold``, interpolated in log CE between
    the two evaluations around the crossing; inf when it never does."""
    previous = None
    for entry in history:
        value = entry[key]
        if value < threshold:
            if previous is None or previous[1] <= 0:
                return float(entry["update"])
            u0, c0 = previous
            fraction = (math.log(c0) - math.log(threshold)) / (math.log(c0) - math.log(max(value, 1e-12)))
            return u0 + fraction * (entry["update"] - u0)
        previous = (entry["update"], value)
    return math.inf


def area_log_ce(history: list[dict], key: str = "ce") -> float:
    """Mean of log CE over the run (trapezoids over updates): lower learns faster."""
    points = [(e["update"], math.log(max(e[key], 1e-6))) for e in history]
    if len(points) < 2:
        return points[0][1] if points else math.nan
    area = sum((u1 - u0) * (a + b) / 2 for (u0, a), (u1, b) in itertools.pairwise(points))
    return area / (points[-1][0] - points[0][0])
