"""SFT data: chat templates, tokenisation boundaries, truncation, malformed rows, collation.

Tokenizers are tiny byte-level BPEs trained here in well under a second, carrying the LLaDA or
ChatML special tokens; byte-level decoding is exact, so decoded halves can be compared as strings.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mdlmpe_ds.data.chat_templates import render_chatml, render_llada, template_for
from mdlmpe_ds.data.sft_collate import SFTCollator
from mdlmpe_ds.data.sft_encode import SFTExample, build_sft_dataset, eos_pad_id
from mdlmpe_ds.data.sft_rows import SFTDataError
from mdlmpe_ds.data.tokenizers import QWEN25_CHAT_TEMPLATE

CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "Write a haiku about rain. Soft rain on the roof, the garden drinks slowly.",
    "Hello there, how are you today? I am fine, thank you for asking!",
    "Explain photosynthesis in one sentence. Plants turn light, water and air into sugar.",
] * 4

LLADA_SPECIALS = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]


def _tokenizer(path, specials, bos=None, chat_template=None):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=bos
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def llada_tok(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("llada_tok"), LLADA_SPECIALS, bos="<|startoftext|>")


@pytest.fixture(scope="module")
def chatml_tok(tmp_path_factory):
    return _tokenizer(
        tmp_path_factory.mktemp("chatml_tok"), CHATML_SPECIALS, chat_template=QWEN25_CHAT_TEMPLATE
    )


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("plain_tok"), ["<|endoftext|>"])


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


CONV = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": " The capital of France is Paris. "},
]
MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "I am fine"},
    {"role": "user", "content": "Write a haiku about rain."},
    {"role": "assistant", "content": "Soft rain on the roof"},
]


# ---------------------------------------------------------------------------------------------- templates


def test_llada_template_exact_string():
    assert render_llada(CONV[:1], add_generation_prompt=True) == (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render_llada(CONV) == (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nThe capital of France is Paris.<|eot_id|>"
    )


def test_chatml_template_exact_string():
    assert render_chatml(CONV[:1], add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chatml([{"role": "system", "content": "Be brief."}, *CONV]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n The capital of France is Paris. <|im_end|>\n"
    )


def test_template_for_choice(llada_tok, chatml_tok, plain_tok, caplog):
    assert template_for("llada", llada_tok).name == "llada"
    assert template_for("dream", chatml_tok).name == "chatml"
    # A LLaDA-family model with a ChatML tokenizer (the embedded demo): the tokenizer's own template.
    with caplog.at_level(logging.INFO, logger="mdlmpe_ds.data.chat_templates"):
        chosen = template_for("llada", chatml_tok)
    assert chosen.name == "tokenizer"
    assert "tokenizer's own" in caplog.text
    assert chosen.render(MULTI, False) == render_chatml(MULTI, False)
    assert chosen.render(CONV[:1], True) == render_chatml(CONV[:1], True)
    with pytest.raises(ValueError, match="lacks the family's special tokens"):
        template_for("dream", plain_tok)
    with pytest.raises(ValueError, match="unknown model family"):
        template_for("gpt", llada_tok)


# ---------------------------------------------------------------------------------------------- tokenisation


def test_llada_boundaries(tmp_path, llada_tok):
    src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONV, "id": "x"}])
    ds, stats = build_sft_dataset(src, llada_tok, "llada", max_len=512)
    assert (stats.rows, stats.examples, stats.truncated, stats.dropped, stats.skipped) == (1, 1, 0, 0, 0)
    ex = ds[0]
    assert _decode(llada_tok, ex.input_ids[: ex.prompt_len]) == render_llada(
        CONV[:1], add_generation_prompt=True
    )
    assert _decode(llada_tok, ex.input_ids[ex.prompt_len :]) == "The capital of France is Paris.<|eot_id|>"
    assert ex.input_ids[0] == llada_tok.convert_tokens_to_ids("<|startoftext|>")  # BOS once, not doubled
    assert ex.input_ids[1] == llada_tok.convert_tokens_to_ids("<|start_header_id|>")
    assert ds.lengths.tolist() == [len(ex.input_ids)]


def test_dream_boundaries_response_plus_eos(tmp_path, chatml_tok):
    src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONV}])
    ds, _ = build_sft_dataset(src, chatml_tok, "dream", max_len=512)
    ex = ds[0]
    assert _decode(chatml_tok, ex.input_ids[: ex.prompt_len]) == render_chatml(CONV[:1], True)
    assert (
        _decode(chatml_tok, ex.input_ids[ex.prompt_len :]) == " The capital of France is Paris. <|endoftext|>"
    )
    # response_end="turn": the template's end of turn instead of EOS.
    ds, _ = build_sft_dataset(src, chatml_tok, "dream", max_len=512, response_end="turn")
    ex = ds[0]
    assert (
        _decode(chatml_tok, ex.input_ids[ex.prompt_len :]) == " The capital of France is Paris. <|im_end|>\n"
    )


def test_multiturn_last_and_expand(tmp_path, llada_tok):
    src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": MULTI}])
    ds, stats = build_sft_dataset(src, llada_tok, "llada", max_len=512)
    assert stats.examples == 1
    ex = ds[0]
    assert _decode(llada_tok, ex.input_ids[: ex.prompt_len]) == render_llada(MULTI[:-1], True)
    assert _decode(llada_tok, ex.input_ids[ex.prompt_len :]) == "Soft rain on the roof<|eot_id|>"
    ds, stats = build_sft_dataset(src, llada_tok, "llada", max_len=512, multiturn="expand")
    assert stats.examples == 2
    first = ds[0]
    assert _decode(llada_tok, first.input_ids[: first.prompt_len]) == render_llada(MULTI[:2], True)
    assert _decode(llada_tok, first.input_ids[first.prompt_len :]) == "I am fine<|eot_id|>"
    assert ds[1].input_ids == ex.input_ids


def test_prompt_response_rows_and_json_list(tmp_path, llada_tok):
    rows = [
        {"prompt": "Hello there", "response": "I am fine"},
        {"prompt": "Hello there", "response": "I am fine", "system": "Be brief."},
    ]
    src = tmp_path / "d.json"
    src.write_text(json.dumps(rows))
    ds, stats = build_sft_dataset(src, llada_tok, "llada", max_len=512)
    assert stats.examples == 2
    user = [{"role": "user", "content": "Hello there"}]
    assert _decode(llada_tok, ds[0].input_ids[: ds[0].prompt_len]) == render_llada(user, True)
    system = [{"role": "system", "content": "Be brief."}, *user]
    assert _decode(llada_tok, ds[1].input_ids[: ds[1].prompt_len]) == render_llada(system, True)


def test_parquet_source(tmp_path, llada_tok):
    import datasets

    src = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"messages": CONV}, {"messages": MULTI}]).to_parquet(str(src))
    ds, stats = build_sft_dataset(src, llada_tok, "llada", max_len=512, max_rows=1)
    assert (stats.rows, stats.examples) == (1, 1)
    assert (
        _decode(llada_tok, ds[0].input_ids[ds[0].prompt_len :]) == "The capital of France is Paris.<|eot_id|>"
    )


def test_truncation_and_drop_counts(tmp_path, llada_tok):
    long_answer = "Soft rain on the roof, the garden drinks slowly. " * 20
    long_prompt = "Explain photosynthesis in one sentence. " * 40
    rows = [
        {"messages": CONV},  # fits
        {"messages": [CONV[0], {"role": "assistant", "content": long_answer}]},  # truncated
        {"messages": [{"role": "user", "content": long_prompt}, CONV[1]]},  # prompt alone too long
    ]
    src = _write_jsonl(tmp_path / "d.jsonl", rows)
    max_len = 64
    ds, stats = build_sft_dataset(src, llada_tok, "llada", max_len=max_len)
    assert (stats.rows, stats.examples, stats.truncated, stats.dropped) == (3, 2, 1, 0 + 1)
    assert max(ds.lengths) == max_len
    full = llada_tok(long_answer.strip() + "<|eot_id|>", add_special_tokens=False)["input_ids"]
    kept = ds[1].input_ids[ds[1].prompt_len :]
    assert kept == full[: len(kept)] and len(kept) == max_len - ds[1].prompt_len
    _, stats = build_sft_dataset(src, llada_tok, "llada", max_len=max_len, overlong="drop")
    assert (stats.examples, stats.truncated, stats.dropped) == (1, 0, 2)


def test_prompt_exactly_max_len_is_dropped(tmp_path, llada_tok):
    src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONV}])
    ds, _ = build_sft_dataset(src, llada_tok, "llada", max_len=512)
    prompt_len = ds[0].prompt_len
    ds, stats = build_sft_dataset(src, llada_tok, "llada", max_len=prompt_len + 1)
    assert (stats.examples, stats.truncated, stats.dropped) == (1, 1, 0)
    assert len(ds[0].input_ids) == prompt_len + 1  # one response token is enough to keep it
    _, stats = build_sft_dataset(src, llada_tok, "llada", max_len=prompt_len)
    assert (stats.examples, stats.dropped) == (0, 1)


MALFORMED = [
    ({"conversation": []}, "neither 'messages' nor 'prompt'/'response'"),
    ({"messages": [{"role": "human", "content": "hi"}, CONV[1]]}, "unknown role 'human'"),
    ({"messages": [CONV[0], {"role": "assistant", "content": "   "}]}, r"message 1 \(assistant\) is empty"),
    ({"messages": [CONV[0], CONV[1], CONV[0]]}, "last message is 'user'"),
    ({"messages": [{"role": "user"}, CONV[1]]}, r"message 0 \(user\) has no 'content'"),
    ({"messages": [{"content": "hi"}, CONV[1]]}, "message 0 has no 'role'"),
    ({"messages": []}, "'messages' is empty"),
    ({"prompt": "hi", "response": ""}, "'response' is empty"),
    # Valid JSON ("\\ud800" escapes) but not text: the tokenizer raised a TypeError naming no row.
    ({"prompt": "a\ud800b", "response": "c"}, r"'prompt' is not valid Unicode \(a lone surrogate"),
    (
        {"messages": [{"role": "user", "content": "\udce9"}, CONV[1]]},
        r"message 0 \(user\) content is not valid",
    ),
]


@pytest.mark.parametrize(("bad", "reason"), MALFORMED)
def test_malformed_row_names_file_and_row(tmp_path, llada_tok, bad, reason):
    src = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONV}, {"messages": MULTI}, bad])
    with pytest.raises(SFTDataError, match=rf"bad\.jsonl: row 2: .*{reason}"):
        build_sft_dataset(src, llada_tok, "llada", max_len=512)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"messages": [{"role": "user", "content": 5}, CONV[1]]}, r"message 0 \(user\) content is int"),
        ({"messages": "hello"}, "'messages' is str, expected a list"),
        ({"prompt": ["a"], "response": "b"}, "'prompt' is list"),
    ],
)
def test_wrong_types_name_file_and_row(tmp_path, llada_tok, bad, reason):
    src = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONV}, bad, {"messages": MULTI}])
    with pytest.raises(SFTDataError, match=rf"bad\.jsonl: row 1: .*{reason}"):
        build_sft_dataset(src, llada_tok, "llada", max_len=512)


def test_invalid_json_line_names_row_and_line(tmp_path, llada_tok):
    src = tmp_path / "broken.jsonl"
    src.write_text(json.dumps({"messages": CONV}) + "\n\n" + '{"messages": [{"role": "user",\n')
    with pytest.raises(SFTDataError, match=r"broken\.jsonl: row 1 \(line 3\) is not valid JSON"):
        build_sft_dataset(src, llada_tok, "llada", max_len=512)


def test_skip_malformed_counts(tmp_path, llada_tok):
    rows = [{"messages": CONV}, MALFORMED[1][0], {"messages": MULTI}, MALFORMED[1][0], MALFORMED[2][0]]
    src = _write_jsonl(tmp_path / "d.jsonl", rows)
    ds, stats = build_sft_dataset(src, llada_tok, "llada", max_len=512, skip_malformed=True)
    assert (stats.rows, stats.skipped, stats.examples, len(ds)) == (5, 3, 2, 2)
    assert sorted(stats.skip_reasons.values()) == [1, 2]


def test_missing_file(tmp_path, llada_tok):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        build_sft_dataset(missing, llada_tok, "llada", max_len=512)


def _bad_lines_file(path):
    """Rows 0 and 2 good; row 1 (line 2) is not JSON; row 3 (line 5, after a blank line) is not UTF-8."""
    good = json.dumps({"messages": CONV}).encode() + b"\n"
    path.write_bytes(good + b'{"messages": [\n' + good + b"\n" + b'{"prompt": "caf\xe9", "response": "ok"}\n')
    return path


def test_skip_malformed_skips_lines_that_are_not_json_or_not_utf8(tmp_path, llada_tok, caplog):
    src = _bad_lines_file(tmp_path / "lines.jsonl")
    with caplog.at_level(logging.WARNING, logger="mdlmpe_ds.data.sft_encode"):
        ds, stats = build_sft_dataset(src, llada_tok, "llada", max_len=512, skip_malformed=True)
    assert (stats.rows, stats.skipped, stats.examples, len(ds)) == (4, 2, 2, 2)
    assert stats.skip_reasons == {"not valid JSON": 1, "not valid UTF-8": 1}
    assert "2 malformed skipped" in stats.summary()
    assert "lines.jsonl: skipping row 1 (line 2)" in caplog.text  # the log names every skipped line
    assert "lines.jsonl: skipping row 3 (line 5)" in caplog.text
    # Without skip_malformed: the first bad line is an error naming file, row and line.
    with pytest.raises(SFTDataError, match=r"lines\.jsonl: row 1 \(line 2\) is not valid JSON \(column"):
        build_sft_dataset(src, llada_tok, "llada", max_len=512)


def test_non_utf8_bytes_name_file_line_and_offset(tmp_path, llada_tok):
    good = json.dumps({"messages": CONV}).encode()
    lines = tmp_path / "latin1.jsonl"
    lines.write_bytes(good + b"\n" + b'{"prompt": "caf\xe9", "response": "ok"}\n')
    offset = len(good) + 1 + len(b'{"prompt": "caf')
    with pytest.raises(
        SFTDataError,
        match=rf"latin1\.jsonl: row 1 \(line 2\) is not valid UTF-8 \(byte 0xe9 at byte offset {offset}\b",
    ):
        build_sft_dataset(lines, llada_tok, "llada", max_len=512)
    # A JSON array is one document: the row holding the bytes is named (its line is not known).
    array = tmp_path / "latin1.json"
    array.write_bytes(b"[" + good + b",\n" + b'{"prompt": "caf\xe9", "response": "ok"}, ' + good + b"]")
    with pytest.raises(
        SFTDataError, match=r"latin1\.json: row 1 holds bytes that are not valid UTF-8 .*line 2"
    ):
        build_sft_dataset(array, llada_tok, "llada", max_len=512)
    _, stats = build_sft_dataset(array, llada_tok, "llada", max_len=512, skip_malformed=True)
    assert (stats.rows, stats.skipped, stats.examples) == (3, 1, 2)
    assert stats.skip_reasons == {"not valid UTF-8": 1}
    # An array that is not JSON cannot be cut into rows: an error even with skip_malformed.
    array.write_bytes(b"[" + good + b",\n{]")
    with pytest.raises(SFTDataError, match=r"latin1\.json: not valid JSON \(line 2, column 2"):
        build_sft_dataset(array, llada_tok, "llada", max_len=512, skip_malformed=True)


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.json", "empty.parquet"])
def test_empty_file_is_named(tmp_path, llada_tok, name):
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(SFTDataError, match=rf"{name}: the file is empty"):
        build_sft_dataset(tmp_path / name, llada_tok, "llada", max_len=512, skip_malformed=True)


@pytest.mark.parametrize(("name", "text"), [("blank.jsonl", "\n \n"), ("none.json", "[]")])
def test_file_without_rows_is_named(tmp_path, llada_tok, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(SFTDataError, match=rf"{name}: no rows"):
        build_sft_dataset(tmp_path / name, llada_tok, "llada", max_len=512)


def test_parquet_truncated_or_without_rows_is_named(tmp_path, llada_tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "none.parquet"
    pq.write_table(
        pa.table({"prompt": pa.array([], pa.string()), "response": pa.array([], pa.string())}), empty
    )
    with pytest.raises(SFTDataError, match=r"none\.parquet: no rows"):
        build_sft_dataset(empty, llada_tok, "llada", max_len=512)
    cut = tmp_path / "cut.parquet"
    pq.write_table(pa.table({"prompt": ["What is 2+2?"] * 8, "response": ["4"] * 8}), cut)
    cut.write_bytes(cut.read_bytes()[:-20])  # an interrupted copy: the footer is gone
    with pytest.raises(SFTDataError, match=r"cut\.parquet: not a readable parquet file"):
        build_sft_dataset(cut, llada_tok, "llada", max_len=512)


def test_json_reader_keeps_bom_crlf_and_line_separators(tmp_path, llada_tok):
    """A UTF-8 BOM, CRLF line ends and U+2028 inside a string (legal in JSON) are one row each."""
    row = json.dumps({"prompt": "a\u2028b", "response": "c"}, ensure_ascii=False).encode()
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + row + b"\r\n\r\n" + row + b"\r\n")
    ds, stats = build_sft_dataset(src, llada_tok, "llada", max_len=512)
    assert (stats.rows, stats.examples) == (2, 2)
    assert "a\u2028b" in _decode(llada_tok, ds[0].input_ids)


# ---------------------------------------------------------------------------------------------- collation


def test_collator_shapes_and_masks():
    batch = [SFTExample([5, 6, 7, 8, 9], 2), SFTExample([5, 6, 7], 1)]
    out = SFTCollator(pad_id=0, pad_to_multiple_of=4)(batch)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [5, 6, 7, 0, 0, 0, 0, 0]]
    assert out["prompt_mask"].int().tolist() == [[1, 1, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    assert out["maskable"].int().tolist() == [[0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert out["valid"].all()
    assert out["answer_len"].tolist() == [6, 7]  # response + EOS pads (LLaDA's normaliser)
    assert out["seq_len"].tolist() == [5, 3]
    assert not (out["prompt_mask"] & out["maskable"]).any()

    out = SFTCollator(pad_id=0, attend_padding=False)(batch)
    assert out["input_ids"].shape == (2, 5)
    assert out["valid"].int().tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert out["maskable"].int().tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert out["answer_len"].tolist() == [3, 2]

    assert SFTCollator(pad_id=0, max_len=6, pad_to_multiple_of=4)(batch)["input_ids"].shape == (2, 6)
    with pytest.raises(ValueError, match="max_len 4"):
        SFTCollator(pad_id=0, max_len=4)(batch)
    with pytest.raises(ValueError, match="leaves no response"):
        SFTCollator(pad_id=0)([SFTExample([1, 2], 2)])


def test_collate_real_examples_pads_with_eos(tmp_path, llada_tok):
    src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONV}, {"messages": MULTI}])
    ds, _ = build_sft_dataset(src, llada_tok, "llada", max_len=512)
    eos = eos_pad_id(llada_tok)
    out = SFTCollator(eos)([ds[0], ds[1]])
    short = int(torch.argmin(out["seq_len"]))
    n = int(out["seq_len"][short])
    assert (out["input_ids"][short, n:] == eos).all() and n < out["input_ids"].shape[1]
    assert int(out["prompt_mask"][short].sum()) == ds[short].prompt_len


# ---------------------------------------------------------------------------------------- per-batch cutoff

# pad = EOS = 0. Prompts of 3, 1, 2 tokens; response bodies of 4, 2, 6 tokens, each ending with EOS.
INPUT_PAD = "random_with_input_pad"
CUT_BATCH = [
    SFTExample([11, 12, 13, 21, 22, 23, 24, 0], 3),
    SFTExample([11, 31, 32, 0], 1),
    SFTExample([11, 12, 41, 42, 43, 44, 45, 46, 0], 2),
]


def _key_drawing(collator, width, batch=CUT_BATCH):
    """A draw key whose collation has ``width`` columns (the cutoff draw is one of three rows)."""
    for key in range(200):
        if collator(batch, draw_key=(0, key))["input_ids"].shape[1] == width:
            return (0, key)
    raise AssertionError(f"no key in 200 gives width {width}")


def test_random_with_input_pad_layout():
    collator = SFTCollator(pad_id=0, perbatch_cutoff=INPUT_PAD, seed=3)
    # The common response length is one of the batch's bodies (EOS excluded): width 3 + {4, 2, 6}.
    widths = {collator(CUT_BATCH, draw_key=(0, k))["input_ids"].shape[1] for k in range(40)}
    assert widths == {7, 5, 9}
    out = collator(CUT_BATCH, draw_key=_key_drawing(collator, 7))  # row 0's body (4) drawn
    assert out["input_ids"].tolist() == [
        [11, 12, 13, 21, 22, 23, 24],  # the drawn row ends without its EOS, as in Dream-train
        [0, 0, 11, 31, 32, 0, 0],  # 2 left pads; response + EOS padded up to 4
        [0, 11, 12, 41, 42, 43, 44],  # 1 left pad; response cut to 4
    ]
    assert out["valid"].int().tolist() == [[1] * 7, [0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]]
    prompts = [[1, 1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0]]
    assert out["prompt_mask"].int().tolist() == prompts
    assert out["maskable"].int().tolist() == [[0, 0, 0, 1, 1, 1, 1]] * 3  # never a left pad or prompt
    assert out["answer_len"].tolist() == [4, 4, 4] and out["seq_len"].tolist() == [7, 4, 6]
    assert out["positions"].tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 4, 5]]

    strict = SFTCollator(pad_id=0, attend_padding=False, perbatch_cutoff=INPUT_PAD, seed=3)
    out = strict(CUT_BATCH, draw_key=_key_drawing(strict, 9))  # row 2's body (6) drawn
    assert out["input_ids"][1].tolist() == [0, 0, 11, 31, 32, 0, 0, 0, 0]
    assert out["valid"][1].int().tolist() == [0, 0, 1, 1, 1, 1, 0, 0, 0]  # its own EOS is real
    assert out["maskable"].int().tolist() == [
        [0, 0, 0, 1, 1, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1, 1, 1, 1],
    ]
    assert out["answer_len"].tolist() == [5, 3, 6]

    # Prompt 6 + body 1, prompt 2 + body 6: drawing 6 would give 6 + 6 > max_len; capped at 9 - 6.
    long_prompt = [SFTExample([11, 12, 13, 14, 15, 16, 51, 0], 6), CUT_BATCH[2]]
    capped = SFTCollator(pad_id=0, max_len=9, perbatch_cutoff=INPUT_PAD)
    assert {capped(long_prompt, draw_key=(1, k))["input_ids"].shape[1] for k in range(40)} == {7, 9}
    out = capped(long_prompt, draw_key=_key_drawing(capped, 9, long_prompt))
    assert out["input_ids"][1].tolist() == [0, 0, 0, 0, 11, 12, 41, 42, 43]


def test_random_cutoff_cuts_every_row_to_one_drawn_length():
    collator = SFTCollator(pad_id=0, perbatch_cutoff="random")
    out = collator(CUT_BATCH, draw_key=_key_drawing(collator, 8))  # row 2: 2 + 6 tokens
    assert out["input_ids"].tolist() == [
        [11, 12, 13, 21, 22, 23, 24, 0],
        [11, 31, 32, 0, 0, 0, 0, 0],
        [11, 12, 41, 42, 43, 44, 45, 46],
    ]
    assert out["valid"].all() and "positions" not in out
    assert out["answer_len"].tolist() == [5, 7, 6]
    out = collator(CUT_BATCH, draw_key=_key_drawing(collator, 3))  # row 1: 1 + 2 tokens
    assert out["input_ids"].tolist() == [[11, 12, 13], [11, 31, 32], [11, 12, 41]]
    assert out["prompt_mask"][0].all() and out["answer_len"].tolist() == [0, 2, 1]  # row 0 cut in its prompt


def test_cutoff_draw_is_keyed_by_the_batch_only():
    collator = SFTCollator(pad_id=0, perbatch_cutoff=INPUT_PAD, resp_cutoff_ratio=0.5, seed=3)
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    first = collator(CUT_BATCH, draw_key=(2, 7, 8, 9))
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is never used
    torch.manual_seed(123)
    again = collator(CUT_BATCH, draw_key=(2, 7, 8, 9))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    shapes = {collator(CUT_BATCH, draw_key=(e, 7, 8, 9))["input_ids"].shape[1] for e in range(40)}
    assert len(shapes) >= 4  # another epoch (or other samples): other draws
    other_seed = SFTCollator(pad_id=0, perbatch_cutoff=INPUT_PAD, resp_cutoff_ratio=0.5, seed=4)

    def widths(c):
        return [c(CUT_BATCH, draw_key=(e, 7, 8, 9))["input_ids"].shape[1] for e in range(40)]

    assert widths(other_seed) != widths(collator)


def test_resp_cutoff_chops_the_tail_and_keeps_an_answer_token():
    plain = SFTCollator(pad_id=0, perbatch_cutoff=INPUT_PAD)
    always = SFTCollator(pad_id=0, perbatch_cutoff=INPUT_PAD, resp_cutoff_ratio=1.0)
    cuts = set()
    for k in range(30):
        full, cut = plain(CUT_BATCH, draw_key=(0, k)), always(CUT_BATCH, draw_key=(0, k))
        width, shortest = cut["input_ids"].shape[1], int(full["answer_len"].min())
        assert 1 <= full["input_ids"].shape[1] - width <= shortest - 1  # c ~ U{1 .. m-1}
        cuts.add(full["input_ids"].shape[1] - width)
        for key in ("input_ids", "prompt_mask", "maskable", "valid", "positions"):
            assert torch.equal(cut[key], full[key][:, :width])
        assert cut["answer_len"].min() >= 1
    assert len(cuts) > 1
    tail_only = SFTCollator(pad_id=0, resp_cutoff_ratio=1.0)  # also without a per-batch cutoff
    assert tail_only(CUT_BATCH, draw_key=(0, 0))["input_ids"].shape[1] < 9


def test_block_diffusion_accepts_left_padded_rows():
    from mdlmpe_ds.diffusion.blocks import block_sft_corrupt

    collator = SFTCollator(pad_id=0, perbatch_cutoff=INPUT_PAD)
    out = collator(CUT_BATCH, draw_key=_key_drawing(collator, 9))
    c = block_sft_corrupt(
        out["input_ids"], out["prompt_mask"], out["maskable"], out["valid"], 2, "blocked", 99,
        torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert (c.block_start - 2 * c.active_block).tolist() == [3, 3, 3]  # responses start after the prompts
    assert not (c.valid & ~out["valid"]).any() and not (c.loss_mask & ~out["maskable"]).any()
    assert torch.equal(c.noisy_ids[~out["maskable"]], out["input_ids"][~out["maskable"]])


def test_cutoff_off_is_todays_collation():
    default = SFTCollator(pad_id=0)(CUT_BATCH)
    off_collator = SFTCollator(pad_id=0, perbatch_cutoff="none", resp_cutoff_ratio=0.0, seed=9)
    off = off_collator(CUT_BATCH, draw_key=(5, 1))
    assert set(off) == {"input_ids", "prompt_mask", "maskable", "valid", "answer_len", "seq_len"}
    assert all(torch.equal(off[k], default[k]) and off[k].dtype == default[k].dtype for k in default)
    assert off["input_ids"][1].tolist() == [11, 31, 32, 0, 0, 0, 0, 0, 0] and off["valid"].all()
    assert off["seq_len"].tolist() == [8, 4, 9] and off["answer_len"].tolist() == [6, 8, 7]


def test_cutoff_settings_are_checked():
    with pytest.raises(ValueError, match="needs draw_key"):
        SFTCollator(pad_id=0, perbatch_cutoff="random")(CUT_BATCH)
    with pytest.raises(ValueError, match="perbatch_cutoff must be one of"):
        SFTCollator(pad_id=0, perbatch_cutoff="longest")
    with pytest.raises(ValueError, match="pad_to_multiple_of cannot"):
        SFTCollator(pad_id=0, pad_to_multiple_of=8, resp_cutoff_ratio=0.1)
    from mdlmpe_ds.config.cli import from_mapping

    for overrides, message in (
        ({"data.perbatch_cutoff": "longest"}, "must be one of"),
        ({"data.resp_cutoff_ratio": 1.5}, r"must be in \[0, 1\]"),
        ({"data.perbatch_cutoff": INPUT_PAD, "model.position_encoding": "absolute"}, "absolute"),
        ({"data.perbatch_cutoff": "random", "train.block_size": 4}, "inside its prompt"),
    ):
        with pytest.raises(ValueError, match=message):
            from_mapping(overrides).validate()
    from_mapping({"data.perbatch_cutoff": "random_with_input_pad", "train.block_size": 4}).validate()


def test_trainer_batches_redraw_the_same_cutoff_after_resume():
    from mdlmpe_ds.config.run import RunConfig
    from mdlmpe_ds.data.sampler import LengthGroupedSampler
    from mdlmpe_ds.models.presets import preset
    from mdlmpe_ds.tasks.sft import SFTTask

    g = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(12):
        prompt, response = torch.randint(1, 6, (2,), generator=g).tolist()
        examples.append(SFTExample([*range(1, prompt + response + 1), 0], prompt))
    lengths = [len(ex.input_ids) for ex in examples]

    def trainer(sampler_state=None):
        sampler = LengthGroupedSampler(lengths, 2, seed=5, mega_batch_mult=2)
        if sampler_state is not None:
            sampler.load_state_dict(sampler_state)
        collator = SFTCollator(pad_id=0, perbatch_cutoff=INPUT_PAD, resp_cutoff_ratio=0.5, seed=1)
        return SFTTask(RunConfig().train, preset("llada-tiny"), examples, sampler, collator)  # data path only

    straight = trainer()
    batches = straight.batches()
    head = [next(batches) for _ in range(4)]
    state = straight.sampler.state_dict()
    tail = [next(batches) for _ in range(10)]  # runs into the next epochs
    resumed = trainer(state).batches()
    for expected in tail:
        got = next(resumed)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert len({b["input_ids"].shape for b in head + tail}) > 1


@pytest.mark.parametrize(
    ("family", "encoding"), [("llada", "rope"), ("llada", "mdlmpe"), ("dream", "mdlmpe"), ("dream", "alibi")]
)
def test_left_padded_rows_give_the_unpadded_logits(family, encoding):
    from mdlmpe_ds.attention import AttentionImpl
    from mdlmpe_ds.models import DiffusionLM, preset

    torch.manual_seed(0)
    config = preset(f"{family}-tiny", position_encoding=encoding)
    model = DiffusionLM(config, impl=AttentionImpl(backend="reference")).eval()
    with torch.no_grad():
        for layer in model.layers:
            if layer.attn.phase is not None:  # a non-zero phase residual, so MDLMPE's geometry is used
                torch.nn.init.normal_(layer.attn.phase.fc2.weight, std=0.5)
    eos, mask = config.eos_token_id, config.mask_token_id
    batch = [
        SFTExample([5, 6, 7, 8, 9, mask, 20, mask, 22, eos], 5),
        SFTExample([5, 6, mask, 31, eos], 2),
        SFTExample([5, 6, 7, 40, mask, 42, 43, eos], 3),
    ]
    collator = SFTCollator(pad_id=eos, perbatch_cutoff=INPUT_PAD)
    out = next(
        o for k in range(50) if (o := collator(batch, draw_key=(0, k)))["input_ids"].shape[1] == 5 + 4
    )  # 2 and 3 left pads, responses of 4
    assert (~out["valid"]).sum(1).tolist() == [0, 3, 2]
    with torch.no_grad():
        padded = model(out["input_ids"], out["valid"], raw=True, positions=out["positions"])
        unpositioned = model(out["input_ids"], out["valid"], raw=True)
        for row, pads in enumerate((~out["valid"]).sum(1).tolist()):
            alone = model(out["input_ids"][row : row + 1, pads:], raw=True)[0]
            # fp32; the padded row sums extra exact zeros in the softmax and matmuls: round-off only
            torch.testing.assert_close(padded[row, pads:], alone, atol=2e-5, rtol=0)
            if encoding == "mdlmpe" and pads:  # the basis c_t is absolute: without positions it shifts
                assert (unpositioned[row, pads:] - alone).abs().max() > 1e-4
    if encoding == "mdlmpe":
        torch.testing.assert_close(padded[0], unpositioned[0], atol=0, rtol=0)  # no pads: same path


def test_positions_are_checked_by_the_model():
    from mdlmpe_ds.models import DiffusionLM, preset

    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="absolute"):
        DiffusionLM(preset("llada-tiny", position_encoding="absolute"))(ids, positions=torch.arange(4)[None])
    model = DiffusionLM(preset("llada-tiny", position_encoding="rope"))
    with pytest.raises(ValueError, match="non-negative"):
        model(ids, positions=torch.tensor([[-1, 0, 1, 2]]))
    with pytest.raises(ValueError, match="shape"):
        model(ids, positions=torch.arange(3)[None])


# ---------------------------------------------------------------------------------------------- real data


def test_real_qwen_tokenizer_and_chat_corpus(qwen_tokenizer_dir, chat_jsonl):
    """The embedded demo's combination: Qwen2.5 tokenizer, chatterbot dialogues, both families."""
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    with open(chat_jsonl, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f.readlines()[:40]]
    for family, end in (("llada", "<|im_end|>\n"), ("dream", "<|endoftext|>")):
        ds, stats = build_sft_dataset(chat_jsonl, tok, family, max_len=256, max_rows=40)
        assert (stats.rows, stats.skipped) == (40, 0) and stats.examples + stats.dropped == 40
        ex = ds[0]
        messages = rows[0]["messages"]
        assert ex.input_ids[: ex.prompt_len] == tok(render_chatml(messages[:-1], True))["input_ids"]
        assert ex.input_ids[:3] == [151644, 8948, 198]  # <|im_start|> system \n
        assert ex.input_ids[ex.prompt_len - 3 : ex.prompt_len] == [
            151644,
            77091,
            198,
        ]  # <|im_start|>assistant\n
        assert _decode(tok, ex.input_ids[ex.prompt_len :]) == messages[-1]["content"] + end
    assert eos_pad_id(tok) == 151643


