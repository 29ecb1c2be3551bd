"""Checkpoint directories: config.json of both families, (sharded) safetensors, strict errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mdlmpe_ds.attention import AttentionImpl
from mdlmpe_ds.models import DiffusionLM, preset
from mdlmpe_ds.models.hf_config import CheckpointError, config_from_hf_dict, read_hf_config
from mdlmpe_ds.models.hf_io import INDEX_NAME, load_pretrained, load_weights_into, save_pretrained

# GSAI-ML/LLaDA-8B-Instruct config.json values (docs/models.md §1.1), as the file spells them.
LLADA_8B_CONFIG = {
    "model_type": "llada",
    "architectures": ["LLaDAModelLM"],
    "d_model": 4096,
    "n_layers": 32,
    "n_heads": 32,
    "n_kv_heads": 32,
    "mlp_hidden_size": 12288,
    "mlp_ratio": 4,
    "activation_type": "silu",
    "block_type": "llama",
    "vocab_size": 126464,
    "embedding_size": 126464,
    "weight_tying": False,
    "layer_norm_type": "rms",
    "rms_norm_eps": 1e-05,
    "layer_norm_with_affine": True,
    "bias_for_layer_norm": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "rope": True,
    "rope_theta": 500000.0,
    "rope_full_precision": True,
    "alibi": False,
    "max_sequence_length": 4096,
    "attention_layer_norm": False,
    "input_emb_norm": False,
    "scale_logits": False,
    "flash_attention": False,
    "mask_token_id": 126336,
    "eos_token_id": 126081,
    "pad_token_id": 126081,
    "block_group_size": 1,
    "init_device": "meta",
    "init_fn": "mitchell",
    "init_std": 0.02,
    "precision": "amp_bf16",
}
# Dream-org/Dream-v0-Instruct-7B config.json values (docs/models.md §1.2).
DREAM_7B_CONFIG = {
    "model_type": "Dream",
    "architectures": ["DreamModel"],
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "mask_token_id": 151666,
    "pad_token_id": 151643,
    "eos_token_id": 151643,
    "max_position_embeddings": 131072,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
}


def test_real_configs_read_as_the_presets():
    assert config_from_hf_dict(LLADA_8B_CONFIG) == preset("llada-8b")
    assert config_from_hf_dict(DREAM_7B_CONFIG) == preset("dream-7b")
    with pytest.raises(CheckpointError, match="include_bias=True is not supported"):
        config_from_hf_dict({**LLADA_8B_CONFIG, "include_bias": True})
    with pytest.raises(CheckpointError, match="describes a dream model"):
        config_from_hf_dict(DREAM_7B_CONFIG, family="llada")
    with pytest.raises(CheckpointError, match="cannot tell the model family"):
        config_from_hf_dict({"model_type": "gpt2", "n_embd": 8})


def _tiny(family, encoding="rope", **kw):
    torch.manual_seed(0)
    config = preset(f"{family}-tiny", position_encoding=encoding, **kw)
    model = DiffusionLM(config, impl=AttentionImpl(backend="reference")).eval()
    with torch.no_grad():  # a trained-looking model: non-zero phase output and non-init norms
        for name, param in model.named_parameters():
            if "phase.fc2" in name or name.endswith("norm.weight"):
                param.normal_(std=0.5)
    return model


IDS = torch.tensor([[5, 511, 7, 9, 511, 2], [4, 3, 511, 8, 510, 510]])
VALID = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("encoding", ["rope", "mdlmpe", "absolute"])
@pytest.mark.parametrize("sharded", [False, True])
def test_save_reload_is_exact(tmp_path, family, encoding, sharded):
    model = _tiny(family, encoding)
    files = save_pretrained(model, tmp_path, model.config, max_shard_bytes=40_000 if sharded else 1 << 30)
    assert (tmp_path / INDEX_NAME).exists() == sharded
    assert sum(f.suffix == ".safetensors" for f in files) > (3 if sharded else 0)
    reloaded = load_pretrained(tmp_path, impl=model.impl)  # how attention runs is not saved
    assert reloaded.config == model.config
    for (name, a), (name_b, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert name == name_b
        assert torch.equal(a, b), name
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS, VALID), model(IDS, VALID), atol=0, rtol=0)
    # Save again from the reloaded model: byte-identical tensors under the same names.
    again = tmp_path / "again"
    save_pretrained(
        reloaded.state_dict(), again, reloaded.config, max_shard_bytes=40_000 if sharded else 1 << 30
    )
    first = _all_tensors(tmp_path)
    second = _all_tensors(again)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def _all_tensors(path):
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_written_names_are_upstream(tmp_path):
    model = _tiny("llada", "mdlmpe")
    save_pretrained(model, tmp_path, model.config)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as fh:
        keys = set(fh.keys())
    assert "model.transformer.blocks.1.ff_proj.weight" in keys
    assert "model.transformer.ff_out.weight" in keys
    assert "model.transformer.mdlmpe.proj.weight" in keys
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["d_model"] == 64 and raw["mdlmpe_ds"]["position_encoding"] == "mdlmpe"
    tied = DiffusionLM(preset("dream-tiny", tie_embeddings=True))
    save_pretrained(tied, tmp_path / "tied", tied.config)
    with safe_open(tmp_path / "tied" / "model.safetensors", framework="pt") as fh:
        assert "lm_head.weight" not in set(fh.keys())
    reloaded = load_pretrained(tmp_path / "tied")
    assert reloaded.lm_head.weight is reloaded.embed.tokens.weight
    assert torch.equal(reloaded.lm_head.weight, tied.embed.tokens.weight)


def test_rope_checkpoint_into_mdlmpe_model_initialises_mdlmpe_per_spec(tmp_path):
    rope = _tiny("dream", "rope")
    save_pretrained(rope, tmp_path, rope.config)
    model = load_pretrained(tmp_path, position_encoding="mdlmpe", impl=AttentionImpl(backend="reference"))
    for layer in model.layers:
        assert layer.attn.phase.fc2.weight.abs().max() == 0 and layer.attn.phase.fc2.bias.abs().max() == 0
    assert model.embed.mdlmpe.proj.bias.abs().max() == 0
    assert float(model.embed.mdlmpe.gamma.detach()) == pytest.approx(0.01, rel=1e-5)
    # With the phase at its identity and gamma forced to 0 it is the RoPE model (docs/method.md
    # "Initialisation").
    with torch.no_grad():
        model.embed.mdlmpe.gate_logit.fill_(-float("inf"))
        torch.testing.assert_close(model(IDS, VALID), rope(IDS, VALID), atol=1e-6, rtol=0)


def _saved(tmp_path, family="llada", shards=True):
    model = _tiny(family)
    save_pretrained(model, tmp_path, model.config, max_shard_bytes=40_000 if shards else 1 << 30)
    return model


def test_missing_shard_is_named(tmp_path):
    _saved(tmp_path)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(
        CheckpointError, match=f"shard files listed in the index are missing: .*{victim.name}"
    ):
        load_pretrained(tmp_path)


def test_renamed_key_is_listed_as_missing_and_unexpected(tmp_path):
    _saved(tmp_path, shards=False)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.transformer.blocks.1.gate_proj.weight"] = tensors.pop(
        "model.transformer.blocks.1.ff_proj.weight"
    )
    save_file(tensors, file)
    with pytest.raises(CheckpointError) as err:
        load_pretrained(tmp_path)
    message = str(err.value)
    assert "missing keys (1): ['model.transformer.blocks.1.ff_proj.weight']" in message
    assert "unexpected keys (1)" in message and "model.transformer.blocks.1.gate_proj.weight" in message


def test_wrong_shape_is_named(tmp_path):
    _saved(tmp_path, family="dream", shards=False)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(64)
    save_file(tensors, file)
    with pytest.raises(
        CheckpointError,
        match=r"wrong shape for model.layers.0.self_attn.k_proj.bias .*\(64,\), model \(32,\)",
    ):
        load_pretrained(tmp_path)


def test_config_of_the_other_family_is_reported(tmp_path):
    llada = _saved(tmp_path, family="llada", shards=False)
    dream_config = preset("dream-tiny", num_kv_heads=4)
    raw = json.loads((tmp_path / "config.json").read_text())
    from mdlmpe_ds.models.hf_config import hf_config_dict

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(dream_config)))
    with pytest.raises(CheckpointError, match=r"these are llada names: is config\.json of the right family"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="describes a llada model"):
        load_pretrained(tmp_path, family="dream")
    assert read_hf_config(tmp_path) == llada.config


def test_nothing_is_copied_when_the_check_fails(tmp_path):
    _saved(tmp_path, shards=False)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.transformer.ln_f.weight"]
    save_file(tensors, file)
    target = DiffusionLM(preset("llada-tiny"))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): \['model.transformer.ln_f.weight'\]"):
        load_weights_into(target, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_single_file_without_index_and_gather_factory_is_used(tmp_path):
    model = _saved(tmp_path, shards=False)
    shutil.rmtree(tmp_path / "unused", ignore_errors=True)
    target = DiffusionLM(preset("llada-tiny"))
    entered = []

    class Recorder:
        def __init__(self, params, modifier_rank=None):
            entered.append((len(params), modifier_rank))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    load_weights_into(target, tmp_path, gathered=Recorder)
    assert len(entered) == len(list(target.parameters())) and all(e == (1, 0) for e in entered)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))


def test_absent_mdlmpe_keys_overwrite_a_trained_phase_with_spec_values(tmp_path):
    rope = _tiny("llada", "rope")
    save_pretrained(rope, tmp_path, rope.config)
    model = _tiny("llada", "mdlmpe")  # phase fc2 and gate perturbed ("trained")
    with torch.no_grad():
        model.embed.mdlmpe.gate_logit.fill_(3.0)
    absent = load_weights_into(model, tmp_path)
    assert set(absent) == set(model.mdlmpe_parameter_names())
    assert all(layer.attn.phase.fc2.weight.abs().max() == 0 for layer in model.layers)
    assert float(model.embed.mdlmpe.gamma.detach()) == pytest.approx(0.01, rel=1e-5)


def test_model_config_round_trips_and_rejects_bad_values():
    from mdlmpe_ds.models import PRESETS, ModelConfig

    for name in PRESETS:
        config = preset(name, position_encoding="mdlmpe")
        assert ModelConfig.from_dict(config.to_dict()) == config
        assert config.mdlmpe.max_seq_len == config.max_seq_len
    assert preset("llada-tiny", max_seq_len=64).mdlmpe.max_seq_len == 64
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("llada-9b")
    with pytest.raises(ValueError, match=r"preset 'llada-tiny' overrides: unknown keys \['n_layers'\]"):
        preset("llada-tiny", n_layers=3)
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        preset("dream-tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match=r"mdlmpe\.max_seq_len=128 != max_seq_len=256"):
        preset("llada-tiny", mdlmpe={"max_seq_len": 128})
    with pytest.raises(ValueError, match="mask_token_id"):
        preset("llada-tiny", mask_token_id=512)


def test_older_export_with_attention_keys_still_loads(tmp_path):
    """An export written when config.json's MDLMPE block still held the attention implementation
    (backend, block_size, compile, ...) loads as the same model; the keys are not written any more."""
    model = _tiny("llada", "mdlmpe")
    save_pretrained(model, tmp_path, model.config)
    config_file = tmp_path / "config.json"
    raw = json.loads(config_file.read_text())
    assert "backend" not in raw["mdlmpe_ds"]["mdlmpe"] and "block_size" not in raw["mdlmpe_ds"]["mdlmpe"]
    old = {
        "backend": "reference",
        "block_size": 4,
        "triton_tile": None,
        "compile": False,
        "checkpoint_blocks": True,
    }
    raw["mdlmpe_ds"]["mdlmpe"].update(old)
    config_file.write_text(json.dumps(raw))
    reloaded = load_pretrained(tmp_path, impl=model.impl)
    assert reloaded.config == model.config
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS, VALID), model(IDS, VALID), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"'compile' is not a model key any more.*attention\.compile"):
        load_pretrained(tmp_path, mdlmpe={"compile": True})  # a new override is refused, not dropped


def test_some_mdlmpe_keys_missing_or_an_integer_tensor_is_refused(tmp_path):
    """An MDLMPE export with some of its MDLMPE weights deleted loaded silently, those reset to their
    initial values (transformers reports them MISSING); an int8 tensor for a float weight was cast.
    A RoPE checkpoint (no MDLMPE weights at all) still starts them from their initial values."""
    model = _tiny("llada", "mdlmpe")
    save_pretrained(model, tmp_path, model.config, max_shard_bytes=1 << 30)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    dropped = sorted(k for k in tensors if "mdlmpe" in k or "phase" in k)[:2]
    assert dropped
    save_file({k: v for k, v in tensors.items() if k not in dropped}, file)
    with pytest.raises(CheckpointError, match=r"missing MDLMPE keys \(2\) while the others are there"):
        load_pretrained(tmp_path, impl=AttentionImpl(backend="reference"))
    name = next(k for k in tensors if k.endswith("o_proj.weight") or k.endswith("attn_out.weight"))
    save_file({**tensors, name: tensors[name].to(torch.int8)}, file)
    with pytest.raises(
        CheckpointError, match=rf"{name} in model.safetensors is stored as I8, not a float type"
    ):
        load_pretrained(tmp_path, impl=AttentionImpl(backend="reference"))


def test_a_stale_index_is_named_not_the_shard(tmp_path):
    """An index mapping a tensor to a shard that does not hold it blamed the shard ("cannot read this
    safetensors file ... probably truncated or corrupt"); the shard is fine, the index is stale."""
    _saved(tmp_path)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    key = next(k for k, v in index["weight_map"].items() if v == shards[0])
    index["weight_map"][key] = shards[1]
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=rf"maps 1 keys to {shards[1]}, which does not hold them"
    ) as err:
        load_pretrained(tmp_path)
    assert "truncated" not in str(err.value) and key in str(err.value)
