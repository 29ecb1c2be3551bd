"""Packed pretraining sequences and corruption draws keyed by data index."""

import itertools
import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from mdlmpe_ds.data.packing import PackedTokenDataset, packed_collate, split_documents
from mdlmpe_ds.seeding import corruption_draws

SEP = 0


def _disjoint_docs(n_docs, rng):
    """Document k uses only ids in [100 (k + 1), 100 (k + 1) + 50): its tokens identify it."""
    return [rng.integers(100 * (k + 1), 100 * (k + 1) + 50, size=rng.integers(1, 40)) for k in range(n_docs)]


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64])
def test_packing_never_joins_documents_without_separator(seq_len):
    rng = np.random.default_rng(seq_len)
    docs = _disjoint_docs(30, rng)
    ds = PackedTokenDataset.from_token_documents(docs, seq_len, SEP)
    total = sum(len(d) + 1 for d in docs)
    assert len(ds) == total // seq_len and ds.num_tokens == len(ds) * seq_len
    windows = [ds[i]["input_ids"].numpy() for i in range(len(ds))]
    flat = np.concatenate(windows)
    for w in windows:
        for a, b in itertools.pairwise(w):
            if a != SEP and b != SEP:
                assert a // 100 == b // 100, (a, b)  # same document unless a separator sits between
    # Windows tile the stream in order: the documents come back, each followed by the separator.
    expected = np.concatenate([np.append(d, SEP) for d in docs])[: len(flat)]
    assert np.array_equal(flat, expected)
    # document_ids agree with the identity encoded in the tokens.
    for i, w in enumerate(windows):
        ids = ds.document_ids(i)
        toks = w != SEP
        assert np.array_equal(ids[toks], w[toks] // 100 - 1)


def test_items_are_indexable_and_collate():
    ds = PackedTokenDataset.from_token_documents([[5, 6, 7], [8, 9]], 3, SEP)
    assert [ds[i]["input_ids"].tolist() for i in range(len(ds))] == [[5, 6, 7], [0, 8, 9]]
    batch = packed_collate([ds[1], ds[0]])
    assert batch["input_ids"].shape == (2, 3) and batch["index"].tolist() == [1, 0]
    assert batch["valid"].all()
    with pytest.raises(IndexError):
        ds[2]


def test_split_modes():
    text = "a b\nc\n\n\nd e\n  \nf\n"
    assert split_documents(text, "file") == ["a b\nc\n\n\nd e\n  \nf"]
    assert split_documents(text, "paragraph") == ["a b\nc", "d e", "f"]
    assert split_documents(text, "line") == ["a b", "c", "d e", "f"]
    with pytest.raises(ValueError, match="split="):
        split_documents(text, "sentence")


@pytest.fixture(scope="module")
def qwen(qwen_tokenizer_dir):
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


def test_text_files_and_hub_fixture_pack_the_same_documents(qwen, tmp_path):
    docs = ["Hello world.", "The quick brown fox\njumps over the lazy dog.", "Short one"]
    (tmp_path / "a.txt").write_text("\n\n".join(docs), encoding="utf-8")
    from_files = PackedTokenDataset.from_text_files([tmp_path / "a.txt"], qwen, 4, split="paragraph")
    # An OpenWebText-shaped fixture (`text` column), read through `datasets`.
    rows = tmp_path / "owt.jsonl"
    rows.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    from_hub = PackedTokenDataset.from_hub("json", qwen, 4, data_files=str(rows), cache_dir=tmp_path / "hf")
    assert np.array_equal(from_files.stream, from_hub.stream)
    assert from_files.separator_id == qwen.eos_token_id == 151643
    pieces = qwen.decode(from_files.stream).split("<|endoftext|>")
    assert pieces[:3] == docs and pieces[3] == ""


def test_real_ptb_lines_pack_one_separator_per_sentence(assets, qwen):
    ptb = assets("ptb").ptb("valid")
    ds = PackedTokenDataset.from_text_files([ptb], qwen, 128, split="line")
    assert (ds.stream == qwen.eos_token_id).sum() == len(ds.doc_ends) == 3370
    assert len(ds) == ds.stream.size // 128 > 500


def test_corruption_draws_depend_only_on_seed_and_index():
    t_a, u_a = corruption_draws(7, [3, 11, 5], 16)
    t_b, u_b = corruption_draws(7, torch.tensor([5, 3]), 24)  # other batch, order and padded length
    assert torch.equal(t_a[0], t_b[1]) and torch.equal(t_a[2], t_b[0])
    assert torch.equal(u_a[0], u_b[1, :16]) and torch.equal(u_a[2], u_b[0, :16])
    _, u_c = corruption_draws(8, [3], 16)
    assert not torch.equal(u_c[0], u_a[0])
    _, u_d = corruption_draws(7, [3], 16, sample=1)
    assert not torch.equal(u_d[0], u_a[0])
    assert not torch.equal(u_a[0], u_a[1])
    assert ((u_a >= 0) & (u_a < 1)).all() and u_a.dtype == torch.float64
    # Pinned values: changing the derivation silently changes every compared run's masks.
    t_pin, u_pin = corruption_draws(7, [3], 2)
    assert float(t_pin[0]) == 0.7373528251156954
    assert u_pin[0].tolist() == [0.10756688693770555, 0.41255843359866096]


def test_a_text_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    """Python's UnicodeDecodeError names neither the file nor the line: in a directory of many
    .txt files the user could not find it."""
    from mdlmpe_ds.data.corpora import corpus_documents

    (tmp_path / "a.txt").write_text("fine\n", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"one\ntwo\ncaf" + b"\xe9\r\n")
    texts, _ = corpus_documents(str(tmp_path))
    with pytest.raises(ValueError, match=r"b\.txt is not valid UTF-8: byte 0xe9 at line 3, byte offset 11"):
        list(texts())


def test_a_corpus_path_holding_a_comma_is_one_path(tmp_path):
    """The corpus spec is a comma list; a file or directory that exists as written is one path."""
    from mdlmpe_ds.data.corpora import corpus_documents

    odd = tmp_path / "books, vol 1"
    odd.mkdir()
    (odd / "a.txt").write_text("one document\n", encoding="utf-8")
    texts, source = corpus_documents(str(odd))
    assert list(texts()) == ["one document"]
    assert source["files"][0][0].endswith("books, vol 1/a.txt")


def test_a_corpus_row_whose_text_is_not_a_string_is_named(tmp_path):
    """A .jsonl corpus with {"text": 5} failed with "'int' object has no attribute 'strip'"."""
    from mdlmpe_ds.data.corpora import corpus_documents

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": null}\n{"text": 5}\n')
    texts, _ = corpus_documents(str(bad))
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 2 has int 5 in column 'text', expected a string"):
        list(texts())


@pytest.mark.parametrize(
    "text, where",
    [
        ('{"text": "a"}\n{"text": "b"}\nnot json\n{"text": "d"}\n', r"line 3 is not valid JSON \(column 1"),
        ('{"text": "a"}\n{"text": "b\n', r"line 2 is not valid JSON"),
        ('[{"text": "a"}, {"text": ]', r"not valid JSON \(line 1, column 26"),
    ],
)
def test_a_corpus_line_that_is_not_json_is_named(tmp_path, text, where):
    """datasets failed the whole .jsonl with "An error occurred while generating the dataset",
    naming neither the file nor the line (the line was only in a pyarrow log)."""
    from mdlmpe_ds.data.corpora import corpus_documents

    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    texts, _ = corpus_documents(str(bad))
    with pytest.raises(ValueError, match=rf"corpus .*bad\.jsonl: {where}"):
        list(texts())


def test_an_empty_validation_corpus_is_named(tmp_path, qwen):
    """A blank validation .txt failed with "token store .../store-50089c...: no non-empty documents",
    naming a cache path, not the corpus or its role."""
    from mdlmpe_ds.data.corpora import load_packed_corpus

    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n  \n", encoding="utf-8")
    for cache in (None, tmp_path / "stores"):
        with pytest.raises(
            ValueError, match=r"validation / evaluation corpus '.*blank\.txt' has no non-empty"
        ):
            load_packed_corpus(str(blank), qwen, 8, cache_dir=cache, role="eval")


def test_a_comma_list_says_what_it_takes(tmp_path):
    """A comma list with a .jsonl was reported as one missing file named by the whole list, and
    one with a directory as "corpus file(s) not found: DIR" although DIR exists."""
    from mdlmpe_ds.data.corpora import corpus_documents

    (tmp_path / "a.txt").write_text("x\n")
    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n')
    (tmp_path / "d").mkdir()
    for other, kind in (("b.jsonl", "a .jsonl file"), ("d", "a directory")):
        spec = f"{tmp_path / 'a.txt'},{tmp_path / other}"
        with pytest.raises(ValueError, match=rf"a comma list takes \.txt files, and .*{other} is {kind}"):
            corpus_documents(spec)
    texts, _ = corpus_documents(f"{tmp_path / 'a.txt'},{tmp_path / 'a.txt'}")
    assert len(list(texts())) == 2


def test_crlf_paragraphs_split_and_the_bom_is_dropped(tmp_path):
    """A Windows-saved .txt (CRLF, a byte-order mark): its paragraphs became one document (a blank
    line is \\r\\n\\r\\n) and the first began with U+FEFF. The same text saved with LF gives the same
    documents now."""
    from mdlmpe_ds.data.corpora import corpus_documents

    paragraphs = ["First para,\nline two.", "Second para.", "Third."]
    unix = tmp_path / "unix.txt"
    unix.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    windows = tmp_path / "windows.txt"
    windows.write_bytes(
        b"\xef\xbb\xbf" + ("\r\n\r\n".join(p.replace("\n", "\r\n") for p in paragraphs) + "\r\n").encode()
    )
    texts_unix, _ = corpus_documents(str(unix), split="paragraph")
    texts_windows, _ = corpus_documents(str(windows), split="paragraph")
    assert list(texts_windows()) == list(texts_unix()) and len(list(texts_unix())) == 3