def test_multiturn_sample_is_one_turn_fixed_by_seed(tmp_path, llada_tok):
    src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": MULTI}] * 16)
    expand, _ = build_sft_dataset(src, llada_tok, "llada", max_len=512, multiturn="expand")
    candidates = {tuple(expand[0].input_ids), tuple(expand[1].input_ids)}
    ds, stats = build_sft_dataset(src, llada_tok, "llada", max_len=512, multiturn="sample", seed=3)
    again, _ = build_sft_dataset(src, llada_tok, "llada", max_len=512, multiturn="sample", seed=3)
    other, _ = build_sft_dataset(src, llada_tok, "llada", max_len=512, multiturn="sample", seed=4)
    picks = [tuple(ds[i].input_ids) for i in range(len(ds))]
    assert stats.examples == 16 and set(picks) == candidates  # one per dialogue, both turns drawn
    assert picks == [tuple(again[i].input_ids) for i in range(16)]
    assert picks != [tuple(other[i].input_ids) for i in range(16)]


def test_cache_roundtrip_and_invalidation(tmp_path, llada_tok, caplog):
    src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONV}, {"messages": MULTI}, MALFORMED[1][0]])
    cache = tmp_path / "cache"
    kw = {"max_len": 512, "skip_malformed": True, "cache_dir": cache}
    built, stats = build_sft_dataset(src, llada_tok, "llada", **kw)
    assert len(list(cache.glob("sft-*.npz"))) == 1
    with caplog.at_level(logging.INFO, logger="mdlmpe_ds.data.sft_encode"):
        loaded, loaded_stats = build_sft_dataset(src, llada_tok, "llada", **kw)
    assert "loaded from cache" in caplog.text
    assert loaded_stats == stats and loaded_stats.skipped == 1
    assert [loaded[i] for i in range(len(loaded))] == [built[i] for i in range(len(built))]
    assert loaded.lengths.tolist() == built.lengths.tolist()
    build_sft_dataset(src, llada_tok, "llada", **{**kw, "max_len": 64})  # other settings: other file
    assert len(list(cache.glob("sft-*.npz"))) == 2
    _write_jsonl(src, [{"messages": CONV}, {"messages": CONV}])  # the source changed: rebuilt
    rebuilt, _ = build_sft_dataset(src, llada_tok, "llada", **kw)
    assert rebuilt[1] == rebuilt[0] and len(list(cache.glob("sft-*.npz"))) == 3


