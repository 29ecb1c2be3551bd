"""The numbers behind the paper's deterministic mechanism figures (Figure 4 and
Appendix F), evaluated with the package's own encoder functions.

Every quantity here comes from ``mdlmpe_ds.pe`` (``dense_weights``, ``sine_basis``,
``gaussian_taps``, ``token_summaries``, ``angularize``) and the window/sigma of ``MDLMPEConfig``, so
a figure shows the encoder the trainer runs, for any (L, W/L, rho, theta, d_h), not a re-derivation
of the paper. No randomness, no checkpoint: each result is a pure function of its settings.

Each builder returns a :class:`MechanismResult` (mechanism_setup.py, with ``Geometry``) whose
``arrays`` feed the plot and whose ``checks`` evaluate the paper's statement about that figure
(e.g. "the Jacobian never exceeds its bound").
"""

from __future__ import annotations

import math

import torch

from mdlmpe_ds.analysis.mechanism_setup import (
    JSON_MAX_MATRIX,
    TOPOLOGIES,
    Geometry,
    MechanismResult,
    availability_ratio,
    check_pair,
    check_target,
    ones_row,
)
from mdlmpe_ds.pe.availability import dense_weights, gaussian_taps, sine_basis, token_summaries
from mdlmpe_ds.pe.phase import angularize

# --- Figure 4 ---------------------------------------------------------------


