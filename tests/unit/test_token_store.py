"""The pretraining token store (data/token_store.py), hub streaming and the named corpora
(data/named_corpora.py), on real tokenizers and real text from the offline assets.

Hub corpora are read from local directories laid out like the hub repositories (README ``configs``,
parquet shards) through ``MDLMPE_DS_HUB_DATASETS``: the same ``datasets.load_dataset`` calls as on
the hub.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from mdlmpe_ds.data import named_corpora as named
from mdlmpe_ds.data.corpora import load_packed_corpus
from mdlmpe_ds.data.fingerprint import Fingerprint, packed_fingerprint
from mdlmpe_ds.data.packing import PackedTokenDataset, packed_collate
from mdlmpe_ds.data.token_store import (
    COMPLETE,
    StoreChangedError,
    StoreError,
    TokenStore,
    build_store,
    open_or_build,
    token_dtype,
)
from mdlmpe_ds.seeding import corruption_draws
from mdlmpe_ds.tasks.pretrain import pretrain_corruption

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "dist"))
from hub_fixtures import write_hub_dataset  # noqa: E402


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def gpt2(assets):
    return AutoTokenizer.from_pretrained(str(assets("gpt2_tokenizer").gpt2_tokenizer_dir))


@pytest.fixture(scope="module")
def qwen(assets):
    return AutoTokenizer.from_pretrained(str(assets("qwen_tokenizer").qwen_tokenizer_dir))


@pytest.fixture(scope="module")
def hub_root(assets, tmp_path_factory):
    """OpenWebText-, WikiText-, LM1B- and text8-shaped datasets built from the offline corpora."""
    paths = assets("shakespeare", "enwiki_excerpt", "news_excerpt", "ptb")
    root = tmp_path_factory.mktemp("hub")
    paragraphs = [p for p in paths.shakespeare("valid").read_text().split("\n\n") if p.strip()][:400]
    write_hub_dataset(
        root, "Skylion007/openwebtext", {"default": {"train": [{"text": p} for p in paragraphs]}}
    )
    wiki = {s: paths.enwiki_excerpt(s).read_text().split("\n") for s in ("train", "valid", "test")}
    rows = {"train": wiki["train"], "validation": wiki["valid"], "test": wiki["test"]}
    cfg = {k: [{"text": line + "\n" if line else ""} for line in v] for k, v in rows.items()}
    write_hub_dataset(root, "Salesforce/wikitext", {"wikitext-2-raw-v1": cfg, "wikitext-103-raw-v1": cfg})
    news = {s: paths.news_excerpt(s).read_text().split("\n") for s in ("train", "test")}
    write_hub_dataset(
        root,
        "billion-word-benchmark/lm1b",
        {"plain_text": {s: [{"text": t} for t in news[s] if t] for s in news}},
    )
    ptb = {s: paths.ptb(s).read_text() for s in ("train", "valid", "test")}
    text8 = {"train": ptb["train"], "validation": ptb["valid"], "test": ptb["test"]}
    write_hub_dataset(
        root, "afmck/text8", {"default": {s: [{"text": t[:20000]}] for s, t in text8.items()}}, 1
    )
    return root


@pytest.fixture
def hub(hub_root, monkeypatch):
    monkeypatch.setenv(named.HUB_DATASETS_ENV, str(hub_root))
    return hub_root


# ------------------------------------------------------------------------------------ store == memory
@pytest.mark.parametrize("tok_name, dtype", [("gpt2", np.uint16), ("qwen", np.uint32)])
def test_store_windows_and_draws_equal_the_in_memory_path(request, assets, tmp_path, tok_name, dtype):
    """Windows read from the memory map are the in-memory windows token for token (same index),
    the corruption of a batch is identical, and the checkpoint fingerprint does not change."""
    tok = request.getfixturevalue(tok_name)
    corpus = str(assets("shakespeare").shakespeare("valid"))
    memory = load_packed_corpus(corpus, tok, 64, split="paragraph")
    stored = load_packed_corpus(corpus, tok, 64, split="paragraph", cache_dir=tmp_path / "stores")
    assert isinstance(stored.stream, np.memmap) and stored.stream.dtype == dtype
    assert stored.store.manifest["dtype"] == np.dtype(dtype).name
    assert len(stored) == len(memory) > 100 and stored.doc_ends.tolist() == memory.doc_ends.tolist()
    for i in range(len(memory)):
        a, b = memory[i], stored[i]
        assert a["index"] == b["index"] == i and b["input_ids"].dtype == torch.int64
        assert torch.equal(a["input_ids"], b["input_ids"]), i
    picks = [3, 0, len(memory) - 1, 57]
    batch_m = packed_collate([memory[i] for i in picks]) | {"epoch": 2}
    batch_s = packed_collate([stored[i] for i in picks]) | {"epoch": 2}
    for x, y in zip(
        pretrain_corruption(batch_m, 11, 1e-3, 5, "llada"), pretrain_corruption(batch_s, 11, 1e-3, 5, "llada")
    ):
        assert torch.equal(x, y)
    t_m, u_m = corruption_draws(11, batch_m["index"], 64)
    t_s, u_s = corruption_draws(11, batch_s["index"], 64)
    assert torch.equal(t_m, t_s) and torch.equal(u_m, u_s)
    # The fingerprint recorded at build equals the in-memory one, and the formula of old checkpoints.
    old = Fingerprint().tokenizer(tok).array("stream", memory.stream).array("doc_ends", memory.doc_ends)
    assert packed_fingerprint(stored, tok) == packed_fingerprint(memory, tok) == old.hexdigest()
    unrecorded = PackedTokenDataset(stored.stream, stored.doc_ends, 64, stored.separator_id)
    assert packed_fingerprint(unrecorded, tok) == old.hexdigest()  # hashed from the map in chunks
    # A second load maps the same store (no rebuild) with another window length.
    again = load_packed_corpus(corpus, tok, 50, split="paragraph", cache_dir=tmp_path / "stores")
    assert again.store.path == stored.store.path and len(list((tmp_path / "stores").glob("store-*/"))) == 1


def test_store_format_dtype_and_damage_are_named(tmp_path):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    docs = [[5, 6, 7], [], [8], [65535, 2]]
    store = build_store(tmp_path / "s", docs, separator_id=0, vocab_size=65536, manifest={"source": "x"})
    assert store.tokens.tolist() == [5, 6, 7, 0, 8, 0, 65535, 2, 0] and store.doc_ends.tolist() == [4, 6, 9]
    assert store.manifest["source"] == "x" and store.manifest["num_documents"] == 3
    assert store.read(2, 5).tolist() == [7, 0, 8, 0, 65535] and store.read(2, 5).dtype == np.int64
    with pytest.raises(IndexError, match="out of range"):
        store.read(7, 3)
    with pytest.raises(ValueError, match="65536 does not fit in uint16"):
        build_store(tmp_path / "t", [[65536]], separator_id=0, vocab_size=100)
    assert not (tmp_path / "t").exists() and not list(tmp_path.glob(".t.staging*"))
    with open(tmp_path / "s" / "tokens.bin", "r+b") as fh:
        fh.truncate(8)
    with pytest.raises(StoreError, match=r"tokens\.bin: 8 bytes"):
        TokenStore.open(tmp_path / "s")
    (tmp_path / "s" / "manifest.json").write_text("{")
    with pytest.raises(StoreError, match=r"manifest\.json is unreadable"):
        TokenStore.open(tmp_path / "s")


# ------------------------------------------------------------------------------------ content, not names
def test_tokens_overwritten_at_the_same_size_are_named_and_rebuilt(tmp_path):
    """Another corpus written over ``tokens.bin`` at the same size (same manifest, same counts):
    opening names the file instead of training on it; open_or_build builds the store again from
    its documents. The sampled hash reads 64 chunks, so a change anywhere in a small file shows."""
    path = tmp_path / "stores" / "store-x"
    store = open_or_build(path, _docs, separator_id=0, vocab_size=1000)
    original = np.array(store.tokens)
    tokens = path / "tokens.bin"
    other = np.array(original[::-1])  # same size, same ids, other order: another corpus
    tokens.write_bytes(other.tobytes())
    assert tokens.stat().st_size == original.nbytes
    with pytest.raises(
        StoreChangedError, match=r"token store file changed since it was built: .*tokens\.bin"
    ):
        TokenStore.open(path)
    logs: list[str] = []
    again = open_or_build(path, _docs, separator_id=0, vocab_size=1000, log=logs.append)
    assert any(str(tokens) in m and "building it again" in m for m in logs), logs
    assert np.array_equal(again.tokens, original)
    # One changed id in the middle of the file is caught as well (it lies in a sampled chunk).
    ids = np.array(again.tokens)
    ids[len(ids) // 2] += 1
    tokens.write_bytes(ids.tobytes())
    with pytest.raises(StoreChangedError, match=r"tokens\.bin"):
        TokenStore.open(path)


def test_an_edited_manifest_is_named_not_taken_for_other_data(gpt2, assets, tmp_path):
    """A store manifest edited by hand (its recorded fingerprint, here) is reported as "manifest
    edited or damaged: <file>" and the store is built again, so a resume sees the true fingerprint of
    its data instead of calling it "other data"."""
    corpus = str(assets("shakespeare").shakespeare("valid"))
    stored = load_packed_corpus(corpus, gpt2, 64, split="paragraph", cache_dir=tmp_path / "stores")
    want = packed_fingerprint(stored, gpt2)
    manifest_file = stored.store.path / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["packed_fingerprint"] = "0" * 64
    manifest_file.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    with pytest.raises(StoreChangedError, match=rf"manifest edited or damaged: {manifest_file}"):
        TokenStore.open(stored.store.path)
    again = load_packed_corpus(corpus, gpt2, 64, split="paragraph", cache_dir=tmp_path / "stores")
    assert packed_fingerprint(again, gpt2) == want


def test_a_text_corpus_edited_in_place_keeping_size_and_mtime_gets_its_own_store(gpt2, tmp_path):
    """The store key of a local corpus file is its content hash, not (path, size, mtime): an edit
    that keeps both is tokenised anew, not served from the store of the old text."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n\n" * 40)
    first = load_packed_corpus(str(corpus), gpt2, 16, split="paragraph", cache_dir=tmp_path / "stores")
    st = corpus.stat()
    corpus.write_text("the quick brown cat jumps over the lazy dog\n\n" * 40)  # same length
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert corpus.stat().st_size == st.st_size and corpus.stat().st_mtime_ns == st.st_mtime_ns
    second = load_packed_corpus(str(corpus), gpt2, 16, split="paragraph", cache_dir=tmp_path / "stores")
    assert second.store.path != first.store.path
    assert "cat" in gpt2.decode(second[0]["input_ids"].tolist()) and "cat" not in gpt2.decode(
        first[0]["input_ids"].tolist()
    )