def test_cache_is_keyed_by_content_an_edit_keeping_size_and_mtime_is_seen(tmp_path, llada_tok):
    """An in-place edit that keeps the file's size and mtime (a same-length answer changed, the
    timestamp put back) is another cache entry: the new tokens are used, and so the data check of a
    resume sees another fingerprint."""
    import os

    from mdlmpe_ds.data.fingerprint import sft_fingerprint

    src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONV}])
    cache = tmp_path / "cache"
    built, _ = build_sft_dataset(src, llada_tok, "llada", max_len=512, cache_dir=cache)
    st = os.stat(src)
    with open(src) as fh:
        text = fh.read()
    answer = CONV[-1]["content"]
    edited = answer[::-1]
    assert len(edited) == len(answer) and edited != answer
    with open(src, "r+") as fh:
        fh.write(text.replace(answer, edited))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(src).st_size == st.st_size and os.stat(src).st_mtime_ns == st.st_mtime_ns
    again, _ = build_sft_dataset(src, llada_tok, "llada", max_len=512, cache_dir=cache)
    assert len(list(cache.glob("sft-*.npz"))) == 2
    assert sft_fingerprint(again, llada_tok) != sft_fingerprint(built, llada_tok)


def test_a_truncated_cache_file_is_named_and_rebuilt(tmp_path, llada_tok, caplog):
    src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONV}, {"messages": MULTI}])
    cache = tmp_path / "cache"
    built, _ = build_sft_dataset(src, llada_tok, "llada", max_len=512, cache_dir=cache)
    (file,) = cache.glob("sft-*.npz")
    with open(file, "r+b") as fh:
        fh.truncate(file.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="mdlmpe_ds.data.sft_encode"):
        again, _ = build_sft_dataset(src, llada_tok, "llada", max_len=512, cache_dir=cache)
    assert f"SFT token cache {file} is unreadable" in caplog.text and "tokenising" in caplog.text
    assert [again[i] for i in range(len(again))] == [built[i] for i in range(len(built))]
    loaded, _ = build_sft_dataset(src, llada_tok, "llada", max_len=512, cache_dir=cache)  # replaced whole
    assert len(loaded) == len(built)