def topology_masks(length: int, density: float, target: int) -> dict[str, torch.Tensor]:
    """Four equal-density reveal patterns b_t (1 = revealed), each with k = round(density * L) ones.

    local: one contiguous block centred on the target; uniform: every (L/k)-th position;
    edge-clustered: k/2 at each sequence end; periodic: runs of 4 revealed at a period of 4/density
    (same density as uniform, different spacing). [L] fp32 each.
    """
    k = round(density * length)
    if not 4 <= k <= length - 4:
        raise ValueError(f"topologies: density={density} at length={length} reveals {k}; need 4 <= k <= L-4")
    masks = {name: torch.zeros(length) for name in TOPOLOGIES}
    start = min(max(target - k // 2, 0), length - k)
    masks["local"][start : start + k] = 1.0
    masks["uniform"][torch.linspace(0, length - 1, k).round().long()] = 1.0
    masks["edge-clustered"][: k // 2] = 1.0
    masks["edge-clustered"][length - (k - k // 2) :] = 1.0
    run = 4
    period = max(round(run / density), run + 1)
    periodic = ((torch.arange(length) % period) < run).float()
    # Trim or extend from the right so the count is exactly k (equal density is the point).
    excess = int(periodic.sum().item()) - k
    ones = periodic.nonzero().flatten()
    zeros = (periodic == 0).nonzero().flatten()
    if excess > 0:
        periodic[ones[-excess:]] = 0.0
    elif excess < 0:
        periodic[zeros[excess:]] = 1.0
    masks["periodic"] = periodic
    for name, mask in masks.items():
        if int(mask.sum().item()) != k:
            raise AssertionError(f"topology {name} reveals {int(mask.sum())} != {k}")
    return masks


def topologies(geometry: Geometry, density: float = 0.25, target: int | None = None) -> MechanismResult:
    """Equal-density masks give distinct r_{i,f} vectors at one target (Figure 4)."""
    geometry.validate()
    target = check_target(geometry, target)
    masks = topology_masks(geometry.length, density, target)
    b = torch.stack([masks[name] for name in TOPOLOGIES])  # [4, L]
    r = availability_ratio(b, geometry)  # [4, L, F]
    vectors = r[:, target, :]  # [4, F]
    lo, hi = max(0, target - geometry.window), target + geometry.window + 1
    gaps = [
        (vectors[p] - vectors[q]).abs().max().item()
        for p in range(len(TOPOLOGIES))
        for q in range(p + 1, len(TOPOLOGIES))
    ]
    return MechanismResult(
        name="topologies",
        settings={
            **geometry.describe(),
            "density": density,
            "target": target,
            "topologies": list(TOPOLOGIES),
        },
        arrays={"masks": b, "r_at_target": vectors, "revealed_in_window": b[:, lo:hi].mean(-1)},
        checks={
            "equal_density": bool((b.sum(-1) == b.sum(-1)[0]).all().item()),
            "min_pairwise_max_abs_gap": min(gaps),
            "pairwise_distinct": min(gaps) > 1e-3,
        },
    )


# --- Appendix F.1: exact availability envelope ---------------------------------------------------


def source_contributions(geometry: Geometry, target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha_{i,t,f} = w_{i,t} c_{t,f} / sum_u w_{i,u} c_{u,f} for one target i (Eq. (34), the eps -> 0
    limit), and the support mask w_{i,t} > 0.

    Returns alpha [L, F] and support [L] bool. w from ``dense_weights`` (all valid), c from
    ``sine_basis``.
    """
    w = dense_weights(ones_row(geometry.length), geometry.window, geometry.sigma, geometry.eps)[
        0, target
    ]  # [L]
    c = sine_basis(geometry.length, geometry.head_dim, geometry.theta).double()  # [L, F]
    weighted = w.double().unsqueeze(-1) * c  # [L, F]
    alpha = weighted / weighted.sum(0, keepdim=True)
    return alpha, w > 0


def envelope(geometry: Geometry, pair: int = 12, target: int | None = None) -> MechanismResult:
    """Exact extrema of r_{i,f} over all masks with k revealed in the support (Appendix F.1).

    The maximum reveals the k largest alpha_{i,t,f} first, the minimum the k smallest: sorted
    partial sums, exact over every binary mask of that cardinality. eta = k / N_i; the diagonal
    r = eta is the uniform-placement expectation.
    """
    geometry.validate()
    target = check_target(geometry, target)
    pair = check_pair(geometry, pair)
    alpha, support = source_contributions(geometry, target)
    values = alpha[support, pair]  # [N_i]
    descending = values.sort(descending=True).values
    zero = values.new_zeros(1)
    upper = torch.cat((zero, descending.cumsum(0)))  # [N_i + 1]
    lower = torch.cat((zero, descending.flip(0).cumsum(0)))
    count = int(values.numel())
    eta = torch.arange(count + 1, dtype=torch.float64) / count
    width = upper - lower
    # The product's own r at the two extremal masks of the middle k, for the record.
    k_mid = count // 2
    positions = support.nonzero().flatten()
    order = values.argsort(descending=True)
    b = torch.zeros(2, geometry.length)
    b[0, positions[order[:k_mid]]] = 1.0
    b[1, positions[order.flip(0)[:k_mid]]] = 1.0
    product_r = availability_ratio(b, geometry)[:, target, pair].double()
    return MechanismResult(
        name="envelope",
        settings={**geometry.describe(), "pair": pair, "target": target, "support_size": count},
        arrays={"eta": eta, "upper": upper, "lower": lower, "diagonal": eta, "alpha_sorted": descending},
        checks={
            "upper_at_eta0": upper[0].item(),
            "lower_at_eta0": lower[0].item(),
            "upper_at_eta1": upper[-1].item(),
            "lower_at_eta1": lower[-1].item(),
            "max_interior_width": width[1:-1].max().item() if count > 1 else 0.0,
            "width_at_half": width[k_mid].item(),
            "token_summaries_r_max_at_half": product_r[0].item(),
            "token_summaries_r_min_at_half": product_r[1].item(),
            "partial_sum_vs_token_summaries_abs_err": max(
                abs(product_r[0].item() - upper[k_mid].item()), abs(product_r[1].item() - lower[k_mid].item())
            ),
        },
    )


# --- Appendix F.2: frequency-distance transfer -------------------------------------------------------


def transfer(geometry: Geometry, pair: int = 12, target: int | None = None) -> MechanismResult:
    """100 * alpha_{i,t,f}: the change of r_{i,f} when only source t is revealed (Appendix F.2).

    Computed for the product's exact r (with eps): revealing only t gives A_{i,f} = w_{i,t} c_{t,f}
    and the all-valid D_{i,f} from ``token_summaries``, so alpha = w_{i,t} c_{t,f} / D_{i,f}.
    Columns are offsets t - i in [-(W + 2), W + 2] (clipped to the sequence) so the zero support
    beyond W is visible. Surface [F, offsets].
    """
    geometry.validate()
    target = check_target(geometry, target)
    pair = check_pair(geometry, pair)
    length, window = geometry.length, geometry.window
    w = dense_weights(ones_row(length), window, geometry.sigma, geometry.eps)[0, target]  # [L]
    c = sine_basis(length, geometry.head_dim, geometry.theta)  # [L, F]
    taps = gaussian_taps(window, geometry.sigma)
    _, D = token_summaries(ones_row(length), ones_row(length), c, taps, geometry.eps)  # [1, L, F]
    alpha = (w.unsqueeze(-1) * c / D[0, target]).T  # [F, L]
    margin = window + 2
    lo, hi = max(0, target - margin), min(length, target + margin + 1)
    offsets = torch.arange(lo, hi) - target
    surface = 100.0 * alpha[:, lo:hi]
    outside = offsets.abs() > window
    return MechanismResult(
        name="transfer",
        settings={**geometry.describe(), "pair": pair, "target": target},
        arrays={"offsets": offsets, "percent": surface},
        checks={
            "max_abs_beyond_window": surface[:, outside].abs().max().item() if bool(outside.any()) else 0.0,
            "zero_beyond_window": bool((surface[:, outside] == 0).all().item()),
            "min_row_sum_percent": surface.sum(-1).min().item(),
            "max_row_sum_percent": surface.sum(-1).max().item(),
        },
    )


# --- Appendix F.3: Jacobian norm and its bound ------------------------------------------------------


def jacobian_row(geometry: Geometry, target: int) -> torch.Tensor:
    """||d u_i / d b_t||_2 for one target i by autograd through ``token_summaries``. [L]."""
    length = geometry.length
    c = sine_basis(length, geometry.head_dim, geometry.theta)
    taps = gaussian_taps(geometry.window, geometry.sigma)

    def u_target(b: torch.Tensor) -> torch.Tensor:
        A, _ = token_summaries(b.unsqueeze(0), ones_row(length), c, taps, geometry.eps)
        return A[0, target]  # [F]

    jac = torch.autograd.functional.jacobian(u_target, torch.zeros(length))  # [F, L]
    return jac.norm(dim=0)


def jacobian(geometry: Geometry, target: int | None = None) -> MechanismResult:
    """The single-state influence ||d u_i / d b_t|| = w_{i,t} ||c_t|| against w_{i,t} sqrt(F)
    (Eqs. (19), (35); Appendix F.3).

    The matrix is w_{i,t} ||c_t|| with w from ``dense_weights``; the centre row is also taken by
    autograd through ``token_summaries`` (b requires grad) and the two are compared in ``checks``.
    """
    geometry.validate()
    target = check_target(geometry, target)
    length, num_pairs = geometry.length, geometry.num_pairs
    w = dense_weights(ones_row(length), geometry.window, geometry.sigma, geometry.eps)[0]  # [L, L]
    c_norm = sine_basis(length, geometry.head_dim, geometry.theta).norm(dim=-1)  # [L]
    matrix = w * c_norm.unsqueeze(0)  # [L(i), L(t)]
    bound = w * math.sqrt(num_pairs)
    row_autograd = jacobian_row(geometry, target)
    offsets = torch.arange(length).view(1, -1) - torch.arange(length).view(-1, 1)
    beyond = offsets.abs() > geometry.window
    omitted = {}
    if matrix.numel() > JSON_MAX_MATRIX:
        omitted["matrix"] = (
            f"L^2 = {matrix.numel()} > {JSON_MAX_MATRIX} entries; it is w_{{i,t}} ||c_t|| "
            "(dense_weights times basis_factor * sqrt(F))"
        )
    return MechanismResult(
        name="jacobian",
        omitted=omitted,
        settings={**geometry.describe(), "target": target},
        arrays={
            "matrix": matrix,
            "center_exact": row_autograd,
            "center_bound": bound[target],
            "basis_factor": c_norm / math.sqrt(num_pairs),
        },
        checks={
            "max_excess_over_bound": (matrix - bound).max().item(),
            "never_exceeds_bound": bool((matrix <= bound + 1e-7).all().item()),
            "max_basis_factor": (c_norm / math.sqrt(num_pairs)).max().item(),
            "max_abs_beyond_window": matrix[beyond].abs().max().item() if bool(beyond.any()) else 0.0,
            "center_row_autograd_vs_analytic_abs_err": (row_autograd - matrix[target]).abs().max().item(),
        },
    )


# --- Appendix F.4: ratio-to-angle map and its sensitivity ----------------------------------------------


def ratio_grid(clip_kappa: float, points: int = 1001) -> torch.Tensor:
    """r in [0, 1]: a uniform grid (odd count, so r = 1/2 is on it) refined logarithmically near both
    endpoints so the clipped neighbourhoods r < kappa/2 and r > 1 - kappa/2 are resolved. fp64."""
    if points < 3 or points % 2 == 0:
        raise ValueError(f"ratio grid: points={points} must be odd and >= 3")
    uniform = torch.linspace(0.0, 1.0, points, dtype=torch.float64)
    near = torch.logspace(math.log10(clip_kappa / 100), math.log10(0.05), 200, dtype=torch.float64)
    return torch.cat((uniform, near, 1.0 - near)).unique()


def ratio_angle(clip_kappa: float = 1e-4, points: int = 1001) -> MechanismResult:
    """q = arccos(2r - 1), the product's clipped s = ``angularize(r, kappa)`` and |ds/dr| by autograd,
    against the exact 1 / sqrt(r (1 - r)) (Eqs. (24), (36), (37)).

    ``angularize`` clips 2r - 1 to [-1 + kappa, 1 - kappa], i.e. r to [kappa/2, 1 - kappa/2]; inside
    that range its derivative is exact, outside it is 0 (the clip), so the sensitivity is bounded by
    1 / sqrt(delta (1 - delta)) with delta = kappa / 2.
    """
    r = ratio_grid(clip_kappa, points).float().requires_grad_(True)
    s = angularize(r, clip_kappa)
    (grad,) = torch.autograd.grad(s.sum(), r)
    # Where angularize's clamp is active (strictly outside the range: clamp passes the gradient at
    # equality), judged in the fp32 the product computes in.
    argument = (2.0 * r.detach() - 1.0).abs()
    clipped = argument > 1.0 - clip_kappa
    r = r.detach().double()
    s = s.detach().double()
    sensitivity = grad.abs().double()
    # The exact derivative diverges at r = 0 and 1; those two entries are NaN (null in the JSON).
    exact = 1.0 / torch.sqrt(r * (1.0 - r))
    exact[(r <= 0) | (r >= 1)] = float("nan")
    delta = clip_kappa / 2
    interior = ~clipped
    half = (r - 0.5).abs().argmin()
    return MechanismResult(
        name="ratio_angle",
        settings={"clip_kappa": clip_kappa, "clip_delta": delta, "points": int(r.numel())},
        arrays={
            "r": r,
            "q": torch.acos(2 * r - 1),
            "s_clipped": s,
            "sensitivity_autograd": sensitivity,
            "sensitivity_exact": exact,
            "clipped": clipped,
        },
        checks={
            "min_sensitivity": sensitivity[interior].min().item(),
            "argmin_r": r[interior][sensitivity[interior].argmin()].item(),
            "sensitivity_at_half": sensitivity[half].item(),
            "max_sensitivity": sensitivity.max().item(),
            "clip_bound": 1.0 / math.sqrt(delta * (1 - delta)),
            "s_range_min": s.min().item(),
            "s_range_max": s.max().item(),
        },
    )


# --- Appendix F.5: boundary normalisation -------------------------------------------------------------------


def boundary(geometry: Geometry) -> MechanismResult:
    """Raw truncated-Gaussian row mass, the normalised kernels at the left edge, centre and right
    edge, and r for the all-masked / all-revealed states at every position (Appendix F.5, Eq. (22)).
    """
    geometry.validate()
    length = geometry.length
    ones = ones_row(length)
    taps = gaussian_taps(geometry.window, geometry.sigma)
    raw_mass = _raw_row_mass(length, taps)  # [L]
    rows = (0, length // 2, length - 1)
    w = dense_weights(ones, geometry.window, geometry.sigma, geometry.eps)[0]  # [L, L]
    kernels = w[list(rows)]  # [3, L]
    r_masked = availability_ratio(torch.zeros(1, length), geometry)[0]  # [L, F]
    r_revealed = availability_ratio(ones, geometry)[0]
    return MechanismResult(
        name="boundary",
        settings={**geometry.describe(), "kernel_rows": list(rows)},
        arrays={
            "raw_mass": raw_mass,
            "kernels": kernels,
            "kernel_mass": kernels.sum(-1),
            "r_all_masked_max_over_f": r_masked.max(-1).values,
            "r_all_revealed_min_over_f": r_revealed.min(-1).values,
            "r_all_revealed_max_over_f": r_revealed.max(-1).values,
        },
        checks={
            "raw_mass_edge_over_centre": (raw_mass[0] / raw_mass[length // 2]).item(),
            "max_kernel_mass_error": (kernels.sum(-1) - 1).abs().max().item(),
            "max_r_all_masked": r_masked.abs().max().item(),
            "max_abs_r_all_revealed_minus_1": (r_revealed - 1).abs().max().item(),
        },
    )


def _raw_row_mass(length: int, taps: torch.Tensor) -> torch.Tensor:
    """sum_u g(i - u) over u in [0, L) for every i: the unnormalised mass of Eq. (21). [L]."""
    window = (taps.numel() - 1) // 2
    pos = torch.arange(length)
    offsets = pos.view(1, -1) - pos.view(-1, 1)  # [L, L]
    inside = offsets.abs() <= window
    return (taps[(offsets + window).clamp(0, 2 * window)] * inside).sum(-1)
