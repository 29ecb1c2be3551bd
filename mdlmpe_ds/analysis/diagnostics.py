"""Per-checkpoint MDLMPE diagnostics: the embedding gate, the phase residual delta_{ij,f} of every layer
for one input and mask state, and how delta moves across the steps of one generation.

What "gamma per layer" means here: the model has ONE embedding gate gamma = gamma_max sigmoid(g)
(Eq. (11), in the shared encoder), and one phase MLP per attention layer (Eq. (25); with
``phase_mlp="shared"`` one for all layers, whose rows then repeat). So the per-layer numbers
are the phase-MLP statistics (mean / max |delta| over all (i, j, f in F_MDLMPE), and ||W2||_F), reported next
to the single gamma and the relative size of the embedding perturbation ||gamma z_i|| / ||e_i||.

Two ways to produce "one generation" (``--schedule``):

- ``sampler`` (default): the project's sampler, ``mdlmpe_ds.diffusion.sampling.generate`` with
  LLaDA's defaults (low-confidence remasking, temperature 0, linear schedule, optional semi-AR
  blocks), on a canvas ``[prompt, gen_length masks]``; every state the model was called on is
  recorded (``record_history``) plus the final one. The probe is that canvas.
- ``confidence``: a self-contained deterministic schedule on a probe whose masked positions are a
  seeded random subset: each of ``steps`` steps runs the model once and reveals the
  ceil(remaining / steps_left) masked positions whose argmax token is most probable (ties by
  position), writing that token. Useful for masks scattered through the sequence.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mdlmpe_ds.analysis.plots import (
    TensorBoardImages,
    draw_denoising,
    draw_gates,
    draw_phase,
    new_figure,
    save_json,
    save_png,
)
from mdlmpe_ds.diffusion.sampling import SamplerConfig, generate
from mdlmpe_ds.evaluation.loading import load_model
from mdlmpe_ds.pe.phase import mdlmpe_pairs, pair_phase

SCHEDULES = {
    "sampler": "mdlmpe_ds.diffusion.sampling.generate (LLaDA low-confidence remasking, temperature 0) on "
    "[prompt, gen_length masks]; states recorded at every model call plus the final one",
    "confidence": "deterministic: each step reveals the ceil(remaining / steps_left) masked positions whose "
    "argmax token is most probable, writing that token (mdlmpe_ds.analysis.diagnostics)",
}


@dataclass
class StateDiagnostics:
    """delta for one input state.

    b: [L] (1 = revealed); mean_abs, max_abs: [layers] over all (i, j, m); delta: [len(layers_kept),
    L, L, len(columns_kept)] the full residual of the kept layers and MDLMPE columns only (the whole
    tensor is layers x L^2 x |M|, too big to hold for a deep model at a useful L).
    """

    b: torch.Tensor
    mean_abs: torch.Tensor
    max_abs: torch.Tensor
    layers_kept: list[int]
    columns_kept: list[int]
    delta: torch.Tensor

    def layer_stats(self) -> dict[str, list[float]]:
        return {"mean_abs_delta": self.mean_abs.tolist(), "max_abs_delta": self.max_abs.tolist()}

    def panel(self, layer: int, column: int) -> torch.Tensor:
        """delta_{ij,m} [L, L] of a kept layer and column."""
        return self.delta[self.layers_kept.index(layer), :, :, self.columns_kept.index(column)]


def _require_mdlmpe(model: torch.nn.Module) -> None:
    if getattr(model.config, "position_encoding", None) != "mdlmpe":
        raise ValueError(
            f"checkpoint diagnostics need an MDLMPE model; this one uses "
            f"position_encoding={getattr(model.config, 'position_encoding', None)!r}"
        )


def gate_summary(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[str, Any]:
    """gamma, gamma_max and the relative embedding perturbation ||gamma (W_p A_i + b_p)|| / ||e_i||."""
    _require_mdlmpe(model)
    encoder = model.embed.mdlmpe
    config = encoder.config
    out: dict[str, Any] = {"gamma_max": config.gamma_max, "use_embedding": config.use_embedding}
    if encoder.proj is None:
        return {**out, "gamma": None, "relative_perturbation_mean": None, "relative_perturbation_max": None}
    with torch.no_grad():
        features = encoder.features(input_ids)
        e = model.embed.tokens(input_ids).float()  # [B, L, d]
        perturbed = encoder.embed(e, features)
        ratio = (perturbed - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-12)  # [B, L]
    return {
        **out,
        "gamma": encoder.gamma.item(),
        "relative_perturbation_mean": ratio.mean().item(),
        "relative_perturbation_max": ratio.max().item(),
    }


def phase_weight_norms(model: torch.nn.Module) -> list[float]:
    """||W2||_F of every layer's phase MLP (0 at initialisation: delta = 0, plain RoPE)."""
    _require_mdlmpe(model)
    return [phase.fc2.weight.float().norm().item() for phase in model.phase_mlps()]