def test_stores_built_before_content_hashes_still_open(tmp_path):
    """A store written by an earlier version (no sampled hash, a COMPLETE with the count only)."""
    path = tmp_path / "old"
    build_store(path, _docs(20), separator_id=0, vocab_size=1000)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["content_sample"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path / COMPLETE).write_text(f"{manifest['num_tokens']}\n")
    assert TokenStore.open(path).manifest["num_documents"] == 20


# ------------------------------------------------------------------------------------ interrupted builds
_KILLED_BUILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from mdlmpe_ds.data.token_store import open_or_build

    path, flag = Path(sys.argv[1]), Path(sys.argv[2])

    def docs():
        for i in range(10**9):
            if i == 5000:
                flag.write_text("writing")  # a flushed part of tokens.bin is on disk by now
                time.sleep(600)
            yield list(range(i % 50, i % 50 + 900))

    open_or_build(path, docs, separator_id=0, vocab_size=1000)
    """
)


def _docs(n=300):
    return [list(range(i % 50, i % 50 + 40)) for i in range(n)]


def test_sigkill_mid_build_is_detected_and_rebuilt(tmp_path):
    path, flag = tmp_path / "stores" / "store-x", tmp_path / "flag"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_BUILD, str(path), str(flag)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None, "the builder exited before it was killed"
            assert time.monotonic() < deadline, "the builder never reached the middle of its build"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    staged = list(path.parent.glob(".store-x.staging-*"))
    assert len(staged) == 1 and (staged[0] / "tokens.bin").stat().st_size > 0  # half-written
    assert not path.exists()
    with pytest.raises(StoreError, match="incomplete"):
        TokenStore.open(staged[0])  # never used: no COMPLETE marker
    logs: list[str] = []
    store = open_or_build(path, _docs, separator_id=0, vocab_size=1000, log=logs.append)
    assert any("interrupted build" in m and str(staged[0]) in m for m in logs)
    assert not staged[0].exists() and (path / COMPLETE).is_file()
    fresh = build_store(tmp_path / "fresh", _docs(), separator_id=0, vocab_size=1000)
    assert np.array_equal(store.tokens, fresh.tokens) and np.array_equal(store.doc_ends, fresh.doc_ends)
    # A store directory without COMPLETE (copied in half, say) is rebuilt too, never read.
    (path / COMPLETE).unlink()
    store = open_or_build(path, lambda: _docs(10), separator_id=0, vocab_size=1000)
    assert store.manifest["num_documents"] == 10
    # A complete store is opened as it is: a resume does not rebuild.
    assert open_or_build(path, lambda: 1 / 0, separator_id=0, vocab_size=1000).manifest["num_documents"] == 10


# ------------------------------------------------------------------------------------ hub streaming
def test_streaming_build_equals_non_streaming_build(hub, gpt2, tmp_path, monkeypatch):
    monkeypatch.setitem(
        named.HUB_CORPORA, "openwebtext", dataclasses.replace(named.HUB_CORPORA["openwebtext"], heldout=40)
    )
    kw = {"role": "train", "separator_id": None}
    # Streamed and tokenised by 2 worker processes vs downloaded and tokenised here: the same store.
    streamed = load_packed_corpus(
        "openwebtext", gpt2, 32, cache_dir=tmp_path / "a", streaming=True, workers=2, **kw
    )
    loaded = load_packed_corpus(
        "openwebtext", gpt2, 32, cache_dir=tmp_path / "b", streaming=False, workers=1, **kw
    )
    assert np.array_equal(streamed.stream, loaded.stream) and np.array_equal(
        streamed.doc_ends, loaded.doc_ends
    )
    assert streamed.store.manifest["packed_fingerprint"] == loaded.store.manifest["packed_fingerprint"]
    # Held out: the first 40 rows score, the rest train; recorded in the manifest; nothing shared.
    rows = [p for p in named.hub_rows(str(hub / "Skylion007/openwebtext"), None, "train")]
    held = load_packed_corpus("openwebtext", gpt2, 32, cache_dir=tmp_path / "a", role="eval")
    source = held.store.manifest["source"]
    assert source["rows"] == [0, 40] and source["heldout"] == {"first_rows": 40, "of_split": "train"}
    assert streamed.store.manifest["source"]["rows"] == [40, None]
    assert held.doc_ends.size == sum(1 for r in rows[:40] if r["text"].strip())
    assert streamed.doc_ends.size == sum(1 for r in rows[40:] if r["text"].strip())
    first_train = gpt2(rows[40]["text"], add_special_tokens=False)["input_ids"]
    assert streamed.stream[: len(first_train)].tolist() == first_train


def test_prepare_command_builds_the_stores_a_run_maps(hub, assets, tmp_path, monkeypatch, capsys):
    """``python launch/prepare_data.py corpus`` ahead of a run: the run's own calls (as
    pretraining.py makes them) find both stores and build nothing."""
    spec = importlib.util.spec_from_file_location("launch_prepare_data", REPO / "launch" / "prepare_data.py")
    prepare_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare_data)

    monkeypatch.setitem(
        named.HUB_CORPORA, "openwebtext", dataclasses.replace(named.HUB_CORPORA["openwebtext"], heldout=40)
    )
    tok_dir = str(assets("gpt2_tokenizer").gpt2_tokenizer_dir)
    stores = tmp_path / "stores"
    assert (
        prepare_data.main(["corpus", "openwebtext", "--tokenizer", tok_dir, "--store_dir", str(stores)]) == 0
    )
    assert (
        "openwebtext (train)" in capsys.readouterr().out and len(list(stores.glob("store-*/COMPLETE"))) == 2
    )
    monkeypatch.setattr("mdlmpe_ds.data.token_store.build_store", lambda *a, **k: pytest.fail("rebuilt"))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    train = load_packed_corpus("openwebtext", tok, 1024, text_column="text", cache_dir=stores, role="train")
    held = load_packed_corpus("openwebtext", tok, 1024, cache_dir=stores, role="eval")
    assert train.store.manifest["source"]["rows"] == [40, None] and held.store.manifest["source"]["rows"] == [
        0,
        40,
    ]


# ------------------------------------------------------------------------------------ named corpora
def test_named_corpora_resolve_offline_with_their_splits_and_detokenizers(hub, gpt2, assets):
    wiki = [t for t in named.selection_texts(named.select("wikitext-103", "eval"))]
    raw_test = [
        ln for ln in assets("enwiki_excerpt").enwiki_excerpt("test").read_text().split("\n") if ln.strip()
    ]
    assert len(wiki) == len(raw_test) and wiki[0] == named.wikitext_detokenize(raw_test[0] + "\n")
    valid = named.select("wikitext-2@validation", "eval")
    assert (valid.split, valid.corpus.config) == ("validation", "wikitext-2-raw-v1")
    assert named.select("wikitext-2", "train").split == "train"
    lm1b = named.select("lm1b", "eval")
    assert lm1b.split == "test" and lm1b.corpus.revision == "refs/convert/parquet"  # hub only: local has none
    news = [ln for ln in assets("news_excerpt").news_excerpt("test").read_text().split("\n") if ln]
    assert list(named.selection_texts(lm1b)) == [named.lm1b_detokenize(t) for t in news]
    text8 = load_packed_corpus("text8", gpt2, 16)
    assert text8.doc_ends.size == 1 and len(text8) > 10
    with pytest.raises(ValueError, match="has no split 'dev'"):
        named.select("wikitext-2@dev", "eval")
    # PTB (offline, real splits) is detokenized the customary way.
    ptb = load_packed_corpus("ptb", gpt2, 64)
    text = gpt2.decode(ptb.stream[:2000].tolist())
    assert " n't" not in text and "<unk>" not in text and ptb.doc_ends.size > 3000


def test_named_hub_corpus_without_its_local_copy_names_the_directory(tmp_path, monkeypatch, gpt2):
    monkeypatch.setenv(named.HUB_DATASETS_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"Salesforce/wikitext.*expected the directory"):
        load_packed_corpus("wikitext-2", gpt2, 16)


def test_detokenizers_follow_the_zero_shot_conventions():
    assert named.wikitext_detokenize(" = = Early life = = \n") == " == Early life ==\n"
    assert named.wikitext_detokenize("the 1 @,@ 000 @-@ year old ( born 1900 ) , he said") == (
        "the 1,000-year old (born 1900), he said"
    )
    assert named.ptb_detokenize("it does n't cost $ N N a share <unk>") == "it doesn't cost $1 1 a share ?"
    assert named.lm1b_detokenize('He said " yes " , and it \'s http : / / x.org .') == (
        'He said "yes", and it\'s http://x.org .'
    )


def test_build_reads_documents_in_bounded_memory(tmp_path):
    """The writer flushes as it goes: a build consumes a generator without holding the corpus."""
    seen = []

    def docs():
        for i in range(2000):
            seen.append(i)
            yield [1] * 3000

    store = build_store(tmp_path / "big", docs(), separator_id=0, vocab_size=10)
    assert store.manifest["num_tokens"] == 2000 * 3001 and len(seen) == 2000
    manifest = json.loads((tmp_path / "big" / "manifest.json").read_text())
    assert manifest["num_documents"] == 2000 and manifest["dtype"] == "uint16"
    ds = PackedTokenDataset.from_store(store, 1000)
    assert len(ds) == 2000 * 3001 // 1000 and ds[5]["input_ids"].tolist()[:2] == [1, 1]
