"""Evaluation commands that used to print numbers that meant nothing: each is now refused, before
any weights load, with a message that names what is at fault and what to do."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mdlmpe_ds.models import DiffusionLM, preset, save_pretrained

REPO = Path(__file__).resolve().parents[2]


def _launcher(name: str):
    spec = importlib.util.spec_from_file_location(f"launch_{name}_refusals", REPO / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _export(out: Path, alphabet: list[str]) -> Path:
    """A tiny export whose byte-level BPE tokenizer knows only ``alphabet`` (+ EOS and mask)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = preset(
        "llada-tiny", max_seq_len=32, mdlmpe={"max_seq_len": 32}, vocab_size=512, mask_token_id=511,
        eos_token_id=510, pad_token_id=510,
    )  # fmt: skip
    save_pretrained(DiffusionLM(config), out, config)
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"<|endoftext|>": 510, "<|mdm_mask|>": 511})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", mask_token="<|mdm_mask|>")
    fast.save_pretrained(str(out))
    return out


def test_layout_pairing_of_models_with_different_tokenizers_is_refused_before_loading(tmp_path, monkeypatch):
    """Before: pretrain-demo (151k-token Qwen tokenizer) and sft-demo (2,048-token SentencePiece)
    were 'paired' window by window, though their windows held different text, and a difference
    of +4.73 +- 0.04 was printed."""
    from tokenizers import pre_tokenizers

    from mdlmpe_ds.evaluation import loading

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    wide = _export(tmp_path / "wide", alphabet)
    narrow = _export(tmp_path / "narrow", alphabet[:200])

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the tokenizers were compared")

    monkeypatch.setattr(loading, "load_model", no_weights)
    cli = _launcher("evaluate")
    with pytest.raises(SystemExit) as exc:
        cli.main(
            [str(wide), str(narrow), "--corpora", "botchan", "--corruption", "iid", "semi_ar", "spans",
             "--out", str(tmp_path / "layouts")]
        )  # fmt: skip
    message = str(exc.value.code)
    assert "narrow's tokenizer (202 tokens) is not wide's (258 tokens)" in message, message
    assert "--corruption" in message
