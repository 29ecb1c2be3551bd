"""The mechanism figures' numbers against the paper's Appendix F statements, the PNG/JSON outputs of
``python launch/analyze.py``, and the checkpoint diagnostics on a tiny saved model.

Sizes are small (L <= 128, a 2-layer tiny model) so the file runs in seconds. The envelope is checked
against a brute force over every mask of a length-10 sequence, computed with the product's banded
``token_summaries`` rather than the sorted-partial-sum shortcut the figure uses.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mdlmpe_ds.analysis import mechanism
from mdlmpe_ds.analysis.diagnostics import denoise_trajectory, pair_columns, probe_input, sampler_trajectory
from mdlmpe_ds.analysis.mechanism_setup import Geometry
from mdlmpe_ds.pe.availability import gaussian_taps, sine_basis, token_summaries

_SPEC = importlib.util.spec_from_file_location(
    "launch_analyze", Path(__file__).resolve().parents[2] / "launch" / "analyze.py"
)
_LAUNCH = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_LAUNCH)
main = _LAUNCH.main  # the command line lives in launch/

SMALL = Geometry(length=128, window_ratio=3 / 16, rho=0.25, theta=10000.0, head_dim=32)


def product_ratio(b: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """r = A / D from token_summaries for a batch of reveal states b [N, L] (all valid). [N, L, F]."""
    coordinate = sine_basis(geometry.length, geometry.head_dim, geometry.theta)
    taps = gaussian_taps(geometry.window, geometry.sigma)
    A, D = token_summaries(b, torch.ones_like(b), coordinate, taps, geometry.eps)
    return A / D


# --- Appendix F.1 -----------------------------------------------------------------------------------------


def test_envelope_matches_brute_force_over_every_mask():
    geometry = Geometry(length=10, window_ratio=0.3, rho=0.5, theta=20.0, head_dim=8)  # W = 3, sigma = 1.5
    target, pair = 5, 1
    result = mechanism.envelope(geometry, pair=pair, target=target)
    masks = torch.tensor(list(itertools.product((0.0, 1.0), repeat=geometry.length)))  # [1024, 10]
    r = product_ratio(masks, geometry)[:, target, pair]  # [1024]
    support = slice(target - geometry.window, target + geometry.window + 1)
    k = masks[:, support].sum(-1).long()
    upper, lower = result.arrays["upper"], result.arrays["lower"]
    assert result.settings["support_size"] == 2 * geometry.window + 1 == len(upper) - 1
    for count in range(len(upper)):
        chosen = r[k == count].double()
        # eps-level differences only: the figure uses the eps -> 0 contributions, the product has eps.
        assert chosen.max().item() == pytest.approx(upper[count].item(), abs=1e-5), count
        assert chosen.min().item() == pytest.approx(lower[count].item(), abs=1e-5), count


def test_envelope_collapses_at_the_ends_and_is_wide_inside():
    result = mechanism.envelope(SMALL, pair=4)
    checks = result.checks
    assert checks["upper_at_eta0"] == checks["lower_at_eta0"] == 0.0
    assert checks["upper_at_eta1"] == pytest.approx(1.0, abs=1e-9)
    assert checks["lower_at_eta1"] == pytest.approx(1.0, abs=1e-9)
    width = result.arrays["upper"] - result.arrays["lower"]
    assert (width[1:-1] > 1e-3).all()
    assert checks["partial_sum_vs_token_summaries_abs_err"] < 1e-5
    # The uniform-placement diagonal lies inside the band.
    eta = result.arrays["eta"]
    assert (result.arrays["lower"] <= eta + 1e-9).all() and (eta <= result.arrays["upper"] + 1e-9).all()


# --- Appendix F.2 -----------------------------------------------------------------------------------------


def test_transfer_support_is_zero_beyond_window_and_equals_single_reveal():
    result = mechanism.transfer(SMALL, pair=4)
    offsets, percent = result.arrays["offsets"], result.arrays["percent"]
    window = SMALL.window
    assert (offsets.abs() > window).any()
    assert (percent[:, offsets.abs() > window] == 0).all()
    assert (percent[:, offsets.abs() <= window] > 0).all()
    # Each cell is the change of r_{i,f} when only that source is revealed, by the product's r.
    target = result.settings["target"]
    picks = [0, window // 2, window]
    b = torch.zeros(len(picks), SMALL.length)
    for row, offset in enumerate(picks):
        b[row, target + offset] = 1.0
    r = product_ratio(b, SMALL)[:, target, :]  # [picks, F]
    for row, offset in enumerate(picks):
        column = int((offsets == offset).nonzero())
        torch.testing.assert_close(100 * r[row], percent[:, column], rtol=1e-5, atol=1e-6)


# --- Appendix F.3 -----------------------------------------------------------------------------------------


def test_jacobian_never_exceeds_bound_and_matches_autograd():
    geometry = Geometry(length=96, window_ratio=0.25, rho=0.25, theta=10000.0, head_dim=32)
    result = mechanism.jacobian(geometry)
    matrix, length = result.arrays["matrix"], geometry.length
    from mdlmpe_ds.pe.availability import dense_weights

    w = dense_weights(torch.ones(1, length), geometry.window, geometry.sigma, geometry.eps)[0]
    assert (matrix <= w * math.sqrt(geometry.num_pairs) + 1e-7).all()
    assert result.checks["never_exceeds_bound"] and result.checks["max_basis_factor"] <= 1.0
    assert result.checks["max_abs_beyond_window"] == 0.0
    # Two rows (centre from the result, the first row here) by autograd through token_summaries.
    torch.testing.assert_close(result.arrays["center_exact"], matrix[length // 2], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(mechanism.jacobian_row(geometry, 0), matrix[0], rtol=1e-5, atol=1e-7)


# --- Appendix F.4 -----------------------------------------------------------------------------------------


def test_ratio_angle_sensitivity_is_minimal_two_at_half_and_clipped_at_the_ends():
    kappa = 1e-2
    result = mechanism.ratio_angle(clip_kappa=kappa)
    r = result.arrays["r"]
    sensitivity = result.arrays["sensitivity_autograd"]
    interior = ~result.arrays["clipped"]
    assert result.checks["min_sensitivity"] == pytest.approx(2.0, abs=1e-4)
    assert result.checks["argmin_r"] == 0.5
    # Away from the clip the product's derivative is the exact 1/sqrt(r(1-r)).
    inside = interior & (r > kappa) & (r < 1 - kappa)
    torch.testing.assert_close(
        sensitivity[inside], result.arrays["sensitivity_exact"][inside], rtol=1e-3, atol=0
    )
    # The clip bounds it (Eq. (37)) and flattens s outside [kappa/2, 1 - kappa/2].
    assert result.checks["max_sensitivity"] <= result.checks["clip_bound"] * (1 + 1e-3)
    assert (sensitivity[result.arrays["clipped"]] == 0).all()
    assert result.checks["s_range_max"] < math.pi / 2


# --- Appendix F.5 -----------------------------------------------------------------------------------------


def test_boundary_kernels_have_unit_mass_and_endpoint_ratios_are_exact():
    result = mechanism.boundary(SMALL)
    kernels = result.arrays["kernels"]
    assert result.settings["kernel_rows"] == [0, SMALL.length // 2, SMALL.length - 1]
    torch.testing.assert_close(kernels.sum(-1), torch.ones(3), rtol=0, atol=1e-5)
    # The left kernel has one-sided support; the raw mass is lower at the edges than in the middle.
    assert (kernels[0, : SMALL.window + 1] > 0).all() and (kernels[0, SMALL.window + 1 :] == 0).all()
    raw = result.arrays["raw_mass"]
    assert raw[0] < 0.6 * raw[SMALL.length // 2]
    assert result.checks["max_r_all_masked"] == 0.0
    # All revealed: r = X / (X + eps) with X >= min D - eps, so 1 - r <= eps / min(D) (eps-level).
    assert result.checks["max_abs_r_all_revealed_minus_1"] < 1e-3


# --- Figure 4 ---------------------------------------------------------------------------


def test_topologies_equal_density_and_pairwise_distinct():
    result = mechanism.topologies(SMALL, density=0.25)
    masks, vectors = result.arrays["masks"], result.arrays["r_at_target"]
    assert (masks.sum(-1) == round(0.25 * SMALL.length)).all()
    assert len({tuple(m.tolist()) for m in masks}) == 4
    for p, q in itertools.combinations(range(4), 2):
        assert (vectors[p] - vectors[q]).abs().max() > 1e-3, (p, q)
    assert result.checks["pairwise_distinct"]


def test_bad_settings_are_rejected_with_the_option_named():
    with pytest.raises(ValueError, match="pair=40"):
        mechanism.envelope(SMALL, pair=40)
    with pytest.raises(ValueError, match="window_ratio"):
        mechanism.boundary(Geometry(length=64, window_ratio=-1.0, rho=0.25, theta=1e4, head_dim=16))
    with pytest.raises(ValueError, match="carry no phase residual"):
        pair_columns([2], 8)


# --- the command -------------------------------------------------------------------------------------------


def test_mechanism_command_writes_every_png_at_the_requested_size(tmp_path, capsys):
    out = tmp_path / "figs"
    argv = ["mechanism", "--out", str(out), "--length", "128", "--head-dim", "32", "--pair", "3"]
    assert main([*argv, "--size", "400x300", "--dpi", "80"]) == 0
    printed = capsys.readouterr().out
    for name in ("topologies", "envelope", "transfer", "jacobian", "ratio_angle", "boundary"):
        png, data = out / f"{name}.png", out / f"{name}.json"
        assert png.stat().st_size > 5000, name  # a drawn figure, not an empty canvas
        with Image.open(png) as image:
            assert image.format == "PNG" and image.size == (400, 300), name
            assert len(np.unique(np.asarray(image.convert("L")))) > 10, name
        payload = json.loads(data.read_text())
        assert payload["figure"] == name and payload["arrays"], name
        assert not [k for k, v in payload["checks"].items() if v is False], name
        assert f"{name}: wrote {png}" in printed
        if name != "ratio_angle":
            assert payload["settings"]["length"] == 128 and payload["settings"]["num_pairs"] == 16
    # Unset options fall back to each figure's paper geometry: W/L = 1/4 for the boundary figure.
    assert json.loads((out / "boundary.json").read_text())["settings"]["window"] == 32
    assert json.loads((out / "envelope.json").read_text())["settings"]["window"] == 24


def test_mechanism_command_rejects_a_malformed_size(tmp_path):
    with pytest.raises(SystemExit):
        main(["mechanism", "--out", str(tmp_path), "--size", "400by300"])


# --- checkpoint diagnostics --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A saved 2-layer llada-tiny MDLMPE model whose phase MLP outputs are made non-zero."""
    from mdlmpe_ds.models.hf_io import save_pretrained
    from mdlmpe_ds.models.presets import preset
    from mdlmpe_ds.models.transformer import DiffusionLM

    torch.manual_seed(0)
    config = preset("llada-tiny", position_encoding="mdlmpe")
    model = DiffusionLM(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.phase.fc2.weight.normal_(0.0, 0.5)
            layer.attn.phase.fc2.bias.normal_(0.0, 0.1)
        model.embed.mdlmpe.gate_logit.fill_(0.3)
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(model, path, config)
    return path, model


def test_checkpoint_command_reports_the_saved_models_gate_and_phases(tiny_checkpoint, tmp_path):
    from mdlmpe_ds.pe.phase import pair_phase

    path, model = tiny_checkpoint
    out, logdir = tmp_path / "diag", tmp_path / "tb"
    argv = ["checkpoint", "--model", str(path), "--out", str(out), "--length", "32", "--steps", "3"]
    assert main([*argv, "--size", "500x300", "--tensorboard", str(logdir)]) == 0
    for name in ("gates", "phase_residual", "denoising"):
        with Image.open(out / f"{name}.png") as image:
            assert image.size == (500, 300), name
    report = json.loads((out / "diagnostics.json").read_text())
    assert report["gate"]["gamma"] == pytest.approx(0.1 * torch.sigmoid(torch.tensor(0.3)).item(), rel=1e-6)
    # delta recomputed here from the in-memory model (not the loaded one) on the probe in the JSON.
    ids = torch.tensor([report["probe"]["input_ids"]])
    features = model.embed.mdlmpe.features(ids)
    A, D = features.A[0], features.D[0]
    config = model.config.mdlmpe
    for index, layer in enumerate(model.layers):
        delta = pair_phase(A, D, A, D, layer.attn.phase.params(), config.tau_max, config.clip_kappa)
        assert report["layers"]["mean_abs_delta"][index] == pytest.approx(delta.abs().mean().item(), rel=1e-5)
        assert 0 < report["layers"]["max_abs_delta"][index] <= config.tau_max
    centre, f = report["settings"]["centre_query"], report["settings"]["pairs"][0]
    row = report["phase_residual"][f"layer0_pair{f}_centre_row"]
    m = pair_columns([f], model.config.head_dim // 2)[0]
    delta0 = pair_phase(A, D, A, D, model.layers[0].attn.phase.params(), config.tau_max, config.clip_kappa)
    torch.testing.assert_close(torch.tensor(row), delta0[centre, :, m], rtol=1e-5, atol=1e-7)
    # The trajectory of the project's sampler from the probe canvas [16 prompt tokens, 16 masks]:
    # monotone reveals, all revealed at the end, prompt tokens never rewritten.
    assert report["settings"]["schedule"] == "sampler"
    revealed = torch.tensor(report["denoising"]["revealed"])
    assert revealed.shape == (4, 32)
    assert revealed[0].tolist() == [1.0] * 16 + [0.0] * 16
    assert (revealed[1:] >= revealed[:-1]).all() and revealed[-1].all()
    states = torch.tensor(report["denoising"]["input_ids"])
    kept = revealed[0].bool()
    assert (states[:, kept] == states[0, kept]).all()
    # TensorBoard received the three images.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"images": 0}).Reload()
    assert {"checkpoint/gates", "checkpoint/phase_residual", "checkpoint/denoising"} <= set(
        events.Tags()["images"]
    )


def test_fresh_model_has_zero_phase_and_schedule_reveals_by_confidence():
    from mdlmpe_ds.analysis.diagnostics import state_diagnostics
    from mdlmpe_ds.models.presets import preset
    from mdlmpe_ds.models.transformer import DiffusionLM

    torch.manual_seed(1)
    model = DiffusionLM(preset("llada-tiny", position_encoding="mdlmpe")).eval()
    mask_id = model.config.mask_token_id
    ids = probe_input(model.config.vocab_size, mask_id, 24, 0.5, seed=3, prompt=None)
    assert int((ids == mask_id).sum()) == 12
    exact = probe_input(
        model.config.vocab_size, mask_id, 8, 0.5, seed=3, prompt=list(range(8)), mask_positions=[2, 5]
    )
    assert exact[0].tolist() == [0, 1, mask_id, 3, 4, mask_id, 6, 7]
    with pytest.raises(ValueError, match=r"\[prompt, masks\]"):
        sampler_trajectory(model, exact, steps=2, block_length=None, seed=0)
    state = state_diagnostics(model, ids, [0], [0])
    assert (state.mean_abs == 0).all()  # W2 = b2 = 0 at init: exactly plain RoPE (Eq. (25))
    states = denoise_trajectory(model, ids, steps=4)
    # Quotas ceil(remaining / steps_left) = 3, 3, 3, 3; the first step reveals the 3 most confident.
    counts = [int((s == mask_id).sum()) for s in states]
    assert counts == [12, 9, 6, 3, 0]
    with torch.no_grad():
        logits = model(ids).float()[0]
    logits[:, mask_id] = -math.inf
    confidence = logits.softmax(-1).max(-1).values
    confidence[ids[0] != mask_id] = -1
    newly = ((ids[0] == mask_id) & (states[1][0] != mask_id)).nonzero().flatten()
    assert set(newly.tolist()) == set(confidence.topk(3).indices.tolist())


def test_checkpoint_command_confidence_schedule_on_scattered_masks(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint
    out = tmp_path / "diag"
    argv = ["checkpoint", "--model", str(path), "--out", str(out), "--length", "24", "--steps", "2"]
    assert main([*argv, "--schedule", "confidence", "--pairs", "3", "--size", "420x300"]) == 0
    report = json.loads((out / "diagnostics.json").read_text())
    revealed = torch.tensor(report["denoising"]["revealed"])
    assert report["settings"]["schedule"] == "confidence" and report["settings"]["pairs"] == [3]
    # Scattered (not tail) masks at the start, quotas 6 then 6, nothing masked at the end.
    assert revealed[0].sum() == 12 and revealed[0, 12:].sum() > 0
    assert revealed.sum(-1).tolist() == [12.0, 18.0, 24.0]
    with pytest.raises(ValueError, match="carry no phase residual"):
        main([*argv, "--pairs", "2"])
