"""Numerical parity of the backbones with transformers' Llama (LLaDA family) and Qwen2 (Dream family).

Both HF models are run bidirectionally by passing a 4-D additive mask [B, 1, L, L] (0 = attend,
finfo(float32).min = padding key): in transformers 5.23 a 4-D mask is used as given
(``masking_utils._preprocess_mask_arguments`` returns early) and SDPA then runs with
``is_causal=False`` because a mask is present. Weights are copied under the name map (our
Dream names are exactly HF's Llama/Qwen2 names). fp32 on CPU; tolerance 1e-5 absolute on logits of
order 1 covers reduction-order differences between the two SDPA call sites.
"""

from __future__ import annotations

import pytest
import torch

from mdlmpe_ds.attention import AttentionImpl
from mdlmpe_ds.models import DiffusionLM, preset
from mdlmpe_ds.models.names import from_checkpoint_name, to_checkpoint_name

transformers = pytest.importorskip("transformers")

TOL = 1e-5


def _hf_model(config):
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_seq_len,
        tie_word_embeddings=config.tie_embeddings,
        hidden_act="silu",
        attn_implementation="sdpa",
    )
    if config.family == "llada":
        hf_config = transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
        model = transformers.LlamaForCausalLM(hf_config)
    else:
        hf_config = transformers.Qwen2Config(**common, use_sliding_window=False)
        model = transformers.Qwen2ForCausalLM(hf_config)
    return model.eval()


def _copy_into_hf(ours: DiffusionLM, hf) -> None:
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, param in ours.named_parameters():
            hf_params.pop(to_checkpoint_name(name, "dream")).copy_(param)
    assert not hf_params, f"HF parameters left unset: {sorted(hf_params)}"


def _bidirectional_mask(valid: torch.Tensor) -> torch.Tensor:
    batch, length = valid.shape
    mask = torch.zeros(batch, 1, length, length)
    return mask.masked_fill(~valid[:, None, None, :], torch.finfo(torch.float32).min)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_logits_match_transformers_bidirectional(family):
    torch.manual_seed(0)
    config = preset(f"{family}-tiny", vocab_size=96, mask_token_id=95, eos_token_id=94, pad_token_id=94)
    ours = DiffusionLM(config).eval()
    with torch.no_grad():  # non-trivial norm weights and biases so a swapped tensor shows
        for name, param in ours.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.uniform_(0.5, 1.5)
    hf = _hf_model(config)
    _copy_into_hf(ours, hf)
    ids = torch.randint(0, 96, (3, 11))
    valid = torch.ones(3, 11, dtype=torch.bool)
    valid[1, 8:] = False  # right padding
    valid[2, :3] = False  # left padding
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=_bidirectional_mask(valid), use_cache=False).logits
        raw = ours(ids, valid, raw=True)
        aligned = ours(ids, valid)
    torch.testing.assert_close(raw[valid], want[valid], atol=TOL, rtol=0)
    if family == "dream":  # aligned logit i is HF's logit i-1 (position 0 keeps its own)
        torch.testing.assert_close(aligned[:, 1:], raw[:, :-1], atol=0, rtol=0)
        torch.testing.assert_close(aligned[:, 0], raw[:, 0], atol=0, rtol=0)
        assert not torch.allclose(aligned, raw)
    else:
        torch.testing.assert_close(aligned, raw, atol=0, rtol=0)
    # Without padding and without a mask the two agree too (and HF's causal default would not).
    with torch.no_grad():
        full = hf(input_ids=ids, attention_mask=_bidirectional_mask(torch.ones_like(valid))).logits
        causal = hf(input_ids=ids).logits
        ours_full = ours(ids, raw=True)
    torch.testing.assert_close(ours_full, full, atol=TOL, rtol=0)
    assert (ours_full - causal).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("encoding", ["rope", "mdlmpe", "alibi"])
def test_real_positions_do_not_depend_on_trailing_padding(family, encoding):
    torch.manual_seed(1)
    config = preset(f"{family}-tiny", position_encoding=encoding)
    model = DiffusionLM(config, impl=AttentionImpl(backend="reference")).eval()
    if encoding == "mdlmpe":  # a non-trivial phase so the availability path matters
        with torch.no_grad():
            for layer in model.layers:
                layer.attn.phase.fc2.weight.normal_(std=1.0)
    ids = torch.randint(0, 500, (1, 9))
    ids[0, 3] = config.mask_token_id
    with torch.no_grad():
        alone = model(ids)
        for pad in (1, 6):
            padded = torch.cat([ids, torch.full((1, pad), config.pad_token_id)], dim=1)
            valid = torch.ones_like(padded, dtype=torch.bool)
            valid[0, 9:] = False
            out = model(padded, valid)
            torch.testing.assert_close(out[:, :9], alone, atol=2e-5, rtol=0)


