"""The mechanism figures (paper Appendix F): each figure's paper geometry, its numbers and its
drawing, written as PNG + JSON (and optionally to TensorBoard). ``launch/analyze.py mechanism`` is the
command line; it passes its parsed options here.

Options left unset take each figure's paper default (Appendix F): topologies at L=256, W/L=3/16;
envelope and transfer at L=1024, W/L=3/16; jacobian and boundary at L=256, W/L=1/4 (W=64,
sigma=16); rho=1/4, theta=500000 (LLaDA), d_h=128, pair f=12. A value given on the command line
applies to every selected figure.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mdlmpe_ds.analysis import mechanism
from mdlmpe_ds.analysis.mechanism_setup import Geometry, MechanismResult
from mdlmpe_ds.analysis.plots import DRAW, TensorBoardImages, new_figure, save_json, save_png

FIGURES = ("topologies", "envelope", "transfer", "jacobian", "ratio_angle", "boundary")

# Paper defaults per figure (Appendix F preamble; Figure 4 caption).
_FIGURE_GEOMETRY: dict[str, dict[str, float]] = {
    "topologies": {"length": 256, "window_ratio": 3 / 16},
    "envelope": {"length": 1024, "window_ratio": 3 / 16},
    "transfer": {"length": 1024, "window_ratio": 3 / 16},
    "jacobian": {"length": 256, "window_ratio": 1 / 4},
    "boundary": {"length": 256, "window_ratio": 1 / 4},
}
_COMMON = {"rho": 0.25, "theta": 500000.0, "head_dim": 128}
# Default pixel size per figure (width, height) at dpi 100.
_FIGURE_SIZE = {
    "topologies": (1200, 420),
    "envelope": (800, 600),
    "transfer": (1000, 560),
    "jacobian": (1500, 460),
    "ratio_angle": (1500, 460),
    "boundary": (1500, 460),
}


def geometry_for(figure: str, args: argparse.Namespace) -> Geometry:
    """The figure's paper geometry with every option given on the command line applied on top."""
    values: dict[str, Any] = {**_COMMON, **_FIGURE_GEOMETRY[figure]}
    for key in ("length", "window_ratio", "rho", "theta", "head_dim"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    return Geometry(
        length=int(values["length"]),
        window_ratio=float(values["window_ratio"]),
        rho=float(values["rho"]),
        theta=float(values["theta"]),
        head_dim=int(values["head_dim"]),
        clip_kappa=args.clip_kappa,
    ).validate()


def compute(figure: str, args: argparse.Namespace) -> MechanismResult:
    if figure == "ratio_angle":
        return mechanism.ratio_angle(args.clip_kappa)
    geometry = geometry_for(figure, args)
    if figure == "topologies":
        return mechanism.topologies(geometry, args.density, args.target)
    if figure == "envelope":
        return mechanism.envelope(geometry, args.pair, args.target)
    if figure == "transfer":
        return mechanism.transfer(geometry, args.pair, args.target)
    if figure == "jacobian":
        return mechanism.jacobian(geometry, args.target)
    if figure == "boundary":
        return mechanism.boundary(geometry)
    raise ValueError(f"unknown figure {figure!r}; choose from {FIGURES}")


def run_mechanism(args: argparse.Namespace) -> list[Path]:

    written: list[Path] = []
    log = TensorBoardImages(args.tensorboard)
    try:
        for name in args.figures:
            result = compute(name, args)
            width, height = args.size or _FIGURE_SIZE[name]
            figure = new_figure(width, height, args.dpi)
            DRAW[name](figure, result)
            written.append(save_png(figure, args.out / f"{name}.png"))
            written.append(save_json(result, args.out / f"{name}.json"))
            log.add(f"mechanism/{name}", figure)
            failed = _failed_checks(result)
            status = "all checks hold" if not failed else f"CHECKS FAILED: {failed}"
            print(f"{name}: wrote {written[-2]} and {written[-1]} ({status})")
    finally:
        log.close()
    return written


def _failed_checks(result: MechanismResult) -> list[str]:
    """Boolean checks that are False (numeric checks are reported in the JSON, not judged here)."""
    return [key for key, value in result.checks.items() if isinstance(value, bool) and not value]