def test_cache_writers_on_two_nodes_never_share_a_temporary_file(tmp_path, llada_tok, monkeypatch):
    """Each node's first rank may write the same entry into a shared cache folder at once, and two
    nodes can run the same pid: the temporary file (renamed into place) is named by host and pid."""
    import os

    src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONV}])
    cache = tmp_path / "cache"
    written, replace = [], os.replace
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    monkeypatch.setattr(os, "replace", lambda a, b: (written.append(a), replace(a, b)))
    for host in ("node-a", "node-b"):
        monkeypatch.setattr("socket.gethostname", lambda host=host: host)
        for old in cache.glob("sft-*.npz"):
            old.unlink()
        build_sft_dataset(src, llada_tok, "llada", max_len=512, cache_dir=cache)
    assert len(written) == 2 and written[0] != written[1]
    assert len(list(cache.glob("sft-*.npz"))) == 1 and not list(cache.glob("*.tmp.*"))


def test_a_directory_of_shards_is_read_file_by_file_and_names_the_bad_row(tmp_path, llada_tok):
    """A directory of JSONL shards: a row whose content is a number is named by file and row (read
    through ``datasets``, the whole shard's contents became JSON-quoted strings and trained); a line
    that is not JSON is named by file and line, and skipped with skip_malformed; the split follows
    ``datasets``' file names (test.jsonl is not training data); an in-place edit of a shard is
    another cache entry."""
    good = json.dumps({"messages": CONV}) + "\n"
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.jsonl").write_text(good * 3)
    bad = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 5}]}
    (shards / "b.jsonl").write_text(good * 2 + json.dumps(bad) + "\n" + good)
    with pytest.raises(SFTDataError, match=r"b\.jsonl: row 2: message 1 \(assistant\) content is int"):
        build_sft_dataset(str(shards), llada_tok, "llada", max_len=512)
    (shards / "b.jsonl").write_text(good * 2 + '{"messages": [\n' + good)
    with pytest.raises(SFTDataError, match=r"b\.jsonl: row 2 \(line 3\) is not valid JSON"):
        build_sft_dataset(str(shards), llada_tok, "llada", max_len=512)
    built, stats = build_sft_dataset(str(shards), llada_tok, "llada", max_len=512, skip_malformed=True)
    assert len(built) == 6 and stats.skipped == 1
    reference, _ = build_sft_dataset(str(shards / "a.jsonl"), llada_tok, "llada", max_len=512)
    assert built[0] == reference[0]  # the same example as from the file alone
    (shards / "train.jsonl").write_text(good)
    (shards / "test.jsonl").write_text(good * 5)
    (shards / "a.jsonl").unlink()
    (shards / "b.jsonl").unlink()
    cache = tmp_path / "cache"
    only_train, _ = build_sft_dataset(str(shards), llada_tok, "llada", max_len=512, cache_dir=cache)
    assert len(only_train) == 1
    (shards / "train.jsonl").write_text(good * 2)  # edited in place
    edited, _ = build_sft_dataset(str(shards), llada_tok, "llada", max_len=512, cache_dir=cache)
    assert len(edited) == 2 and len(list(cache.glob("sft-*.npz"))) == 2


