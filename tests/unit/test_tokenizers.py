"""Tokenizer pins: the real Qwen2.5/Dream tokenizer and sentencepiece tokenizers for scratch runs."""

import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def qwen(qwen_tokenizer_dir):
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


def test_qwen25_fresh_build_equals_cache(qwen_tokenizer_dir, tmp_path):
    """Rebuild from the cached, verified qwen.tiktoken: the code (not only the cache) gives these files."""
    import zipfile

    from mdlmpe_ds.data import assets as A
    from mdlmpe_ds.data.tokenizers import build_qwen25_tokenizer

    wheel = qwen_tokenizer_dir.parent / "downloads" / A.ARCHIVES["dashscope"].filename
    (tmp_path / "qwen.tiktoken").write_bytes(zipfile.ZipFile(wheel).read("dashscope/resources/qwen.tiktoken"))
    fresh = build_qwen25_tokenizer(tmp_path / "qwen.tiktoken", tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (fresh / name).read_bytes() == (qwen_tokenizer_dir / name).read_bytes(), name


def test_qwen25_ids_are_pinned(qwen):
    assert qwen("Hello world")["input_ids"] == [9707, 1879]
    assert qwen("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]
    ids = qwen.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"]
    )
    assert ids == [151643, 151644, 151645, 151665, 151666]
    assert (qwen.eos_token_id, qwen.pad_token_id, qwen.mask_token_id) == (151643, 151643, 151666)
    assert len(qwen) == 151667


def test_qwen25_roundtrip_and_specials(qwen):
    text = "naïve café — 数学 123456 \n\n  def f(x):\n\treturn x**2  "
    ids = qwen(text)["input_ids"]
    assert qwen.decode(ids) == text
    assert all(i < 151643 for i in ids)  # plain text never yields an added token
    # Qwen2 splits digits one by one.
    assert len(qwen("123456")["input_ids"]) == 6
    specials = qwen("<|im_start|>user\nhi<|im_end|><|mask|><|mask|>")["input_ids"]
    assert specials[0] == 151644 and specials[-3:] == [151645, 151666, 151666]


def test_qwen25_chat_template_is_chatml_with_default_system(qwen):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    text = qwen.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    prompt = qwen.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    custom = qwen.apply_chat_template([{"role": "system", "content": "Be brief."}, *msgs[:1]], tokenize=False)
    assert custom.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")


@pytest.fixture(scope="module")
def botchan_spm(assets, tmp_path_factory):
    from mdlmpe_ds.data.spm_tokenizer import train_sentencepiece

    text = assets("botchan").botchan
    out = tmp_path_factory.mktemp("spm")
    train_sentencepiece([text], 2000, out)
    return text, out


def test_sentencepiece_tokenizer_loads_and_matches_sentencepiece(botchan_spm):
    import sentencepiece as spm

    text, out = botchan_spm
    hf = AutoTokenizer.from_pretrained(out)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert len(hf) == sp.get_piece_size() == 2000
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id, hf.mask_token_id) == (
        0,
        1,
        2,
        3,
        4,
    )
    assert hf.convert_ids_to_tokens([0, 1, 2, 3, 4]) == ["<pad>", "<s>", "</s>", "<unk>", "<|mask|>"]
    lines = [line for line in text.read_text(encoding="utf-8").splitlines() if line.strip()][::7]
    lines += ["  two  leading spaces", "naïve café 数学 🙂 unseen", "tab\tand trailing "]
    for line in lines:
        ids = hf(line, add_special_tokens=False)["input_ids"]
        assert ids == sp.encode(line), line
        assert hf.decode(ids) == line  # identity normalisation: text round-trips
    assert 4 not in hf(text.read_text(encoding="utf-8")[:5000], add_special_tokens=False)["input_ids"]


def test_sentencepiece_training_is_deterministic(botchan_spm, tmp_path):
    import sentencepiece as spm

    from mdlmpe_ds.data.spm_tokenizer import train_sentencepiece

    text, out = botchan_spm
    train_sentencepiece([text], 2000, tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    # tokenizer.model records its own path in trainer_spec, so compare its pieces and scores.
    a, b = (spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model")) for d in (tmp_path, out))
    assert [(a.id_to_piece(i), a.get_score(i)) for i in range(len(a))] == [
        (b.id_to_piece(i), b.get_score(i)) for i in range(len(b))
    ]


def test_gpt2_ids_are_pinned(assets):
    gpt2 = AutoTokenizer.from_pretrained(assets("gpt2_tokenizer").gpt2_tokenizer_dir)
    assert gpt2("Hello world")["input_ids"] == [15496, 995]
    assert gpt2.convert_tokens_to_ids("<|endoftext|>") == gpt2.eos_token_id == 50256
    assert gpt2("It's")["input_ids"] == [1026, 338]
    text = "Don't   stop 123456 naïve\n\n"
    assert gpt2.decode(gpt2(text)["input_ids"]) == text


@pytest.mark.parametrize(("vocab", "part"), [("qwen2", "qwen_tokenizer"), ("gpt-2", "gpt2_tokenizer")])
def test_matches_llama_cpp_reference_tokenizations(assets, vocab, part):
    """llama.cpp's 47 HF-generated reference tokenizations per vocabulary (unicode, whitespace runs,
    digits, code, emoji); the tokenizers built here must reproduce every one."""
    paths = assets(part, "tokenizer_oracle")
    tok_dir = paths.qwen_tokenizer_dir if part == "qwen_tokenizer" else paths.gpt2_tokenizer_dir
    tok = AutoTokenizer.from_pretrained(tok_dir)
    inp, out = paths.tokenizer_oracle(vocab)
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    expected = out.read_text(encoding="utf-8").split("\n")[: len(texts)]
    assert len(texts) == 46
    for text, ids in zip(texts, expected):
        assert tok(text, add_special_tokens=False)["input_ids"] == [int(i) for i in ids.split()], repr(text)


def test_sentencepiece_vocabulary_too_small_for_the_corpus_names_the_key(tmp_path):
    """Config validation accepts tokenizer_vocab >= 300, but a corpus with more distinct characters
    needs more pieces: the error says how many, names the file and the key to raise."""
    from mdlmpe_ds.data.spm_tokenizer import train_sentencepiece

    text = tmp_path / "many_chars.txt"
    chars = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 400))  # 400 distinct CJK characters
    text.write_text("\n".join(chars[i : i + 40] * 3 for i in range(0, 400, 40)) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"too small for .*many_chars\.txt.*need \d+.*tokenizer_vocab"):
        train_sentencepiece([text], 300, tmp_path / "spm")
