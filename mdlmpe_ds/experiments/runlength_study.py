"""The run-length study as one resumable job: every (geometry, masking, arm, seed) run, trained in
worker processes (one thread each), each finished run reused on the next call.

The plan is ordered so that a study stopped early holds complete, comparable slices: geometry by
geometry, the ``runs`` task before the ``iid`` control, and within them seed by seed across all
arms (so an interrupted study has every arm at the same seeds).
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from mdlmpe_ds.experiments.runlength_arms import ARMS
from mdlmpe_ds.experiments.runlength_train import RunSettings, load_finished, run_path, save_run, train_run

# The control needs only the comparison it controls: RoPE against MDLMPE at the paper's defaults.
CONTROL_ARMS = ("rope", "mdlmpe")


@dataclass
class StudyPlan:
    """What the study trains. ``arms``: the task's arms; the ``iid`` control runs CONTROL_ARMS."""

    geometries: list[str]
    seeds: list[int]
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    maskings: list[str] = field(default_factory=lambda: ["runs", "iid"])
    settings: RunSettings = field(default_factory=RunSettings)
    attention: str = "dense"  # runlength_arms.STUDY_ATTENTION: how runs still to train compute MDLMPE

    def jobs(self) -> list[tuple[str, str, str, int]]:
        out = []
        for geometry in self.geometries:
            for masking in self.maskings:
                arms = self.arms if masking == "runs" else [a for a in CONTROL_ARMS if a in self.arms]
                out += [(geometry, masking, arm, seed) for seed in self.seeds for arm in arms]
        return out


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)


def _train_and_save(
    out: Path, job: tuple[str, str, str, int], settings: RunSettings, attention: str
) -> tuple[tuple, float]:
    result = train_run(*job, settings, attention)
    save_run(run_path(out, *job), result)
    return job, result["wall_s"]


def run_study(out: Path, plan: StudyPlan, workers: int = 2, log=print) -> dict[tuple, dict]:
    """Train what is missing, then return every run of the plan ``{job: result}``."""
    plan.settings.validate()
    jobs = plan.jobs()
    missing = [job for job in jobs if load_finished(run_path(out, *job), plan.settings) is None]
    log(f"run-length study: {len(jobs)} runs, {len(jobs) - len(missing)} reused, {len(missing)} to train")
    start = time.perf_counter()
    if missing and workers <= 1:
        _worker_init()
        for i, job in enumerate(missing, 1):
            _, wall = _train_and_save(out, job, plan.settings, plan.attention)
            log(f"  [{i}/{len(missing)}] {'/'.join(map(str, job))}: {wall:.0f} s")
    elif missing:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init) as pool:
            futures = [
                pool.submit(_train_and_save, out, job, plan.settings, plan.attention) for job in missing
            ]
            for i, future in enumerate(as_completed(futures), 1):
                job, wall = future.result()
                log(f"  [{i}/{len(missing)}] {'/'.join(map(str, job))}: {wall:.0f} s")
    if missing:
        log(f"trained {len(missing)} runs in {time.perf_counter() - start:.0f} s with {workers} workers")
    return {job: load_finished(run_path(out, *job), plan.settings) for job in jobs}
