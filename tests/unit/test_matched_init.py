"""Matched initialisation: for one seed, every position encoding that the comparison and the
mechanism study train (``compare.ENCODINGS``: rope, alibi, absolute, mdlmpe and the ablation
ladder) starts from bit-identical backbone weights, so a matched run changes only the position
module. The position modules draw from streams of their own (``seeding.init_stream``), keyed by
the seed: before, the MDLMPE encoder's W_p and every layer's phase MLP drew from the global stream
between the backbone's draws, and 22 of 30 backbone tensors of a tiny RoPE / MDLMPE pair differed.

The models are built as ``runs.common.build_model`` builds them (``torch.manual_seed(train.seed)``,
then the model), from the configurations the comparison's pretraining commands ask for, for both
families' tiny presets.
"""

from __future__ import annotations

import pytest
import torch

from mdlmpe_ds.experiments.compare import ENCODINGS
from mdlmpe_ds.models.presets import preset
from mdlmpe_ds.models.transformer import DiffusionLM


def _build(family: str, encoding: str, seed: int) -> DiffusionLM:
    spec = ENCODINGS[encoding]
    overrides = {"position_encoding": spec["position_encoding"]}
    if "mdlmpe" in spec:
        overrides["mdlmpe"] = spec["mdlmpe"]
    torch.manual_seed(seed)  # as runs.common.build_model does, on every rank
    return DiffusionLM(preset(f"{family}-tiny", **overrides), device="cpu")


def _backbone(model: DiffusionLM) -> dict[str, torch.Tensor]:
    names = set(model.mdlmpe_parameter_names())
    return {
        n: t for n, t in model.state_dict().items() if n not in names and not n.startswith("embed.positions.")
    }


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_every_encoding_starts_from_the_same_backbone(family):
    reference = _backbone(_build(family, "rope", seed=3))
    assert len(reference) > 10
    for encoding in ENCODINGS:
        model = _build(family, encoding, seed=3)
        backbone = _backbone(model)
        assert backbone.keys() == reference.keys(), encoding
        differ = [n for n, t in backbone.items() if not torch.equal(t, reference[n])]
        assert not differ, (
            f"{family} {encoding}: {len(differ)} of {len(backbone)} backbone tensors differ from rope: "
            f"{differ[:4]}"
        )
        # The global stream continues as if no position module had drawn (later draws match too).
        assert torch.equal(torch.rand(4), _after_rope_build(family))


def _after_rope_build(family: str) -> torch.Tensor:
    _build(family, "rope", seed=3)
    return torch.rand(4)


def test_position_modules_depend_on_the_seed_and_their_own_key():
    """The MDLMPE parameters are keyed by the seed (same seed: same values; another seed: others),
    each layer's phase MLP by its layer index, and a re-initialisation on gathered ZeRO-3
    parameters (``reset_mdlmpe_parameters``) draws them from the same streams."""
    a, b, c = _build("llada", "mdlmpe", 3), _build("llada", "mdlmpe", 3), _build("llada", "mdlmpe", 4)
    names = a.mdlmpe_parameter_names()
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    random_names = [
        n for n in names if sa[n].numel() > 1 and sa[n].std() > 0
    ]  # W1, b1, W_p (W2, b2, b_p start at 0)
    assert random_names
    assert all(torch.equal(sa[n], sb[n]) for n in names)
    assert all(not torch.equal(sa[n], sc[n]) for n in random_names)
    w1 = [sa[f"layers.{i}.attn.phase.fc1.weight"] for i in range(len(a.layers))]
    assert len(w1) > 1 and not torch.equal(w1[0], w1[1])
    torch.manual_seed(3)
    with torch.no_grad():
        for n in names:
            dict(a.named_parameters())[n].normal_()
    a.reset_mdlmpe_parameters()
    assert all(torch.equal(a.state_dict()[n], sb[n]) for n in names if "gate" not in n)


def test_shared_phase_mlp_has_its_own_stream():
    """phase_mlp="shared": the one MLP draws from its own stream (tag ``shared_phase_mlp``), keyed by
    the seed; the encoder and the backbone are those of the per-layer model of the same seed, the
    shared MLP is none of the per-layer model's MLPs, and a re-initialisation redraws it."""
    shared, again, other = (_build("llada", "mdlmpe-shared", s) for s in (3, 3, 4))
    per_layer = _build("llada", "mdlmpe", 3).state_dict()
    sd, sa, so = shared.state_dict(), again.state_dict(), other.state_dict()
    for name in ("shared_phase.fc1.weight", "shared_phase.fc1.bias"):
        assert torch.equal(sd[name], sa[name]) and not torch.equal(sd[name], so[name])
        for i in range(len(shared.layers)):
            assert not torch.equal(
                sd[name], per_layer[name.replace("shared_phase", f"layers.{i}.attn.phase")]
            )
    assert sd["shared_phase.fc2.weight"].abs().max() == 0  # W2 = b2 = 0: delta = 0 at the start
    assert all(torch.equal(t, per_layer[n]) for n, t in sd.items() if not n.startswith("shared_phase."))
    with torch.no_grad():
        for p in shared.shared_phase.parameters():
            p.normal_()
    shared.reset_mdlmpe_parameters()
    assert all(torch.equal(shared.state_dict()[n], sa[n]) for n in sa if n.startswith("shared_phase."))


def test_absolute_table_has_its_own_stream():
    """The absolute position table also draws from its own stream (the backbone test covers the
    other weights); it depends on the seed."""
    t3 = _build("llada", "absolute", 3).state_dict()["embed.positions.weight"]
    t3b = _build("llada", "absolute", 3).state_dict()["embed.positions.weight"]
    t4 = _build("llada", "absolute", 4).state_dict()["embed.positions.weight"]
    assert torch.equal(t3, t3b) and not torch.equal(t3, t4)
