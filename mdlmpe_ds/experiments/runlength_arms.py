"""The arms of the run-length study, built with matched initial weights, and their knockouts.

Every arm is the ``llada-mech`` backbone (d 96, 3 layers, 3 heads of d_h 32) at the geometry's
length and vocabulary; for one seed every arm starts from bit-identical backbone weights (the
position modules draw from streams of their own, seeding.init_stream), so a difference between
arms is the position module's. Arms:

* ``rope``: the baseline;
* ``mdlmpe``: the paper's defaults;
* ``mdlmpe-strong-gate``: the embedding gate starts at gamma 0.5 with gamma_max 1 (paper: 0.01, 0.1);
* ``mdlmpe-phase-only``: no embedding path; ``mdlmpe-embedding-only``: no phase residual (every
  KV head off the phase path, docs/method.md "Heads");
* ``mdlmpe-shared``: one phase MLP for the whole model (``phase_mlp="shared"``), the paper's reading;
* ``oracle``: RoPE plus a learned embedding of the true gap length (the masked stretch a masked
  token sits in; 0 where visible) added to the input: the ceiling for any layout feature.

Knockouts for MDLMPE arms, on the trained weights: ``shuffle`` and ``constant`` availability
(evaluation/knockout.py) and ``off`` (gamma -> 0 and delta -> 0: the embedding gate closed, every
phase MLP's output layer zeroed: the model is then exactly its RoPE backbone).
"""

from __future__ import annotations

import torch
from torch import nn

from mdlmpe_ds.attention import AttentionImpl
from mdlmpe_ds.experiments.runlength_data import SEP, Geometry
from mdlmpe_ds.models import DiffusionLM, preset
from mdlmpe_ds.seeding import init_stream

ARMS: dict[str, dict] = {
    "rope": {"position_encoding": "rope"},
    "mdlmpe": {"position_encoding": "mdlmpe"},
    "mdlmpe-strong-gate": {"position_encoding": "mdlmpe", "mdlmpe": {"gamma_init": 0.5, "gamma_max": 1.0}},
    "mdlmpe-phase-only": {"position_encoding": "mdlmpe", "mdlmpe": {"use_embedding": False}},
    "mdlmpe-embedding-only": {"position_encoding": "mdlmpe", "phase": False},
    "mdlmpe-shared": {"position_encoding": "mdlmpe", "mdlmpe": {"phase_mlp": "shared"}},
    "oracle": {"position_encoding": "rope", "oracle": True},
}
KNOCKOUTS = ("shuffle", "constant", "off")


class GapOracle(nn.Module):
    """A learned embedding of the gap length (0: visible, 1..K: masked stretch length, K + 1 for any
    longer stretch), added to the block input by a forward hook on the model's input embedding."""

    def __init__(self, max_run: int, hidden: int, std: float) -> None:
        super().__init__()
        self.max_run = max_run
        self.table = nn.Embedding(max_run + 2, hidden)
        nn.init.normal_(self.table.weight, std=std)
        self.gap: torch.Tensor | None = None  # [B, L] long, set per forward by the study

    def hook(self, module: nn.Module, inputs, output):
        x, features = output
        if self.gap is None:
            raise RuntimeError("GapOracle: set .gap for the batch before the forward")
        return x + self.table(self.gap.clamp(max=self.max_run + 1)).to(x.dtype), features


# How the study computes MDLMPE attention: the same numbers to fp32 rounding either way. "dense"
# (plain autograd) starts at once; "compiled" (the blocked path through torch.compile) pays a few
# seconds of compilation per process and shape, then runs a training step at L 128 about 1.7x
# faster on one CPU thread.
STUDY_ATTENTION = {
    "dense": AttentionImpl(backend="dense"),
    "compiled": AttentionImpl(backend="blocked", compile=True),
}


def build_arm(
    arm: str, geometry: Geometry, seed: int, extra: dict | None = None, attention: str = "dense"
) -> tuple[DiffusionLM, GapOracle | None]:
    """The arm's model with the seed's matched initial weights (and its oracle module, or None).
    ``extra``: more ``mdlmpe`` config keys (e.g. another arm defined by the caller); ``attention``:
    a key of STUDY_ATTENTION."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    if attention not in STUDY_ATTENTION:
        raise ValueError(f"unknown study attention {attention!r}; choose from {', '.join(STUDY_ATTENTION)}")
    spec = ARMS[arm]
    mdlmpe = {**spec.get("mdlmpe", {}), **(extra or {})}
    config = preset(
        "llada-mech",
        vocab_size=geometry.vocab_size,
        mask_token_id=geometry.mask_id,
        eos_token_id=SEP,
        pad_token_id=SEP,
        max_seq_len=geometry.length,
        position_encoding=spec["position_encoding"],
        **({"mdlmpe": mdlmpe} if mdlmpe else {}),
    )
    torch.manual_seed(seed)
    model = DiffusionLM(config, impl=STUDY_ATTENTION[attention])
    if spec.get("phase", True) is False:
        model.set_active_kv_heads(torch.zeros(config.num_kv_heads, dtype=torch.bool))
    oracle = None
    if spec.get("oracle"):
        with init_stream("gap_oracle"):
            oracle = GapOracle(geometry.max_run, config.hidden_size, config.init_std)
        model.embed.register_forward_hook(oracle.hook)
        model.add_module("gap_oracle", oracle)  # its table trains with the model
    return model, oracle