def test_cache_of_a_dataset_directory_is_keyed_by_its_files(tmp_path, llada_tok, monkeypatch):
    """A hub-shaped dataset (here a local copy: a README's configs map splits to parquet shards) is
    read through its files and cached under their contents: a restart loads it, other data is
    another entry."""
    import sys
    from pathlib import Path

    from mdlmpe_ds.data import sft_encode as sft

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
    from hub_fixtures import write_hub_dataset

    rows = {"default": {"train": [{"messages": CONV}] * 4}}
    repo = write_hub_dataset(tmp_path / "hub", "org/chat", rows, 2)
    cache = tmp_path / "cache"
    built, _ = build_sft_dataset(str(repo), llada_tok, "llada", max_len=512, cache_dir=cache)
    assert len(built) == 4 and len(list(cache.glob("sft-*.npz"))) == 1
    with monkeypatch.context() as patch:
        patch.setattr(sft, "_render_pair", lambda *a, **k: (_ for _ in ()).throw(AssertionError("rebuilt")))
        again, _ = build_sft_dataset(str(repo), llada_tok, "llada", max_len=512, cache_dir=cache)
    assert [again[i] for i in range(4)] == [built[i] for i in range(4)]
    rows = {"default": {"train": [{"messages": MULTI}] * 3}}
    other = write_hub_dataset(tmp_path / "hub", "org/chat2", rows, 1)
    changed, _ = build_sft_dataset(str(other), llada_tok, "llada", max_len=512, cache_dir=cache)
    assert len(changed) == 3 and len(list(cache.glob("sft-*.npz"))) == 2


