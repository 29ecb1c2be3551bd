"""``phase_mlp="shared"``: one phase MLP for the whole model instead of one per layer (docs/method.md
"Phase MLP: per layer or shared").

The oracle: a shared model computes exactly what a per-layer model computes when every layer holds
the same MLP weights (paper Eq. (25) with one (W1, b1, W2, b2) for all layers), and the gradient of
the shared weights is the sum over layers of the per-layer gradients. A model whose layers silently
kept copies of their own would fail both (the copies' gradients would not reach the shared weights),
and the parameter count pins it: shared = per-layer - (N_layers - 1) x one MLP.

Backends: reference (the spec), blocked eager and compiled, and the fused Triton kernel in its CPU
interpreter (a child process started with TRITON_INTERPRET=1, as tests/unit/test_triton_attention.py
does). Tolerances are said beside each comparison.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from contextlib import nullcontext

import pytest
import torch

from mdlmpe_ds.attention import AttentionImpl
from mdlmpe_ds.compat import read_stored_mdlmpe as read_stored
from mdlmpe_ds.models import DiffusionLM, preset
from mdlmpe_ds.models.names import from_checkpoint_name, to_checkpoint_name
from mdlmpe_ds.pe.config import MDLMPEConfig
from mdlmpe_ds.pe.phase import PhaseMLP

SHARED = {"phase_mlp": "shared"}
MLP_TENSORS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def _shared(family: str, impl: AttentionImpl | None = None, seed: int = 0) -> DiffusionLM:
    """A trained-looking shared-phase tiny model: a non-zero phase output (W2, b2 start at 0:
    delta = 0) and O(1) attention scores."""
    torch.manual_seed(seed)
    model = DiffusionLM(preset(f"{family}-tiny", position_encoding="mdlmpe", mdlmpe=SHARED), impl=impl)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.shared_phase.fc2.weight.normal_(std=1.0, generator=gen)
        model.shared_phase.fc2.bias.normal_(std=1.0, generator=gen)
        for layer in model.layers:  # O(1) scores, so the phase moves the attention visibly
            for proj in (layer.attn.q_proj, layer.attn.k_proj):
                proj.weight.normal_(std=0.5, generator=gen)
    return model


def _tied_per_layer(shared: DiffusionLM) -> DiffusionLM:
    """A per-layer model with the shared model's backbone and encoder, every layer holding a copy of
    the shared MLP: the function the shared model must compute."""
    config = preset(f"{shared.config.family}-tiny", position_encoding="mdlmpe")
    model = DiffusionLM(config, impl=shared.impl)
    state = {k: v for k, v in shared.state_dict().items() if not k.startswith("shared_phase.")}
    for i in range(config.num_layers):
        state.update(
            {f"layers.{i}.attn.phase.{t}": shared.state_dict()[f"shared_phase.{t}"] for t in MLP_TENSORS}
        )
    model.load_state_dict(state, strict=True)
    return model


def _batch(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size - 2, (2, 11), generator=g)
    ids[torch.rand(ids.shape, generator=g) < 0.5] = config.mask_token_id
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 8:] = False
    ids[1, 8:] = config.pad_token_id
    return ids, valid


def _loss(model, ids, valid):
    return model(ids, valid).float().logsumexp(-1)[valid].mean()


IMPLS = {
    "reference": AttentionImpl(backend="reference"),
    "blocked": AttentionImpl(backend="blocked", query_block=4),
    "blocked-compiled": AttentionImpl(backend="blocked", query_block=4, compile=True),
}


# torch.compile on the CPU costs ~80 s the first time (test_blocked_attention's compiled tests
# cover the pieces; the shared MLP reaches them as the same PhaseParams tensors as a layer's own).
COMPILED = pytest.param(
    "dream",
    "blocked-compiled",
    marks=[
        pytest.mark.slow,
        pytest.mark.skipif(
            os.environ.get("MDLMPE_DS_TEST_COMPILE") != "1", reason="set MDLMPE_DS_TEST_COMPILE=1"
        ),
    ],
)


@pytest.mark.parametrize(
    ("family", "backend"), [("llada", "reference"), ("dream", "reference"), ("llada", "blocked"), COMPILED]
)
def test_shared_equals_per_layer_with_tied_weights_and_gradients_sum(family, backend):
    shared = _shared(family, IMPLS[backend])
    tied = _tied_per_layer(shared)
    ids, valid = _batch(shared.config)
    # Same weights, same operations in the same order: the logits agree to the last bit.
    with torch.no_grad():
        assert torch.equal(shared(ids, valid), tied(ids, valid))
    _loss(shared, ids, valid).backward()
    _loss(tied, ids, valid).backward()
    for t in MLP_TENSORS:
        got = shared.get_parameter(f"shared_phase.{t}").grad
        per_layer = [tied.get_parameter(f"layers.{i}.attn.phase.{t}").grad for i in range(len(tied.layers))]
        assert all(g.abs().max() > 0 for g in per_layer) or t.startswith("fc1"), t
        # Autograd accumulates the layers' contributions in its own order: fp32 round-off only.
        torch.testing.assert_close(got, torch.stack(per_layer).sum(0), atol=1e-6, rtol=1e-5, msg=t)
    assert shared.shared_phase.fc1.weight.grad.abs().max() > 0  # W2 != 0: W1 is reached too
    for name, p in shared.named_parameters():
        if not name.startswith("shared_phase."):
            torch.testing.assert_close(p.grad, tied.get_parameter(name).grad, atol=1e-6, rtol=1e-5, msg=name)


def test_one_module_serves_every_layer_and_is_counted_once():
    shared = _shared("llada")
    per_layer = DiffusionLM(preset("llada-tiny", position_encoding="mdlmpe"))
    assert all(
        layer.attn.phase is None and layer.attn.phase_mlp is shared.shared_phase for layer in shared.layers
    )
    assert shared.phase_mlps() == [shared.shared_phase] * len(shared.layers)
    names = [n for n, _ in shared.named_parameters()]
    assert [n for n in names if "phase" in n] == [f"shared_phase.{t}" for t in MLP_TENSORS]
    assert set(shared.state_dict()) == set(names)  # no per-layer alias in checkpoints either
    assert set(shared.mdlmpe_parameter_names()) >= {f"shared_phase.{t}" for t in MLP_TENSORS}
    one = sum(p.numel() for p in shared.shared_phase.parameters())
    n_layers = shared.config.num_layers
    assert per_layer.num_mdlmpe_parameters() - shared.num_mdlmpe_parameters() == (n_layers - 1) * one
    assert per_layer.num_backbone_parameters() == shared.num_backbone_parameters()
    # ZeRO-3: every layer's attention reads the shared weights, so each is paired with each of them.
    pairs = shared.zero3_external_parameters()
    for layer in shared.layers:
        assert [p for m, p in pairs if m is layer.attn] == list(shared.shared_phase.parameters())
    assert sum(m is shared.embed for m, _ in pairs) == len(list(shared.embed.mdlmpe.parameters()))


def test_parameter_counts_of_the_real_backbones():
    """docs/method.md "Phase MLP: per layer or shared": one MLP is F H + H + H |M| + |M| (F = d_h / 2,
    H = max(16, F / 2), |M| = F / 2); LLaDA-8B (d_h 128, 32 layers): 3,136 per MLP, 100,352 per layer
    vs 3,136 shared; Dream-7B (28 layers): 87,808 vs 3,136."""
    for name, layers in (("llada-8b", 32), ("dream-7b", 28)):
        counts = {}
        for phase_mlp in ("per_layer", "shared"):
            config = preset(name, position_encoding="mdlmpe", mdlmpe={"phase_mlp": phase_mlp})
            model = DiffusionLM(config, device="meta")
            counts[phase_mlp] = sum(p.numel() for n, p in model.named_parameters() if "phase" in n)
        assert (counts["per_layer"], counts["shared"]) == (3136 * layers, 3136), name


def test_backends_agree_on_the_shared_model():
    """Reference (the spec) vs blocked: logits and the shared weights' gradients.
    All fp32; the paths sum the score terms in different orders: 2e-5 as in test_blocked_attention."""
    results = {}
    for backend in ("reference", "blocked"):
        impl = IMPLS[backend]
        model = _shared("dream", impl)
        ids, valid = _batch(model.config)
        logits = model(ids, valid)
        logits.float().logsumexp(-1)[valid].mean().backward()
        results[backend] = (
            logits.detach()[valid],
            [model.get_parameter(f"shared_phase.{t}").grad for t in MLP_TENSORS],
        )
    want_logits, want_grads = results["reference"]
    for backend in ("blocked",):
        logits, grads = results[backend]
        torch.testing.assert_close(logits, want_logits, atol=2e-5, rtol=0, msg=backend)
        for t, g, w in zip(MLP_TENSORS, grads, want_grads):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=f"{backend} {t}")


@pytest.mark.parametrize("backend", ["reference", "blocked"])
def test_identity_setting_gives_the_rope_logits(backend):
    """W2 = b2 = 0 (the initialisation) and gamma = 0: the shared model is plain RoPE (F.1)."""
    torch.manual_seed(0)
    config = preset("dream-tiny", position_encoding="mdlmpe", mdlmpe=SHARED)
    model = DiffusionLM(config, impl=IMPLS[backend])
    rope = DiffusionLM(preset("dream-tiny"))
    rope.load_state_dict(model.state_dict(), strict=False)
    ids, valid = _batch(config)
    with torch.no_grad():
        model.embed.mdlmpe.gate_logit.fill_(-float("inf"))
        # fp32 score algebra vs one SDPA call: round-off only (test_models_mdlmpe's tolerance).
        torch.testing.assert_close(model(ids, valid)[valid], rope(ids, valid)[valid], atol=2e-5, rtol=0)


def _triton_child() -> dict[str, float]:
    """Child side (TRITON_INTERPRET=1): the shared model through the fused kernel vs the reference."""
    out = {}
    ids = valid = None
    for backend in ("reference", "triton"):
        model = _shared("llada", AttentionImpl(backend=backend, tile=8))
        if ids is None:
            ids, valid = _batch(model.config)
        logits = model(ids, valid)
        logits.float().logsumexp(-1)[valid].mean().backward()
        out[backend] = (
            logits.detach()[valid],
            [model.get_parameter(f"shared_phase.{t}").grad for t in MLP_TENSORS],
        )
    (lr, gr), (lt, gt) = out["reference"], out["triton"]
    errors = {"logits": (lr - lt).abs().max().item()}
    errors.update({t: (a - b).abs().max().item() for t, a, b in zip(MLP_TENSORS, gr, gt)})
    errors["grad_scale"] = max(g.abs().max().item() for g in gr)
    return errors


def test_triton_kernel_on_the_shared_model():
    """The fused kernel (interpreter) gives the reference's logits and shared-MLP gradients. fp32
    both sides, the kernel's arccos polynomial (|err| <= 2e-8) and summation order: 2e-5 absolute on
    the O(1) logits as in tests/unit/test_triton_attention.py, and 1e-4 relative to the largest
    gradient of the shared weights (measured: 9e-7 on the logits, 1.5e-6 relative on the gradients)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, "triton"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"interpreter child failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert errors["grad_scale"] > 1e-4  # the comparison is not between zeros
    assert errors["logits"] <= 2e-5, errors
    assert all(errors[t] <= 1e-4 * errors["grad_scale"] for t in MLP_TENSORS), errors


