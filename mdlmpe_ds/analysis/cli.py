"""``python -m mdlmpe_ds.analysis``: draw the mechanism figures or a checkpoint's diagnostics.

Examples::

    # the six deterministic figures at the paper's settings (PNG + JSON per figure)
    python -m mdlmpe_ds.analysis mechanism --out figures/
    # your own geometry: every figure uses L=4096, W/L=1/8, rho=1/2, theta=1e4, d_h=64
    python -m mdlmpe_ds.analysis mechanism --figures envelope transfer --length 4096 \\
        --window-ratio 0.125 --rho 0.5 --theta 1e4 --head-dim 64 --pair 4 --out figures/
    # an export, a training run's output_dir (its newest complete checkpoint) or a hub id
    python -m mdlmpe_ds.analysis checkpoint --model outputs/sft-demo --out diag/ --tensorboard tb/

Options left unset take each figure's paper default (Appendix F): topologies at L=256, W/L=3/16;
envelope and transfer at L=1024, W/L=3/16; jacobian and boundary at L=256, W/L=1/4 (W=64,
sigma=16); rho=1/4, theta=500000 (LLaDA), d_h=128, pair f=12. A value given on the command line
applies to every selected figure.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mdlmpe_ds.analysis import mechanism
from mdlmpe_ds.analysis.diagnostics import run_checkpoint
from mdlmpe_ds.analysis.mechanism import Geometry, MechanismResult
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


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--size must look like 1200x400 (pixels), got {text!r}") from err
    return width, height


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mdlmpe_ds.analysis",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    mech = commands.add_parser("mechanism", help="the deterministic encoder figures (paper Appendix F)")
    mech.add_argument("--figures", nargs="+", choices=FIGURES, default=list(FIGURES))
    mech.add_argument("--out", type=Path, required=True, help="directory for <figure>.png and <figure>.json")
    mech.add_argument("--length", type=int, help="L (= L_ref, which fixes W)")
    mech.add_argument("--window-ratio", type=float, help="W / L_ref")
    mech.add_argument("--rho", type=float, help="sigma / W")
    mech.add_argument("--theta", type=float, help="RoPE base")
    mech.add_argument("--head-dim", type=int, help="d_h (F = d_h / 2 rotary pairs)")
    mech.add_argument(
        "--pair", type=int, default=12, help="rotary pair f of the envelope and transfer figures"
    )
    mech.add_argument("--target", type=int, help="target position i (default L // 2)")
    mech.add_argument("--density", type=float, default=0.25, help="revealed fraction of the topology masks")
    mech.add_argument("--clip-kappa", type=float, default=1e-4, help="arccos clip kappa (ratio_angle)")
    _add_output_options(mech)

    ckpt = commands.add_parser(
        "checkpoint", help="gamma, phase residuals and their evolution for a checkpoint"
    )
    ckpt.add_argument(
        "--model",
        required=True,
        help="an export / HF-style directory, a hub id, or a training run (output_dir, step dir, latest)",
    )
    ckpt.add_argument("--out", type=Path, required=True)
    ckpt.add_argument("--length", type=int, default=64, help="sequence length of the probe input")
    ckpt.add_argument("--mask-fraction", type=float, default=0.5, help="masked fraction of the probe input")
    ckpt.add_argument(
        "--pairs", type=int, nargs="+", help="rotary pairs f (odd) to draw; default 3 spread pairs"
    )
    ckpt.add_argument("--steps", type=int, default=8, help="denoising steps of the generation")
    ckpt.add_argument("--seed", type=int, default=0, help="seed of the probe tokens and initial mask")
    ckpt.add_argument(
        "--prompt-ids",
        type=str,
        help="comma-separated token ids of the probe (default: seeded random "
        "ids of --length); --mask-fraction of them are then masked",
    )
    ckpt.add_argument(
        "--mask-positions",
        type=str,
        help="comma-separated positions to mask: the exact mask state (overrides --mask-fraction)",
    )
    ckpt.add_argument(
        "--schedule",
        choices=("sampler", "confidence"),
        default="sampler",
        help="sampler: the project's generate() on [prompt, masks] (the last --mask-fraction of the probe); "
        "confidence: a deterministic schedule on randomly placed masks (see diagnostics.py)",
    )
    ckpt.add_argument(
        "--block-length", type=int, help="semi-AR block length of the sampler (default: one block)"
    )
    ckpt.add_argument("--device", default="cpu", help="torch device to load the model on")
    ckpt.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="parameter dtype after loading"
    )
    _add_output_options(ckpt)
    return parser


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dpi", type=int, default=100)
    parser.add_argument("--size", type=_size, help="WxH pixels for every figure (default: per figure)")
    parser.add_argument("--tensorboard", type=Path, help="also log every figure as an image to this log dir")


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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "mechanism":
        run_mechanism(args)
        return 0

    run_checkpoint(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
