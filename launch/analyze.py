"""Draw MDLMPE's mechanism figures (paper Appendix F) or a checkpoint's diagnostics.

The six deterministic figures at the paper's settings, each as PNG + the JSON of its numbers and
checks::

    python launch/analyze.py mechanism --out figures/

Your own geometry (L_ref, W/L, rho, RoPE theta, head dim) and rotary pair, one or more figures::

    python launch/analyze.py mechanism --figures envelope transfer jacobian --length 4096 \\
        --window-ratio 0.125 --rho 0.5 --theta 10000 --head-dim 64 --pair 6 --out figures/

A trained or exported model (an export / HF-style directory, a training run's output_dir, whose
newest complete checkpoint is read, or a hub id): gamma, per-layer phase residual statistics,
delta_{ij,f} on a probe, and delta across one generation of the project's sampler, optionally logged
to TensorBoard::

    python launch/analyze.py checkpoint --model outputs/sft-demo --out diag/
    python launch/analyze.py checkpoint --model outputs/llada-sft/export --out diag/ \\
        --length 128 --mask-fraction 0.5 --steps 16 --device cuda --dtype bf16 --tensorboard diag/tb

Options left unset take each figure's paper default (Appendix F, mdlmpe_ds/analysis/figures.py); a
value given here applies to every selected figure.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from mdlmpe_ds.analysis.diagnostics import run_checkpoint
from mdlmpe_ds.analysis.figures import FIGURES, run_mechanism
from mdlmpe_ds.training.log_setup import configure


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--size must look like 1200x400 (pixels), got {text!r}") from err
    return width, height


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python launch/analyze.py",
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "mechanism":
        run_mechanism(args)
    else:
        run_checkpoint(args)
    return 0


if __name__ == "__main__":
    configure(stream="stderr")
    sys.exit(main())