def test_config_key_is_validated_and_old_configs_read_per_layer():
    with pytest.raises(ValueError, match=r"phase_mlp='one' must be one of \('per_layer', 'shared'\)"):
        MDLMPEConfig(phase_mlp="one").validate()
    assert MDLMPEConfig().phase_mlp == "per_layer"
    old = MDLMPEConfig().to_dict()
    del old["phase_mlp"]  # a checkpoint or export written before the key existed
    assert MDLMPEConfig.from_dict(read_stored(old)) == MDLMPEConfig()
    assert read_stored({**old, "phase_mlp": "shared"})["phase_mlp"] == "shared"


def test_old_checkpoint_config_is_the_same_model_as_per_layer():
    """Resume compares model configs: one stored without the key is the per-layer model, not
    another model; a shared checkpoint resumed as per-layer is refused naming the difference."""
    from mdlmpe_ds.training.checkpoint import SavedRun, check_same_model

    now = preset("llada-tiny", position_encoding="mdlmpe").to_dict()
    stored = json.loads(json.dumps(now))
    del stored["mdlmpe"]["phase_mlp"]
    saved = types.SimpleNamespace(model_config=stored, path="ckpt")
    check_same_model(saved, now)
    shared = preset("llada-tiny", position_encoding="mdlmpe", mdlmpe=SHARED).to_dict()
    with pytest.raises(ValueError, match="phase_mlp"):
        check_same_model(types.SimpleNamespace(model_config=shared, path="ckpt"), now)
    assert SavedRun  # the type the resume path passes (only model_config and path are read)


