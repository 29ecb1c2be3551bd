"""Small SentencePiece BPE tokenizers for from-scratch runs: trained on a local corpus with
pad/bos/eos/unk/mask reserved at fixed low ids, and saved as a Hugging Face directory whose
``tokenizer.json`` encodes exactly as the SentencePiece model does (``sentencepiece_bpe_to_tokenizer``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, normalizers
from tokenizers.models import BPE

# Reserved ids of the scratch-run SentencePiece tokenizers (mask first after the control tokens so it
# survives any vocab size).
SPM_PAD, SPM_BOS, SPM_EOS, SPM_UNK, SPM_MASK = 0, 1, 2, 3, 4
SPM_SPECIALS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>", "mask": "<|mask|>"}


def train_sentencepiece(
    text_files: Sequence[str | os.PathLike],
    vocab_size: int,
    out_dir: str | os.PathLike,
    model_type: str = "bpe",
    *,
    byte_fallback: bool = True,
    max_sentence_length: int = 1 << 16,
):
    """Train a SentencePiece tokenizer on ``text_files`` and save it as a Hugging Face directory.

    Reserved ids: ``<pad>`` 0, ``<s>`` 1, ``<\\s>`` 2, ``<unk>`` 3, ``<|mask|>`` 4. The text is
    not normalised and whitespace is kept (``identity`` rule, no whitespace collapsing) so decoding
    gives back the input; ``byte_fallback`` encodes unseen characters as UTF-8 byte pieces (needs
    ``vocab_size`` > 261). Training is single-threaded over every line of the files, hence
    deterministic. ``out_dir`` gets ``tokenizer.model`` (the SentencePiece model) and
    ``tokenizer.json`` + ``tokenizer_config.json`` (a ``PreTrainedTokenizerFast``), which
    ``AutoTokenizer.from_pretrained(out_dir)`` loads. BPE only for the HF conversion.

    Returns the loaded ``PreTrainedTokenizerFast``.
    """
    import sentencepiece as spm
    from transformers import PreTrainedTokenizerFast

    if model_type != "bpe":
        raise ValueError(f"model_type={model_type!r}: only 'bpe' is converted to a HF tokenizer")
    files = [str(Path(f)) for f in text_files]
    for f in files:
        if not Path(f).is_file():
            raise FileNotFoundError(f"sentencepiece training file {f} does not exist")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            input=files,
            model_prefix=str(out / "tokenizer"),
            vocab_size=vocab_size,
            model_type=model_type,
            pad_id=SPM_PAD,
            bos_id=SPM_BOS,
            eos_id=SPM_EOS,
            unk_id=SPM_UNK,
            pad_piece=SPM_SPECIALS["pad"],
            bos_piece=SPM_SPECIALS["bos"],
            eos_piece=SPM_SPECIALS["eos"],
            unk_piece=SPM_SPECIALS["unk"],
            user_defined_symbols=[SPM_SPECIALS["mask"]],
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            byte_fallback=byte_fallback,
            character_coverage=1.0 if not byte_fallback else 0.9995,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=1,
            max_sentence_length=max_sentence_length,
            minloglevel=2,
        )
    except RuntimeError as err:
        needed = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", str(err))
        if needed is None:
            raise
        raise ValueError(
            f"a SentencePiece vocabulary of {vocab_size} pieces is too small for {', '.join(files)}: "
            f"its characters and reserved pieces alone need {needed.group(2)}; raise the vocabulary "
            "size (data.tokenizer_vocab, --tokenizer_vocab)"
        ) from err
    (out / "tokenizer.vocab").unlink()
    proc = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    tok = sentencepiece_bpe_to_tokenizer(proc)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPM_SPECIALS["pad"],
        bos_token=SPM_SPECIALS["bos"],
        eos_token=SPM_SPECIALS["eos"],
        unk_token=SPM_SPECIALS["unk"],
        mask_token=SPM_SPECIALS["mask"],
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out))
    return fast


def sentencepiece_bpe_to_tokenizer(proc) -> Tokenizer:
    """A ``tokenizers`` BPE that encodes exactly like the SentencePiece BPE model ``proc``.

    SentencePiece BPE merges, at each step, the adjacent pair whose concatenation is the
    highest-scoring piece. The equivalent HF merge list holds *every* split (l, r) of each piece p with
    l, r in the vocabulary, ordered by p's score, so the lowest-priority applicable merge is the same
    choice. Control/unknown/user-defined/byte pieces take no part in merges.
    """
    n = proc.get_piece_size()
    vocab = {proc.id_to_piece(i): i for i in range(n)}
    special = {i for i in range(n) if proc.is_control(i) or proc.is_unknown(i) or proc.is_byte(i)}
    user = {i for i in range(n) if proc.id_to_piece(i) in SPM_SPECIALS.values() and i not in special}
    mergeable = {proc.id_to_piece(i): i for i in range(n) if i not in special and i not in user}
    ranked = sorted(mergeable, key=lambda p: (-proc.get_score(mergeable[p]), mergeable[p]))
    merges = []
    for piece in ranked:
        splits = [
            (piece[:k], piece[k:])
            for k in range(1, len(piece))
            if piece[:k] in mergeable and piece[k:] in mergeable
        ]
        merges.extend(sorted(splits, key=lambda lr: (mergeable[lr[0]], mergeable[lr[1]])))
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            unk_token=SPM_SPECIALS["unk"],
            fuse_unk=True,
            byte_fallback=any(proc.is_byte(i) for i in range(n)),
            dropout=None,
        )
    )
    # SentencePiece's dummy prefix and space symbol. HF normalises each stretch of text between added
    # tokens separately, so text around a literal "<|mask|>" differs from SentencePiece (masks are
    # placed by id, never typed, so this does not matter here).
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = [proc.id_to_piece(i) for i in sorted(special | user) if not proc.is_byte(i)]
    tok.add_special_tokens([AddedToken(p, normalized=False, special=True) for p in specials])
    return tok
