"""MDLMPE inside the backbones: identity with RoPE, training signal, head masking, checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mdlmpe_ds.attention import AttentionImpl
from mdlmpe_ds.models import DiffusionLM, Recompute, preset

BACKENDS = ["reference", "blocked"]


def _pair(family, backend, **kw):
    """An MDLMPE model and a RoPE model with the same backbone weights."""
    torch.manual_seed(0)
    mdlmpe = DiffusionLM(
        preset(f"{family}-tiny", position_encoding="mdlmpe", **kw),
        impl=AttentionImpl(backend=backend, query_block=4),
    )
    rope = DiffusionLM(preset(f"{family}-tiny", **kw))
    missing, unexpected = rope.load_state_dict(mdlmpe.state_dict(), strict=False)
    assert not missing and set(unexpected) == set(mdlmpe.mdlmpe_parameter_names())
    return mdlmpe, rope


def _batch(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size - 2, (2, 13), generator=g)
    ids[torch.rand(ids.shape, generator=g) < 0.5] = config.mask_token_id
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 9:] = False
    ids[1, 9:] = config.pad_token_id
    return ids, valid


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_identity_setting_gives_the_rope_logits(family, backend):
    mdlmpe, rope = _pair(family, backend)
    ids, valid = _batch(mdlmpe.config)
    with torch.no_grad():
        mdlmpe.embed.mdlmpe.gate_logit.fill_(-float("inf"))  # gamma = 0; W2 = b2 = 0 from init
        # fp32 reference/blocked score algebra vs one SDPA call: round-off only.
        torch.testing.assert_close(mdlmpe(ids, valid)[valid], rope(ids, valid)[valid], atol=2e-5, rtol=0)
        mdlmpe.embed.mdlmpe.gate_logit.fill_(0.0)  # and the guard: the embedding path does change them
        assert (mdlmpe(ids, valid) - rope(ids, valid)).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_training_steps_reach_delta_and_gamma(family):
    model, _ = _pair(family, "blocked")
    model.train()
    ids, valid = _batch(model.config)
    targets = torch.randint(
        0, model.config.vocab_size - 2, ids.shape, generator=torch.Generator().manual_seed(3)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(6):
        opt.zero_grad()
        logits = model(ids, valid)
        loss = F.cross_entropy(logits[valid], targets[valid])
        loss.backward()
        if step == 0:  # at init delta = 0 but its output layer and the gate already get a gradient
            for layer in model.layers:
                assert layer.attn.phase.fc2.weight.grad.abs().max() > 0
            assert model.embed.mdlmpe.gate_logit.grad.abs() > 0
            assert model.embed.mdlmpe.proj.weight.grad.abs().max() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    assert all(layer.attn.phase.fc2.weight.abs().max() > 0 for layer in model.layers)
    assert all(layer.attn.phase.fc1.weight.grad.abs().max() > 0 for layer in model.layers)


def _trained_attention(family, backend):
    model, _ = _pair(family, backend)
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.phase.fc2.weight.normal_(std=2.0)
            layer.attn.phase.fc2.bias.normal_(std=2.0)
            for proj in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj):
                proj.weight.normal_(std=0.5)  # O(1) scores and values, so a phase change is visible
    return model


def _layer_inputs(model):
    from mdlmpe_ds.models.block import LayerContext
    from mdlmpe_ds.pe.rope import rotary_angles

    ids, valid = _batch(model.config)
    x, features = model.embed(ids, valid)
    cos, sin = rotary_angles(ids.shape[1], model.config.head_dim, model.config.rope_theta)
    x = model.layers[0].attn_norm(x)  # what the block feeds its attention: unit RMS
    return x.detach(), LayerContext(cos=cos, sin=sin, key_valid=valid, features=features), valid


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_pairs_stay_rope(backend):
    """With q's MDLMPE (odd) pairs projected to zero, a trained phase cannot change the layer."""
    model = _trained_attention("dream", backend)
    attn = model.layers[0].attn
    x, ctx, valid = _layer_inputs(model)
    half = attn.head_dim // 2
    odd = torch.arange(1, half, 2)
    rows = torch.cat([odd, odd + half])  # both components of every odd pair
    with torch.no_grad():
        view = attn.q_proj.weight.view(attn.num_heads, attn.head_dim, -1)
        view[:, rows] = 0
        if attn.q_proj.bias is not None:
            attn.q_proj.bias.view(attn.num_heads, attn.head_dim)[:, rows] = 0
        with_phase = attn(x, ctx)
        attn.phase.fc2.weight.zero_()
        attn.phase.fc2.bias.zero_()
        without = attn(x, ctx)
    torch.testing.assert_close(with_phase[valid], without[valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inactive_heads_are_plain_rope(backend):
    model = _trained_attention("dream", backend)  # 4 query heads on 2 KV heads
    attn = model.layers[0].attn
    x, ctx, valid = _layer_inputs(model)
    with torch.no_grad():
        attn.o_proj.weight.copy_(torch.eye(attn.o_proj.weight.shape[0]))  # expose per-head outputs
        attn.set_active_kv_heads(torch.tensor([True, False]))
        masked = attn(x, ctx)
        attn.set_active_kv_heads(torch.tensor([True, True]))
        full = attn(x, ctx)
        attn.phase.fc2.weight.zero_()
        attn.phase.fc2.bias.zero_()
        rope = attn(x, ctx)
    d = attn.head_dim
    kv1 = slice(2 * d, 4 * d)  # query heads 2, 3 read KV head 1
    kv0 = slice(0, 2 * d)
    torch.testing.assert_close(masked[..., kv1][valid], rope[..., kv1][valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(masked[..., kv0], full[..., kv0], atol=1e-6, rtol=0)
    assert (masked[..., kv0] - rope[..., kv0]).abs().max() > 1e-3
    model.set_active_kv_heads(torch.tensor([False, True]))
    assert all(layer.attn.active_kv.tolist() == [False, True] for layer in model.layers)
    with pytest.raises(ValueError, match="active KV head mask must be bool"):
        model.set_active_kv_heads(torch.tensor([1, 0]))


@pytest.mark.parametrize(
    "family,encoding,backend",
    [
        ("llada", "mdlmpe", "blocked"),
        ("dream", "mdlmpe", "reference"),
        ("dream", "rope", "blocked"),
    ],
)
def test_gradient_checkpointing_gives_the_same_gradients(family, encoding, backend):
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        config = preset(f"{family}-tiny", position_encoding=encoding)
        impl = AttentionImpl(backend=backend, query_block=4)
        model = DiffusionLM(config, impl=impl, recompute=Recompute(layers=checkpointing)).train()
        with torch.no_grad():
            for layer in model.layers:
                if layer.attn.phase is not None:
                    layer.attn.phase.fc2.weight.normal_(std=1.0)
        ids, valid = _batch(config)
        loss = model(ids, valid).float().logsumexp(-1)[valid].mean()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("backend", "recompute", "runs_per_layer"),
    [
        ("blocked", False, 1),  # the attention keeps its own memory: not in the layer's recompute
        ("blocked", True, 2),  # asked to recompute it with the layer
        ("reference", False, 2),  # L x L pair tensor: always inside the layer checkpoint
    ],
)
def test_layer_checkpoint_leaves_self_managed_attention_out(monkeypatch, backend, recompute, runs_per_layer):
    """With layer checkpointing, backward re-runs the MDLMPE attention forward only where its memory
    is not already bounded (per-block recompute), and gradients equal the uncheckpointed ones."""
    import mdlmpe_ds.models.block as block

    calls = []
    attention = block.mdlmpe_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return attention(*args, **kwargs)

    monkeypatch.setattr(block, "mdlmpe_attention", counted)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        config = preset("dream-tiny", position_encoding="mdlmpe")
        impl = AttentionImpl(backend=backend, query_block=4)
        choice = Recompute(layers=checkpointing, mdlmpe_attention=recompute)
        model = DiffusionLM(config, impl=impl, recompute=choice).train()
        with torch.no_grad():
            for layer in model.layers:
                layer.attn.phase.fc2.weight.normal_(std=1.0)
        ids, valid = _batch(config)
        calls.clear()
        model(ids, valid).float().logsumexp(-1)[valid].mean().backward()
        expected = runs_per_layer if checkpointing else 1
        assert len(calls) == expected * config.num_layers, (checkpointing, len(calls))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)