def test_cli_key():
    from mdlmpe_ds.config.cli import build_config

    run = build_config(None, ["--model.mdlmpe.phase_mlp", "shared"])
    assert run.model.mdlmpe.phase_mlp == "shared"
    with pytest.raises(ValueError, match=r"phase_mlp='both' must be one of"):
        build_config(None, ["--model.mdlmpe.phase_mlp", "both"])


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_checkpoint_names_are_upstream_and_invertible(family):
    model = DiffusionLM(preset(f"{family}-tiny", position_encoding="mdlmpe", mdlmpe=SHARED), device="meta")
    names = [n for n, _ in model.named_parameters()]
    keys = [to_checkpoint_name(n, family) for n in names]
    assert len(set(keys)) == len(keys)
    assert [from_checkpoint_name(k, family) for k in keys] == names
    top = "model.transformer." if family == "llada" else "model."
    assert f"{top}mdlmpe_phase.fc1.weight" in keys


def test_save_reload_is_exact_and_other_layout_is_refused(tmp_path):
    from mdlmpe_ds.models import load_pretrained, save_pretrained
    from mdlmpe_ds.models.hf_io import load_weights_into

    model = _shared("llada", IMPLS["blocked"])
    save_pretrained(model, tmp_path, model.config)
    reloaded = load_pretrained(tmp_path, impl=model.impl)
    assert reloaded.config.mdlmpe.phase_mlp == "shared"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))
    ids, valid = _batch(model.config)
    with torch.no_grad():
        assert torch.equal(reloaded(ids, valid), model(ids, valid))
    # The shared weights never silently become per-layer ones (or the reverse).
    per_layer = DiffusionLM(preset("llada-tiny", position_encoding="mdlmpe"))
    with pytest.raises((KeyError, ValueError), match="mdlmpe_phase"):
        load_weights_into(per_layer, tmp_path)


