"""A tiny model whose tokenizer has one token per byte, so that prompt lengths are known exactly:
the tool tests (generate, evaluate, analyze) use it to reach a model's max_seq_len on purpose."""

from __future__ import annotations

from pathlib import Path

import torch

from mdlmpe_ds.models import DiffusionLM, preset, save_pretrained

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def byte_tokenizer(path: str | Path, chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level tokenizer (256 byte tokens, no merges, no BOS) with EOS 510 and mask 511, saved
    as a Hugging Face directory at ``path``; ``chat_template``: a plain one, or None for none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<|endoftext|>": 510, "<|mdm_mask|>": 511})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", mask_token="<|mdm_mask|>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return fast


def byte_model_dir(
    out: str | Path, max_seq_len: int = 64, chat_template: str | None = CHAT_TEMPLATE, family: str = "llada"
) -> Path:
    """An export of a ``max_seq_len``-position ``family`` model (seeded init) with ``byte_tokenizer``."""
    out = Path(out)
    torch.manual_seed(0)
    config = preset(
        f"{family}-tiny", max_seq_len=max_seq_len, mdlmpe={"max_seq_len": max_seq_len}, vocab_size=512,
        mask_token_id=511, eos_token_id=510, pad_token_id=510,
    )  # fmt: skip
    save_pretrained(DiffusionLM(config), out, config)
    byte_tokenizer(out, chat_template)
    return out