def test_content_spelling_a_special_token_is_encoded_as_text(tmp_path, chatml_tok, caplog):
    """A user turn quoting "<|mask|>" and a response quoting "<|im_end|>" and "<|endoftext|>": no
    special id comes from their content (the mask id in the prompt, a turn end or EOS inside the
    response, before), the template's own specials stay, the text decodes back to what was
    written, and the row is counted and logged. A row without such text is encoded exactly as
    before, whatever rows surround it."""
    plain = {"messages": CONV}
    quoting = {
        "messages": [
            {"role": "user", "content": "What does <|mask|> mean?"},
            {"role": "assistant", "content": "It ends a turn like <|im_end|> or a text like <|endoftext|>."},
        ]
    }
    alone, _ = build_sft_dataset(
        _write_jsonl(tmp_path / "plain.jsonl", [plain]), chatml_tok, "dream", max_len=512
    )
    with caplog.at_level(logging.WARNING):
        built, stats = build_sft_dataset(
            _write_jsonl(tmp_path / "mixed.jsonl", [plain, quoting, plain]), chatml_tok, "dream", max_len=512
        )
    assert built[0] == alone[0] == built[2] and stats.special_text == 1
    assert "quoting special tokens as text" in stats.summary() and "row 1 quotes special token" in caplog.text
    ex = built[1]
    prompt, response = list(ex.input_ids[: ex.prompt_len]), list(ex.input_ids[ex.prompt_len :])
    special = {chatml_tok.convert_tokens_to_ids(t): t for t in CHATML_SPECIALS}
    turns = ["<|im_start|>", "<|im_end|>"] * 2 + ["<|im_start|>"]  # default system, user, the answer's start
    assert [special[i] for i in prompt if i in special] == turns
    assert [special[i] for i in response if i in special] == ["<|endoftext|>"]  # Dream's response end: EOS
    assert "What does <|mask|> mean?" in _decode(chatml_tok, prompt)
    assert _decode(chatml_tok, response).startswith(
        "It ends a turn like <|im_end|> or a text like <|endoftext|>."
    )


def test_a_pretty_printed_json_object_is_named_as_such(tmp_path, llada_tok):
    """One object over several lines was reported as "row 0 (line 1) is not valid JSON"; the
    error now says what the file is and, when a key holds the rows, which one. A JSON Lines file
    whose first line is broken keeps its own error."""
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": [{"messages": CONV}]}, indent=2))
    with pytest.raises(SFTDataError, match=r"one JSON object spread over several lines.*its key 'data'"):
        build_sft_dataset(str(wrapped), llada_tok, "llada", max_len=512)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"messages": [\n' + json.dumps({"messages": CONV}) + "\n")
    with pytest.raises(SFTDataError, match=r"row 0 \(line 1\) is not valid JSON"):
        build_sft_dataset(str(broken), llada_tok, "llada", max_len=512)