def state_diagnostics(
    model: torch.nn.Module, input_ids: torch.Tensor, layers: list[int], columns: list[int]
) -> StateDiagnostics:
    """delta_{ij,m} of every layer for one state [1, L], from the model's own encoder and phase MLPs.

    The encoder's features (b, A, D) are computed once, as in the forward, and each layer's
    ``PhaseMLP`` is evaluated on all (i, j) pairs with ``pair_phase`` (Eqs. (23),
    (24), (25)): L^2 |M| floats per layer at a time. Statistics are kept for every layer, the
    full residual only for ``layers`` x ``columns`` (MDLMPE columns m, not rotary pair indices).
    """
    _require_mdlmpe(model)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"state diagnostics take one sequence [1, L], got {tuple(input_ids.shape)}")
    encoder = model.embed.mdlmpe
    config = encoder.config
    mean_abs, max_abs, kept = [], [], []
    with torch.no_grad():
        features = encoder.features(input_ids)
        A, D = features.A[0], features.D[0]  # [L, F]
        delta, used = None, None
        for index, layer in enumerate(model.layers):
            if layer.attn.phase_mlp is not used:  # a shared MLP gives every layer the same delta
                used = layer.attn.phase_mlp
                delta = pair_phase(
                    A, D, A, D, used.params(), config.tau_max, config.clip_kappa
                )  # [L, L, |M|]
            mean_abs.append(delta.abs().mean())
            max_abs.append(delta.abs().max())
            if index in layers:
                kept.append(delta[..., columns].cpu())  # [L, L, len(columns)]
    return StateDiagnostics(
        b=features.b[0].cpu(),
        mean_abs=torch.stack(mean_abs).cpu(),
        max_abs=torch.stack(max_abs).cpu(),
        layers_kept=sorted(layers),
        columns_kept=list(columns),
        delta=torch.stack(kept),
    )


def probe_input(
    vocab_size: int,
    mask_token_id: int,
    length: int,
    mask_fraction: float,
    seed: int,
    prompt: list[int] | None,
    tail: bool = False,
    mask_positions: list[int] | None = None,
) -> torch.Tensor:
    """A [1, L] probe: ``prompt`` ids (or seeded random non-mask ids), then the mask state: exactly
    ``mask_positions`` when given, else round(mask_fraction * L) positions, a seeded random subset
    or the last ones when ``tail`` (the sampler's canvas ``[prompt, masks]``)."""
    if not 0.0 <= mask_fraction <= 1.0:
        raise ValueError(f"--mask-fraction={mask_fraction} must be in [0, 1]")
    generator = torch.Generator().manual_seed(seed)
    if prompt is not None:
        if len(prompt) < 2:
            raise ValueError("--prompt-ids needs at least 2 token ids")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"--prompt-ids outside the vocabulary [0, {vocab_size}): {bad[:10]}")
        ids = torch.tensor(prompt, dtype=torch.long)
    else:
        if length < 2:
            raise ValueError(f"--length={length} must be >= 2")
        # Uniform over the vocabulary without the mask id: draw from V - 1 ids and skip over it.
        ids = torch.randint(0, vocab_size - 1, (length,), generator=generator)
        ids = ids + (ids >= mask_token_id).long()
    if mask_positions is not None:
        bad = [p for p in mask_positions if not 0 <= p < ids.numel()]
        if bad:
            raise ValueError(f"--mask-positions outside [0, {ids.numel()}): {bad[:10]}")
        ids = ids.clone()
        ids[torch.tensor(mask_positions, dtype=torch.long)] = mask_token_id
        return ids.unsqueeze(0)
    count = round(mask_fraction * ids.numel())
    if tail and not 1 <= count < ids.numel():
        raise ValueError(
            f"--mask-fraction={mask_fraction} leaves no prompt or no masks in {ids.numel()} tokens"
        )
    order = torch.arange(ids.numel()).flip(0) if tail else torch.randperm(ids.numel(), generator=generator)
    masked = order[:count]
    ids = ids.clone()
    ids[masked] = mask_token_id
    return ids.unsqueeze(0)