def test_engine_registers_the_shared_weights_with_every_reader(monkeypatch):
    """engine.build_model registers each (reader, parameter) pair the model lists: the shared MLP is
    no child of the layers that read it. DeepSpeed itself is stubbed (the 2-process run is
    tests/dist/test_shared_phase_zero3.py)."""
    from mdlmpe_ds.distributed import engine

    registered = []
    zero = types.SimpleNamespace(
        Init=lambda **_: nullcontext(), register_external_parameter=lambda m, p: registered.append((m, p))
    )
    monkeypatch.setattr(engine, "_deepspeed", lambda: types.SimpleNamespace(zero=zero))
    model = engine.build_model(lambda: _shared("llada"), {"bf16": {"enabled": False}})
    want = model.zero3_external_parameters()
    assert [(id(m), id(p)) for m, p in registered] == [(id(m), id(p)) for m, p in want]
    shared = set(map(id, model.shared_phase.parameters()))
    assert {id(m) for m, p in registered if id(p) in shared} == {id(layer.attn) for layer in model.layers}


def test_tools_read_the_shared_mlp():
    """The training stats, the per-checkpoint diagnostics and the memory plan handle it."""
    from mdlmpe_ds.analysis.diagnostics import phase_weight_norms, state_diagnostics
    from mdlmpe_ds.training.callbacks import mdlmpe_stats
    from mdlmpe_ds.training.memory_measure import measure_layer

    model = _shared("llada")
    stats = mdlmpe_stats(model)
    assert "mdlmpe/delta_abs_mean/shared" in stats and not any("layer" in k for k in stats)
    norms = phase_weight_norms(model)
    assert len(norms) == len(model.layers) and len(set(norms)) == 1 and norms[0] > 0
    ids, _ = _batch(model.config)
    diag = state_diagnostics(model, ids[:1], layers=[0, 1], columns=[0])
    assert torch.equal(diag.delta[0], diag.delta[1]) and diag.mean_abs[0] > 0
    measured = measure_layer(model.config, 1, 16, impl=IMPLS["blocked"])
    assert measured["kept"] > 0 and measured["backward"] > 0
    assert isinstance(model.layers[0].attn.phase_mlp, PhaseMLP)


if __name__ == "__main__":  # the interpreter child of test_triton_kernel_on_the_shared_model
    torch.set_num_threads(1)
    print(json.dumps(_triton_child()))


def test_another_max_len_is_named_by_its_flag():
    """A resume with another --max_len was reported as "from another model: max_seq_len", a key the
    user never typed; the difference now names the flag and the value to resume with."""
    from mdlmpe_ds.training.checkpoint import check_same_model

    saved = preset("llada-tiny", position_encoding="mdlmpe", max_seq_len=48).to_dict()
    now = preset("llada-tiny", position_encoding="mdlmpe", max_seq_len=64).to_dict()
    with pytest.raises(
        ValueError,
        match=r"max_seq_len: checkpoint 48 vs run 64 \(set by --max_len: resume with --max_len 48\)",
    ):
        check_same_model(types.SimpleNamespace(model_config=saved, path="ckpt"), now)
