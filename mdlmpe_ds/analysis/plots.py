"""Matplotlib drawings of the mechanism results (Agg canvas, no pyplot, no global backend state).

Each ``draw_*`` fills a :class:`matplotlib.figure.Figure` from a :class:`MechanismResult`; layout
only, no numbers are computed here beyond unit changes. :func:`new_figure` fixes the pixel size so
a PNG is exactly ``width x height``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mdlmpe_ds.analysis.mechanism_setup import MechanismResult

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")


def new_figure(width: int, height: int, dpi: int) -> Figure:
    """A figure of exactly ``width x height`` pixels at ``dpi``, attached to an Agg canvas."""
    if width < 64 or height < 64 or dpi < 10:
        raise ValueError(
            f"figure size {width}x{height} px at dpi {dpi}: need >= 64 px per side and dpi >= 10"
        )
    figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_png(figure: Figure, path: Path) -> Path:
    """Write the PNG at the figure's own size (no tight bbox, so the pixel size is the requested one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=figure.dpi, format="png")
    return path


def save_json(result: MechanismResult | dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = result.to_json() if isinstance(result, MechanismResult) else result
    path.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    return path


def figure_rgb(figure: Figure) -> np.ndarray:
    """The rendered figure as uint8 [H, W, 3] (for TensorBoard ``add_image``)."""
    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


class TensorBoardImages:
    """Logs rendered figures (and scalars) to TensorBoard when a log dir is given; otherwise every
    method is a no-op, so callers need no branches."""

    def __init__(self, logdir: Path | None) -> None:
        self.writer = None
        if logdir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(logdir))

    def add(self, tag: str, figure: Figure, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_image(tag, figure_rgb(figure), global_step=step, dataformats="HWC")

    def add_scalars(self, tag: str, values: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(f"{tag}/{key}", value, global_step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _np(result: MechanismResult, key: str) -> np.ndarray:
    return result.arrays[key].detach().cpu().double().numpy()


def _geometry_title(settings: dict) -> str:
    return (
        f"L={settings['length']}, W={settings['window']}, σ={settings['sigma']:g}, "
        f"θ={settings['theta']:g}, F={settings['num_pairs']}"
    )


def draw_topologies(figure: Figure, result: MechanismResult) -> None:
    """Figure 4: (a) the four equal-density masks, (b) their r_{i,f} vectors."""
    settings = result.settings
    masks, vectors = _np(result, "masks"), _np(result, "r_at_target")
    target, window = settings["target"], settings["window"]
    left, right = figure.subplots(1, 2, width_ratios=(1.2, 1))
    left.imshow(masks, aspect="auto", cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
    left.axvline(target, color="tab:red", linestyle="--", linewidth=1)
    left.axvspan(target - window, target + window, color="tab:red", alpha=0.08)
    left.set_yticks(range(len(settings["topologies"])), settings["topologies"])
    left.set_xlabel("position t (black = revealed)")
    left.set_title(f"(a) {int(masks[0].sum())}/{masks.shape[1]} revealed, target i={target}")
    pairs = np.arange(vectors.shape[1])
    for name, vector, color in zip(settings["topologies"], vectors, COLORS):
        right.plot(pairs, vector, color=color, label=name, linewidth=1.4)
    right.set_xlabel("rotary pair f")
    right.set_ylabel(r"$r_{i,f}$")
    right.set_ylim(-0.03, 1.03)
    right.legend(fontsize="small")
    right.set_title(f"(b) {_geometry_title(settings)}", fontsize="small")


def draw_envelope(figure: Figure, result: MechanismResult) -> None:
    """Appendix F.1: every attainable r_{i,f} at each local revealed fraction eta."""
    settings = result.settings
    eta, upper, lower = _np(result, "eta"), _np(result, "upper"), _np(result, "lower")
    axes = figure.subplots()
    axes.fill_between(eta, lower, upper, color="tab:blue", alpha=0.25, label="attainable r")
    axes.plot(eta, upper, color="tab:blue", linewidth=1.2, label="largest contributions first")
    axes.plot(
        eta, lower, color="tab:blue", linewidth=1.2, linestyle=":", label="smallest contributions first"
    )
    axes.plot(eta, eta, color="black", linestyle="--", linewidth=1, label="uniform placement (r = η)")
    axes.set_xlabel(r"local revealed fraction $\eta = k / N_i$")
    axes.set_ylabel(rf"$r_{{i,{settings['pair']}}}$")
    axes.set_xlim(0, 1)
    axes.set_ylim(0, 1)
    axes.legend(fontsize="small", loc="lower right")
    axes.set_title(
        f"Exact availability envelope, pair f={settings['pair']}, N_i={settings['support_size']}\n"
        f"{_geometry_title(settings)}",
        fontsize="medium",
    )


def draw_transfer(figure: Figure, result: MechanismResult) -> None:
    """Appendix F.2: 100 alpha_{i,t,f} over offset t - i and pair f."""
    settings = result.settings
    offsets, percent = _np(result, "offsets"), _np(result, "percent")
    axes = figure.subplots()
    extent = (offsets[0] - 0.5, offsets[-1] + 0.5, percent.shape[0] - 0.5, -0.5)
    image = axes.imshow(percent, aspect="auto", cmap="magma", extent=extent, interpolation="nearest")
    axes.axvline(0, color="white", linestyle="--", linewidth=0.8)
    axes.axhline(settings["pair"], color="cyan", linestyle="--", linewidth=0.8)
    axes.set_xlabel("source offset t - i")
    axes.set_ylabel("rotary pair f")
    figure.colorbar(image, ax=axes, label=r"$100\,\alpha_{i,t,f}$ (% of $r_{i,f}$)")
    axes.set_title(
        f"Frequency-distance transfer, target i={settings['target']}; {_geometry_title(settings)}",
        fontsize="medium",
    )


def draw_jacobian(figure: Figure, result: MechanismResult) -> None:
    """Appendix F.3: (a) ||du_i/db_t||, (b) centre row vs w sqrt(F), (c) basis factor ||c_t|| / sqrt(F)."""
    settings = result.settings
    matrix = _np(result, "matrix")
    exact, bound, factor = (
        _np(result, "center_exact"),
        _np(result, "center_bound"),
        _np(result, "basis_factor"),
    )
    a, b, c = figure.subplots(1, 3)
    image = a.imshow(matrix, cmap="viridis", interpolation="nearest")
    figure.colorbar(image, ax=a, shrink=0.8)
    a.set_xlabel("source t")
    a.set_ylabel("target i")
    a.set_title(r"(a) $\|\partial u_i / \partial b_t\|_2$", fontsize="medium")
    positions = np.arange(matrix.shape[1])
    b.plot(positions, exact, color="tab:blue", label="exact (autograd)")
    b.plot(positions, bound, color="black", linestyle="--", label=r"$w_{i,t}\sqrt{F}$")
    b.set_xlabel("source t")
    b.set_title(f"(b) centre target i={settings['target']}", fontsize="medium")
    b.legend(fontsize="small")
    c.plot(positions, factor, color="tab:green")
    c.axhline(1.0, color="black", linestyle="--", linewidth=1)
    c.set_ylim(0, 1.05)
    c.set_xlabel("position t")
    c.set_title(r"(c) $\|c_t\|_2 / \sqrt{F}$", fontsize="medium")
    figure.suptitle(_geometry_title(settings), fontsize="medium")


def draw_ratio_angle(figure: Figure, result: MechanismResult) -> None:
    """Appendix F.4: (a) q and the clipped s, (b) |ds/dr| with the clipped ends shaded, (c) the left end."""
    settings = result.settings
    r, q, s = _np(result, "r"), _np(result, "q"), _np(result, "s_clipped")
    autograd, exact = _np(result, "sensitivity_autograd"), _np(result, "sensitivity_exact")
    delta, bound = settings["clip_delta"], result.checks["clip_bound"]
    a, b, c = figure.subplots(1, 3)
    a.plot(r, q, color="tab:blue", label=r"$q = \arccos(2r-1)$")
    a.plot(r, s, color="tab:orange", label=r"$s = q - \pi/2$ (clipped)")
    a.set_yticks([-np.pi / 2, 0, np.pi / 2, np.pi], [r"$-\pi/2$", "0", r"$\pi/2$", r"$\pi$"])
    a.set_xlabel("r")
    a.legend(fontsize="small")
    a.set_title("(a) ratio to intermediate coordinate", fontsize="medium")
    finite = np.isfinite(exact)
    for axes in (b, c):
        axes.plot(
            r[finite], exact[finite], color="black", linestyle="--", linewidth=1, label=r"$1/\sqrt{r(1-r)}$"
        )
        axes.plot(r, autograd, color="tab:orange", linewidth=1.2, label="|ds/dr| of angularize")
        axes.axhline(bound, color="tab:red", linewidth=0.8, linestyle=":", label=f"clip bound {bound:.4g}")
        axes.axvspan(0, delta, color="tab:red", alpha=0.2)
        axes.axvspan(1 - delta, 1, color="tab:red", alpha=0.2)
        axes.set_yscale("log")
        axes.set_ylim(1.0, 3.0 * bound)
        axes.set_xlabel("r")
    b.axvline(0.5, color="grey", linewidth=0.6)
    b.set_xlim(0, 1)
    b.set_title("(b) sensitivity, minimum 2 at r = 1/2", fontsize="medium")
    b.legend(fontsize="x-small", loc="upper center")
    c.set_xscale("log")
    c.set_xlim(delta / 50, 0.5)
    c.set_title(f"(c) left end, clipped below r = κ/2 = {delta:.2g}", fontsize="medium")


def draw_boundary(figure: Figure, result: MechanismResult) -> None:
    """Appendix F.5: (a) raw row mass, (b) normalised kernels at the edges and centre, (c) endpoint r."""
    settings = result.settings
    raw = _np(result, "raw_mass")
    kernels, masses = _np(result, "kernels"), _np(result, "kernel_mass")
    positions = np.arange(raw.shape[0])
    a, b, c = figure.subplots(1, 3)
    a.plot(positions, raw, color="tab:blue")
    a.set_ylim(0, raw.max() * 1.05)
    a.set_xlabel("target i")
    a.set_title(r"(a) raw mass $\sum_u \tilde w_{i,u}$", fontsize="medium")
    for row, kernel, mass, color in zip(settings["kernel_rows"], kernels, masses, COLORS):
        b.plot(positions, kernel, color=color, label=f"i={row}: mass {mass:.6f}")
    b.set_xlabel("source t")
    b.set_title(r"(b) normalised $w_{i,t}$", fontsize="medium")
    b.legend(fontsize="small")
    c.plot(
        positions, _np(result, "r_all_masked_max_over_f"), color="tab:red", label="all masked (max over f)"
    )
    c.plot(
        positions,
        _np(result, "r_all_revealed_min_over_f"),
        color="tab:green",
        label="all revealed (min over f)",
    )
    c.set_ylim(-0.05, 1.05)
    c.set_xlabel("target i")
    c.set_title(r"(c) endpoint ratios $r_{i,f}$", fontsize="medium")
    c.legend(fontsize="small", loc="center right")
    figure.suptitle(_geometry_title(settings), fontsize="medium")


DRAW: dict[str, Callable[[Figure, MechanismResult], None]] = {
    "topologies": draw_topologies,
    "envelope": draw_envelope,
    "transfer": draw_transfer,
    "jacobian": draw_jacobian,
    "ratio_angle": draw_ratio_angle,
    "boundary": draw_boundary,
}


# --- checkpoint diagnostics (mdlmpe_ds.analysis.diagnostics) -------------------------------------------


def draw_gates(
    figure: Figure, report: dict[str, Any], state: Any, per_step: list[Any], columns: list[int]
) -> None:
    """(a) the embedding gate gamma against gamma_max, (b) per-layer mean / max |delta| on the probe
    against tau_max, (c) per-layer ||W2||_F of the phase MLP."""
    gate, layers = report["gate"], report["layers"]
    tau_max = report["settings"]["mdlmpe"]["tau_max"]
    a, b, c = figure.subplots(1, 3, width_ratios=(0.6, 1.2, 1.2))
    if gate["gamma"] is None:
        a.text(0.5, 0.5, "embedding path off", ha="center", va="center", transform=a.transAxes)
    else:
        a.bar([0], [gate["gamma"]], color="tab:blue", width=0.5)
        a.axhline(gate["gamma_max"], color="black", linestyle="--", linewidth=1, label="γ_max")
        a.set_ylim(0, gate["gamma_max"] * 1.1)
        a.legend(fontsize="small")
        a.set_xlabel(
            f"||γz|| / ||e||: mean {gate['relative_perturbation_mean']:.3g}, "
            f"max {gate['relative_perturbation_max']:.3g}",
            fontsize="small",
        )
    a.set_xticks([0], ["γ"])
    gamma_text = "off" if gate["gamma"] is None else f"{gate['gamma']:.4g}"
    a.set_title(f"(a) embedding gate γ = {gamma_text}", fontsize="medium")
    index = np.arange(len(layers["mean_abs_delta"]))
    b.bar(index - 0.2, layers["mean_abs_delta"], width=0.4, label="mean |δ|", color="tab:orange")
    b.bar(index + 0.2, layers["max_abs_delta"], width=0.4, label="max |δ|", color="tab:red")
    b.axhline(tau_max, color="black", linestyle="--", linewidth=1, label="τ_max")
    b.set_xticks(index)
    b.set_xlabel("layer")
    b.set_ylabel("rad")
    b.legend(fontsize="small")
    b.set_title("(b) phase residual on the probe state", fontsize="medium")
    c.bar(index, layers["phase_w2_norm"], color="tab:purple")
    c.set_xticks(index)
    c.set_xlabel("layer")
    c.set_title(r"(c) phase MLP $\|W_2\|_F$ (0 = plain RoPE)", fontsize="medium")
    figure.suptitle(f"{report['source']}", fontsize="small")


def draw_phase(
    figure: Figure, report: dict[str, Any], state: Any, per_step: list[Any], columns: list[int]
) -> None:
    """delta_{ij,f} [L, L] on the probe state for the first, middle and last layer (rows) and the
    selected MDLMPE pairs (columns), one symmetric colour scale for all panels."""
    layers = state.layers_kept
    pairs = report["settings"]["pairs"]
    panels = {(layer, m): state.panel(layer, m).numpy() for layer in layers for m in columns}
    limit = max(max(float(np.abs(p).max()) for p in panels.values()), 1e-12)
    grid = figure.subplots(len(layers), len(columns), squeeze=False, sharex=True, sharey=True)
    image = None
    for row, layer in enumerate(layers):
        for col, (f, m) in enumerate(zip(pairs, columns)):
            axes = grid[row][col]
            image = axes.imshow(
                panels[(layer, m)], cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest"
            )
            axes.set_title(f"layer {layer}, pair f={f}", fontsize="small")
            if row == len(layers) - 1:
                axes.set_xlabel("key j")
            if col == 0:
                axes.set_ylabel("query i")
    figure.colorbar(image, ax=grid, shrink=0.8, label=r"$\delta_{ij,f}$ (rad)")
    revealed = float(state.b.mean())
    figure.suptitle(
        f"Phase residual on the probe ({revealed:.0%} revealed); {report['source']}", fontsize="small"
    )


def draw_denoising(
    figure: Figure, report: dict[str, Any], state: Any, per_step: list[Any], columns: list[int]
) -> None:
    """(a) the mask state at each step, (b) mean |delta| per layer across the steps, (c) the centre
    query's delta_{i,j,f} row (middle layer, first selected pair) across the steps."""
    revealed = np.array([s.b.numpy() for s in per_step])  # [S + 1, L]
    mean_abs = np.array(report["denoising"]["mean_abs_delta"])  # [S + 1, layers]
    layer = per_step[0].layers_kept[len(per_step[0].layers_kept) // 2]
    f, m = report["settings"]["pairs"][0], columns[0]
    centre = report["settings"]["centre_query"]
    rows = np.array([s.panel(layer, m)[centre].numpy() for s in per_step])  # [S + 1, L]
    a, b, c = figure.subplots(1, 3)
    a.imshow(revealed, aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    a.set_xlabel("position (black = revealed)")
    a.set_ylabel("step")
    a.set_title("(a) mask state per step", fontsize="medium")
    steps = np.arange(mean_abs.shape[0])
    for k in range(mean_abs.shape[1]):
        b.plot(steps, mean_abs[:, k], marker=".", linewidth=1, label=f"layer {k}")
    b.set_xlabel("step")
    b.set_ylabel("mean |δ| (rad)")
    if mean_abs.shape[1] <= 12:
        b.legend(fontsize="x-small", ncols=2)
    b.set_title("(b) mean |δ| per layer", fontsize="medium")
    limit = max(float(np.abs(rows).max()), 1e-12)
    image = c.imshow(rows, aspect="auto", cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest")
    figure.colorbar(image, ax=c, label="rad")
    c.set_xlabel("key j")
    c.set_ylabel("step")
    c.set_title(f"(c) δ(i={centre}, j, f={f}), layer {layer}", fontsize="medium")
    settings = report["settings"]
    figure.suptitle(
        f"{settings['steps']} steps, schedule '{settings['schedule']}'; {report['source']}", fontsize="small"
    )