def sampler_trajectory(
    model: torch.nn.Module, canvas: torch.Tensor, steps: int, block_length: int | None, seed: int
) -> list[torch.Tensor]:
    """The states of one ``generate`` call from ``canvas`` [1, L] = [prompt, masks]: the input of every
    model call (``record_history``) and the final sequence. Each [1, L]."""

    mask_id = model.config.mask_token_id
    masked = (canvas[0] == mask_id).nonzero().flatten()
    if masked.numel() == 0 or int(masked[0]) + masked.numel() != canvas.shape[1]:
        raise ValueError(
            "the sampler schedule needs a probe of the form [prompt, masks] (masks at the end, at least one "
            "prompt token); use --schedule confidence for other mask states"
        )
    prompt = canvas[0, : int(masked[0])]
    config = SamplerConfig(
        gen_length=masked.numel(), steps=steps, block_length=block_length, stop_at_eos=False, seed=seed
    )
    out = generate(model, [prompt], config, record_history=True)
    states = [record.input_ids for record in out.history] + [out.sequences]
    if not torch.equal(states[0], canvas):
        raise AssertionError("sampler canvas differs from the probe (prompt layout changed?)")
    return states


def denoise_trajectory(model: torch.nn.Module, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The states x^(0..S) of the deterministic confidence schedule in the module docstring. Each [1, L].

    x^(0) is the probe; x^(S) has no mask left. Positions unmasked in the probe are never changed.
    """
    if steps < 1:
        raise ValueError(f"--steps={steps} must be >= 1")
    mask_id = model.config.mask_token_id
    states = [input_ids.clone()]
    ids = input_ids.clone()
    with torch.no_grad():
        for step in range(steps):
            masked = ids[0] == mask_id  # [L]
            remaining = int(masked.sum().item())
            if remaining == 0:
                states.append(ids.clone())
                continue
            logits = model(ids).float()[0]  # [L, V]
            logits[:, mask_id] = -math.inf  # never "reveal" a mask token
            confidence, token = logits.softmax(-1).max(-1)  # [L]
            confidence = torch.where(masked, confidence, torch.full_like(confidence, -1.0))
            count = math.ceil(remaining / (steps - step))
            # Stable descending sort: equal confidences are revealed left to right.
            order = torch.sort(confidence, descending=True, stable=True).indices[:count]
            ids = ids.clone()
            ids[0, order] = token[order]
            states.append(ids.clone())
    return states


def default_pairs(num_pairs: int) -> list[int]:
    """Three rotary pairs of F_MDLMPE (odd f) spread from high to low frequency."""
    odd = mdlmpe_pairs(num_pairs).tolist()
    picks = sorted({odd[0], odd[len(odd) // 2], odd[-1]})
    return picks


def pair_columns(pairs: list[int], num_pairs: int) -> list[int]:
    """Rotary pair f -> its column m in delta [..., |M|] (the odd pairs, in order)."""
    odd = mdlmpe_pairs(num_pairs).tolist()
    bad = [f for f in pairs if f not in odd]
    if bad:
        raise ValueError(f"--pairs {bad} carry no phase residual; MDLMPE pairs are the odd f < F={num_pairs}")
    return [odd.index(f) for f in pairs]


def run_checkpoint(args: argparse.Namespace) -> list[Path]:
    """The ``checkpoint`` command: load the model, probe it, write PNG + JSON (+ TensorBoard).

    ``--model`` is whatever ``launch/generate.py --checkpoint`` takes: an export or other HF-format
    directory, a hub id, or a training output (output_dir, ``checkpoints/``, a step directory or
    ``latest``: its newest complete checkpoint, consolidated in this process)."""

    model, _ = load_model(str(args.model), device=args.device, dtype=args.dtype)
    check_probe_length(args, model.config.max_seq_len)  # before anything runs or is written
    return diagnose(model, args, source=str(args.model))


def check_probe_length(args: argparse.Namespace, limit: int) -> None:
    """Refuse a probe longer than the model's max_seq_len, as launch/generate.py and evaluate.py do:
    positions past it were never trained (no row of an absolute table, MDLMPE's L_ref), so the
    figures would describe untrained positions."""
    if args.prompt_ids:
        count = len(args.prompt_ids.split(","))
        if count > limit:
            raise SystemExit(
                f"--prompt-ids gives {count} ids, more than the maximum length {limit} of {args.model} "
                f"(max_seq_len in its config): positions past it were never trained; give {limit} or fewer"
            )
    elif args.length > limit:
        raise SystemExit(
            f"--length {args.length} is longer than the maximum length {limit} of {args.model} (max_seq_len "
            f"in its config): positions past it were never trained; use --length {limit} or less"
        )


def diagnose(model: torch.nn.Module, args: argparse.Namespace, source: str) -> list[Path]:
    """Compute every diagnostic for ``model`` and write gates.png, phase_residual.png, denoising.png and
    diagnostics.json under ``args.out``; log the figures to TensorBoard when ``args.tensorboard``."""

    _require_mdlmpe(model)
    config = model.config
    device = next(model.parameters()).device
    num_pairs = config.head_dim // 2
    pairs = args.pairs or default_pairs(num_pairs)
    columns = pair_columns(pairs, num_pairs)
    prompt = [int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids else None
    sampler = args.schedule == "sampler"
    positions = [int(p) for p in args.mask_positions.split(",")] if args.mask_positions else None
    ids = probe_input(
        config.vocab_size,
        config.mask_token_id,
        args.length,
        args.mask_fraction,
        args.seed,
        prompt,
        tail=sampler,
        mask_positions=positions,
    )
    ids = ids.to(device)

    layers = _layers_to_draw(config.num_layers)
    state = state_diagnostics(model, ids, layers, columns)
    gates = gate_summary(model, ids)
    norms = phase_weight_norms(model)
    if args.steps == 0:
        trajectory = [ids]
    elif sampler:
        trajectory = sampler_trajectory(model, ids, args.steps, args.block_length, args.seed)
    else:
        trajectory = denoise_trajectory(model, ids, args.steps)
    per_step = [state_diagnostics(model, x, layers, columns) for x in trajectory]
    centre = ids.shape[1] // 2
    report: dict[str, Any] = {
        "source": source,
        "settings": {
            "length": ids.shape[1],
            "mask_fraction": args.mask_fraction,
            "seed": args.seed,
            "steps": args.steps,
            "pairs": pairs,
            "centre_query": centre,
            "schedule": args.schedule,
            "schedule_description": SCHEDULES[args.schedule],
            "block_length": args.block_length,
            "mdlmpe": config.mdlmpe.to_dict(),
            "num_layers": config.num_layers,
            "num_pairs": num_pairs,
        },
        "gate": gates,
        "layers": {**state.layer_stats(), "phase_w2_norm": norms},
        "probe": {"input_ids": ids[0].tolist(), "revealed": state.b.tolist()},
        "phase_residual": {
            f"layer{layer}_pair{f}_centre_row": state.panel(layer, m)[centre].tolist()
            for layer in layers
            for f, m in zip(pairs, columns)
        },
        "denoising": {
            "revealed": [s.b.tolist() for s in per_step],
            "mean_abs_delta": [s.layer_stats()["mean_abs_delta"] for s in per_step],
            "max_abs_delta": [s.layer_stats()["max_abs_delta"] for s in per_step],
            "input_ids": [x[0].tolist() for x in trajectory],
        },
    }
    width, height = args.size or (1500, 460)
    figures = {
        "gates": (draw_gates, (width, height)),
        "phase_residual": (draw_phase, args.size or (1200, 900)),
        "denoising": (draw_denoising, (width, height)),
    }
    written: list[Path] = []
    log = TensorBoardImages(args.tensorboard)
    try:
        for name, (draw, (w, h)) in figures.items():
            figure = new_figure(w, h, args.dpi)
            draw(figure, report, state, per_step, columns)
            written.append(save_png(figure, args.out / f"{name}.png"))
            log.add(f"checkpoint/{name}", figure)
            print(f"{name}: wrote {written[-1]}")
        for step, stats in enumerate(report["denoising"]["mean_abs_delta"]):
            log.add_scalars("checkpoint/mean_abs_delta", {f"layer{k}": v for k, v in enumerate(stats)}, step)
        written.append(save_json(report, args.out / "diagnostics.json"))
        print(f"numbers: wrote {written[-1]}")
    finally:
        log.close()
    return written


def _layers_to_draw(num_layers: int) -> list[int]:
    """First, middle and last layer (fewer when the model is shallower)."""
    return sorted({0, num_layers // 2, num_layers - 1})
