"""Two tiny exported checkpoints for the benchmark: a RoPE model and a copy with MDLMPE added (a phase
MLP and gate away from their identity initialisation) and its matrices perturbed, as after an SFT
pair that started from one checkpoint. A character-level tokenizer covers the local task copies' text.

    python tests/unit/benchmark_fixtures.py outputs/bench-tiny   # writes .../rope and .../mdlmpe
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

import torch

CHAT = ["<|startoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]  # LLaDA's chat tokens
SPECIALS = ["<|endoftext|>", "[UNK]", "<|im_start|>", "<|mask|>", "<|im_end|>", *CHAT]
CHARS = list(string.printable)  # 100 characters: the tasks' prompts, code and answers


def make_char_tokenizer(directory: Path) -> Path:
    """One token per character (a real ``tokenizers`` model saved as a HF fast tokenizer), plus
    LLaDA's chat tokens, so that ``--chat_template`` renders LLaDA's template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="[UNK]",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", *CHAT],
    )
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    config = directory / "tokenizer_config.json"  # a class transformers maps without asking about remote code
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    return directory


def _config(encoding: str):
    from mdlmpe_ds.models import preset

    return preset(
        "llada-tiny",
        position_encoding=encoding,
        vocab_size=128,
        mask_token_id=SPECIALS.index("<|mask|>"),
        eos_token_id=0,
        pad_token_id=0,
        max_seq_len=1024,
    )


def make_tiny_pair(root: Path) -> tuple[Path, Path]:
    """(rope export, mdlmpe export) under ``root``; the MDLMPE model holds the RoPE model's weights."""
    from mdlmpe_ds.hub.export import finish_export
    from mdlmpe_ds.models import DiffusionLM, save_pretrained

    tok = make_char_tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    rope = DiffusionLM(_config("rope")).eval()
    torch.manual_seed(1)
    mdlmpe = DiffusionLM(_config("mdlmpe")).eval()
    missing, unexpected = mdlmpe.load_state_dict(rope.state_dict(), strict=False)
    assert not unexpected and all("phase" in m or "mdlmpe" in m or "active_kv" in m for m in missing), missing
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # MDLMPE away from its identity setting (else it equals RoPE exactly) and
        for name, param in mdlmpe.named_parameters():  # the shared weights moved a little, as by SFT
            if "phase.fc2" in name or "gate_logit" in name:
                param.normal_(std=0.5, generator=gen)
            elif param.dim() == 2:
                param.add_(torch.randn(param.shape, generator=gen) * 0.3 * param.std())
    out = []
    for name, model in (("rope", rope), ("mdlmpe", mdlmpe)):
        save_pretrained(model, root / name, model.config)
        finish_export(root / name, "llada", tok)
        out.append(root / name)
    return out[0], out[1]


if __name__ == "__main__":
    a, b = make_tiny_pair(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/bench-tiny"))
    print(a, b)