def test_meta_parameter_counts_of_the_real_checkpoints():
    llada = DiffusionLM(preset("llada-8b"), device="meta")
    dream = DiffusionLM(preset("dream-7b"), device="meta")
    assert llada.num_backbone_parameters() == 8_015_581_184  # index total_size / 2 (docs/models.md §1.1)
    assert dream.num_backbone_parameters() == 7_615_616_512  # docs/models.md §1.2
    assert len(llada.state_dict()) == 291  # 32 x 9 + 3 tensors
    mdlmpe = DiffusionLM(preset("llada-8b", position_encoding="mdlmpe"), device="meta")
    assert mdlmpe.num_backbone_parameters() == 8_015_581_184
    # W_p [4096, 64] + b_p + g, and per layer fc1 [32, 64] + 32, fc2 [32, 32] + 32.
    assert mdlmpe.num_mdlmpe_parameters() == 64 * 4096 + 4096 + 1 + 32 * (32 * 64 + 32 + 32 * 32 + 32)
    assert set(mdlmpe.mdlmpe_parameter_names()) == {
        n for n, _ in mdlmpe.named_parameters() if "mdlmpe" in n or "phase" in n
    }


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_checkpoint_names_are_upstream_and_invertible(family):
    model = DiffusionLM(
        preset(f"{family}-8b" if family == "llada" else "dream-7b", position_encoding="mdlmpe"), device="meta"
    )
    keys = [to_checkpoint_name(n, family) for n, _ in model.named_parameters()]
    assert len(set(keys)) == len(keys)
    for name, key in zip([n for n, _ in model.named_parameters()], keys):
        assert from_checkpoint_name(key, family) == name
    if family == "llada":
        assert "model.transformer.blocks.3.ff_proj.weight" in keys  # the gate
        assert "model.transformer.blocks.3.attn_out.weight" in keys
        assert "model.transformer.ff_out.weight" in keys
        assert "model.transformer.blocks.0.mdlmpe_phase.fc2.bias" in keys
    else:
        assert "model.layers.27.self_attn.k_proj.bias" in keys
        assert "lm_head.weight" in keys
        assert "model.layers.0.self_attn.mdlmpe_phase.fc1.weight" in keys
        assert "model.mdlmpe.gate_logit" in keys
    dict_shapes = {to_checkpoint_name(n, family): tuple(p.shape) for n, p in model.named_parameters()}
    if family == "llada":
        assert dict_shapes["model.transformer.blocks.0.ff_proj.weight"] == (12288, 4096)
        assert dict_shapes["model.transformer.wte.weight"] == (126464, 4096)
    else:
        assert dict_shapes["model.layers.0.self_attn.k_proj.weight"] == (512, 3584)
        assert dict_shapes["lm_head.weight"] == (152064, 3584)


def test_dream_embedding_keeps_padding_row_without_gradient():
    config = preset("dream-tiny")
    model = DiffusionLM(config)
    assert model.embed.tokens.padding_idx == config.pad_token_id
    assert DiffusionLM(preset("llada-tiny")).embed.tokens.padding_idx is None
    ids = torch.tensor([[1, config.pad_token_id, 3]])
    model(ids).sum().backward()
    assert model.embed.tokens.weight.grad[config.pad_token_id].abs().max() == 0
    assert model.embed.tokens.weight.grad[1].abs().max() > 0


def test_llada_roles_map_to_upstream_names():
    # ff_proj is the GATE (SiLU branch), up_proj the linear branch, ff_out the down projection
    # (docs/models.md §2.1); swapping them would load a checkpoint "fine" and silently break logits.
    expect = {
        "layers.3.mlp.gate_proj.weight": "model.transformer.blocks.3.ff_proj.weight",
        "layers.3.mlp.up_proj.weight": "model.transformer.blocks.3.up_proj.weight",
        "layers.3.mlp.down_proj.weight": "model.transformer.blocks.3.ff_out.weight",
        "layers.3.attn.o_proj.weight": "model.transformer.blocks.3.attn_out.weight",
        "layers.3.attn_norm.weight": "model.transformer.blocks.3.attn_norm.weight",
        "layers.3.mlp_norm.weight": "model.transformer.blocks.3.ff_norm.weight",
        "norm.weight": "model.transformer.ln_f.weight",
        "lm_head.weight": "model.transformer.ff_out.weight",
        "embed.tokens.weight": "model.transformer.wte.weight",
    }
    for ours, theirs in expect.items():
        assert to_checkpoint_name(ours, "llada") == theirs


@pytest.mark.parametrize("family,fp32", [("llada", True), ("dream", False)])
def test_rotary_precision_follows_the_family(family, fp32, monkeypatch):
    """LLaDA rotates q, k in fp32 (rope_full_precision); Dream multiplies in the activation dtype."""
    import mdlmpe_ds.models.block as block

    seen = []
    real = block.apply_rotary

    def recording(x, cos, sin, fp32=True):
        seen.append(fp32)
        return real(x, cos, sin, fp32)

    monkeypatch.setattr(block, "apply_rotary", recording)
    model = DiffusionLM(preset(f"{family}-tiny")).to(torch.bfloat16)
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.dtype == torch.bfloat16
    assert seen and all(flag is fp32 for flag in seen)


def test_dream_bf16_matches_transformers_qwen2_bf16():
    """Same mixed-precision points as HF Qwen2 (fp32 norm, cos/sin cast to bf16): our bf16 logits are
    as close to HF's bf16 logits as bf16 noise allows, measured as HF-bf16's own distance from fp32
    (the SDPA kernels differ: HF gets a zero mask, we get none)."""
    torch.manual_seed(0)
    config = preset("dream-tiny", vocab_size=96, mask_token_id=95, eos_token_id=94, pad_token_id=94)
    ours = DiffusionLM(config).eval()
    hf = _hf_model(config)
    _copy_into_hf(ours, hf)
    ids = torch.randint(0, 96, (2, 9))
    mask = _bidirectional_mask(torch.ones_like(ids, dtype=torch.bool))
    with torch.no_grad():
        exact = hf(input_ids=ids, attention_mask=mask).logits
        ours, hf = ours.to(torch.bfloat16), hf.to(torch.bfloat16)
        want = hf(input_ids=ids, attention_mask=mask.to(torch.bfloat16)).logits.float()
        got = ours(ids, raw=True).float()
    noise = (want - exact).abs().max().item()
    assert noise > 0
    assert (got - want).abs().max().item() <= 2 * noise
    assert (got - exact).abs().max().item() <= 2 * noise
