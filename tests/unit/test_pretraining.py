"""Pretraining pieces that need no process group: corpora, the launcher's defaults and recipe, the
index-keyed corruption, the cached SentencePiece tokenizer, perplexity tables and the comparison's
aggregation. The 2-process runs are in tests/dist/test_pretrain.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from mdlmpe_ds.config.cli import build_config
from mdlmpe_ds.config.recipes import PAPER_GLOBAL_BATCH, pretrain_config
from mdlmpe_ds.data.corpora import NAMED_CORPORA, corpus_text_files, load_packed_corpus
from mdlmpe_ds.diffusion.elbo import scored_positions
from mdlmpe_ds.evaluation.perplexity import CorpusScore, EvalSettings, markdown_table, score_corpus
from mdlmpe_ds.experiments.compare import ENCODINGS, aggregate, bar_chart, pretrain_command, summary_markdown
from mdlmpe_ds.runs.pretrain_run import sentencepiece_for_corpus
from mdlmpe_ds.tasks.pretrain import pretrain_corruption

TEXT = "the cat sat on the mat\nthe dog sat on the log\n\nfour more words here\n"


class WhitespaceTokenizer:
    """Ids = word ranks in a fixed vocabulary: enough for packing tests (eos 0, mask 1)."""

    eos_token_id = 0

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def __call__(self, texts, add_special_tokens=False):
        ids = [[self.vocab.setdefault(w, len(self.vocab) + 2) for w in t.split()] for t in texts]
        return {"input_ids": ids}


# ------------------------------------------------------------------------------------ corpora
def test_local_text_corpora_and_errors(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXT)
    b.write_text("one two three\n")
    tok = WhitespaceTokenizer()
    by_line = load_packed_corpus(str(a), tok, 4, split="line")
    assert by_line.doc_ends.size == 3  # three non-empty lines, each followed by the separator
    by_file = load_packed_corpus(f"{a},{b}", tok, 4)
    assert by_file.doc_ends.size == 2  # default: one document per file
    folder = load_packed_corpus(str(tmp_path), tok, 4)
    assert folder.stream.tolist() == by_file.stream.tolist()  # a directory = its *.txt, sorted
    assert corpus_text_files(str(tmp_path)) == [a, b]
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        load_packed_corpus(str(tmp_path / "missing.txt"), tok, 4)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_packed_corpus("./nowhere/corpus", tok, 4)
    with pytest.raises(ValueError, match="text split"):
        load_packed_corpus(str(a), tok, 4, split="sentence")


def test_packed_corpus_cache_keyed_by_source_tokenizer_and_options(tmp_path, monkeypatch):
    """A restart (or a node's other ranks) maps the token store instead of tokenising again; the
    window length only cuts the stream, so it shares the entry; other options or files do not."""
    import sys

    from transformers import AutoTokenizer

    from mdlmpe_ds.data import packing as pretrain

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
    from sft_fixtures import make_tokenizer

    tok = AutoTokenizer.from_pretrained(make_tokenizer(tmp_path / "tok"))
    corpus, cache = tmp_path / "c.txt", tmp_path / "cache"
    corpus.write_text("what is the color of the sky\n\nit is blue\n\nhow many legs does a cat have\n")
    first = load_packed_corpus(str(corpus), tok, 4, split="paragraph", cache_dir=cache)
    assert len(list(cache.glob("store-*/COMPLETE"))) == 1 and first.doc_ends.size == 3

    def no_tokenising(*args, **kwargs):
        raise AssertionError("a cache hit tokenised the corpus again")

    with monkeypatch.context() as patch:
        patch.setattr(pretrain, "token_documents", no_tokenising)
        again = load_packed_corpus(str(corpus), tok, 3, split="paragraph", cache_dir=cache)
    assert again.stream.tolist() == first.stream.tolist() and again.seq_len == 3
    assert again.doc_ends.tolist() == first.doc_ends.tolist() and again.separator_id == first.separator_id
    assert load_packed_corpus(str(corpus), tok, 4, split="line", cache_dir=cache).doc_ends.size == 3
    assert len(list(cache.glob("store-*/COMPLETE"))) == 2  # another document convention: another entry
    corpus.write_text("it is blue\n")
    assert load_packed_corpus(str(corpus), tok, 4, split="paragraph", cache_dir=cache).doc_ends.size == 1
    assert len(list(cache.glob("store-*/COMPLETE"))) == 3 and not list(cache.glob(".*staging*"))


def test_jsonl_corpus_reads_the_text_column(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"body": t}) for t in ("a b c", "d e", "f g h i")) + "\n")
    packed = load_packed_corpus(str(path), WhitespaceTokenizer(), 3, text_column="body")
    assert packed.doc_ends.tolist() == [4, 7, 12]
    with pytest.raises(KeyError, match="text"):
        load_packed_corpus(str(path), WhitespaceTokenizer(), 3)


def test_named_corpora_follow_their_document_convention(assets):
    assets("ptb")
    tok = WhitespaceTokenizer()
    ptb = load_packed_corpus("ptb", tok, 64)
    lines = [ln for ln in corpus_text_files("ptb")[0].read_text().split("\n") if ln.strip()]
    assert ptb.doc_ends.size == len(lines)  # one separator per PTB sentence
    assert set(NAMED_CORPORA) >= {"ptb", "enwiki-excerpt", "news-excerpt", "shakespeare-heldout"}


# ------------------------------------------------------------------------------------ launcher defaults
@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
def test_paper_recipe_keeps_global_batch_16(world):
    d = pretrain_config("llada-100m", world).flat()
    assert d["train.micro_batch_size"] * d["train.grad_accum"] * world == PAPER_GLOBAL_BATCH
    assert (d["optim.lr"], d["optim.betas"], d["optim.weight_decay"]) == (1e-4, (0.9, 0.999), 0.01)
    assert (d["optim.warmup_steps"], d["data.max_len"], d["train.head_schedule"]) == (2000, 1024, False)


def test_recipe_rejects_a_world_that_does_not_split_the_batch():
    with pytest.raises(ValueError, match="global batch 16"):
        pretrain_config("dream-100m", 3)


def test_launcher_defaults_sit_under_file_and_flags(tmp_path):
    defaults = pretrain_config(None, 2)
    run = build_config(None, ["--max_steps", "7"], defaults=defaults)
    assert run.data.dataset == "shakespeare" and run.train.max_steps == 7
    assert run.train.head_schedule is False  # MDLMPE on every head from the first update
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"data": {"max_len": 64}, "train": {"eval_every": 5}}))
    run = build_config(str(cfg), ["--eval_every", "3"], defaults=defaults)
    assert (run.data.max_len, run.train.eval_every) == (64, 3)
    with pytest.raises(ValueError, match=r"data\.text_split"):
        build_config(None, ["--text_split", "sentences"], defaults=defaults)


# ------------------------------------------------------------------------------------ corruption
def _batch(index, epoch, length=32):
    ids = torch.arange(len(index) * length).view(len(index), length) % 50 + 5
    return {
        "input_ids": ids,
        "valid": torch.ones_like(ids, dtype=torch.bool),
        "index": torch.tensor(index),
        "epoch": epoch,
    }


def test_corruption_is_keyed_by_window_and_epoch_only():
    noisy, masked, p = pretrain_corruption(_batch([3, 9], 0), seed=5, eps=1e-3, mask_id=1, family="llada")
    # The same window in another batch, at another batch position, gives the same mask.
    _, again, p_again = pretrain_corruption(_batch([7, 9, 3], 0), 5, 1e-3, 1, "llada")
    assert torch.equal(again[2], masked[0]) and torch.equal(again[1], masked[1])
    assert p_again[2] == p[0]
    assert torch.equal(noisy[masked], torch.ones(int(masked.sum()), dtype=torch.long))
    assert torch.equal(noisy[~masked], _batch([3, 9], 0)["input_ids"][~masked])
    # Another epoch or seed draws anew; eps bounds p from below.
    _, other_epoch, _ = pretrain_corruption(_batch([3, 9], 1), 5, 1e-3, 1, "llada")
    _, other_seed, _ = pretrain_corruption(_batch([3, 9], 0), 6, 1e-3, 1, "llada")
    assert not torch.equal(other_epoch, masked) and not torch.equal(other_seed, masked)
    assert bool((p >= 1e-3).all()) and bool((p <= 1).all())


def test_masking_rate_follows_p():
    batch = _batch(list(range(400)), 0, length=64)
    _, masked, p = pretrain_corruption(batch, 0, 1e-3, 1, "llada")
    rate = masked.float().mean(1)  # [B]
    assert abs(float((rate - p).mean())) < 0.01  # E[masked fraction | p] = p
    assert abs(float(p.mean()) - 0.5) < 0.05  # t ~ U[0, 1)


def test_dream_never_masks_position_zero():
    _, masked, _ = pretrain_corruption(_batch(list(range(64)), 0), 0, 0.5, 1, "dream")
    assert not bool(masked[:, 0].any()) and bool(masked[:, 1:].any())
    assert scored_positions(torch.ones(2, 4, dtype=torch.bool), "llada").all()


# ------------------------------------------------------------------------------------ tokenizer cache
def test_sentencepiece_tokenizer_is_cached_by_content(tmp_path, assets):
    corpus = assets("botchan").botchan
    first = sentencepiece_for_corpus(str(corpus), 400, cache_root=tmp_path)
    stamp = (first / "tokenizer.json").stat().st_mtime_ns
    assert sentencepiece_for_corpus(str(corpus), 400, cache_root=tmp_path) == first
    assert (first / "tokenizer.json").stat().st_mtime_ns == stamp  # reused, not retrained
    copy = tmp_path / "changed.txt"
    copy.write_text(corpus.read_text()[:50000] + "\nsomething new\n")
    assert sentencepiece_for_corpus(str(copy), 400, cache_root=tmp_path) != first
    assert not list((tmp_path / "tokenizers").glob(".*tmp*"))  # no half-written directories left


def test_sentencepiece_copy_finished_by_another_node_is_kept(tmp_path, monkeypatch):
    """Nodes sharing the cache train the same tokenizer at once (each node's first rank builds):
    a copy another node renamed into place while this one trained is kept, no error, no leftovers."""
    import mdlmpe_ds.runs.pretrain_run as tokenizers  # the run calls train_sentencepiece from here

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out_name = []

    def train(files, vocab, out_dir, *args, **kwargs):  # this node's training ...
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True)
        (out_dir / "tokenizer.json").write_text("this node")
        other = out_dir.parent / out_dir.name.split(".tmp-")[0].lstrip(".")
        other.mkdir()  # ... while the other node finishes first
        (other / "tokenizer.json").write_text("other node")
        out_name.append(other.name)

    monkeypatch.setattr(tokenizers, "train_sentencepiece", train)
    out = sentencepiece_for_corpus(str(corpus), 64, cache_root=tmp_path)
    assert out.name == out_name[0] and (out / "tokenizer.json").read_text() == "other node"
    assert not list((tmp_path / "tokenizers").glob(".*tmp*"))


# ------------------------------------------------------------------------------------ perplexity tables
def _score(model, corpus, ppl, tokens=100, stderr=0.01):
    nll = math.log(ppl)
    return CorpusScore(
        model, corpus, nll, stderr, ppl, math.exp(nll - 2 * stderr), math.exp(nll + 2 * stderr), tokens, 4, 8
    )


def test_markdown_table_lists_models_corpora_and_tokens():
    table = markdown_table([_score("a", "ptb", 10.0), _score("b", "ptb", 12.5), _score("a", "news", 3.0)])
    lines = table.splitlines()
    assert lines[0] == "| model | ptb | news |"
    assert lines[2].startswith("| a | 10.00 [") and lines[3].endswith("| – |")
    assert lines[-1] == "| tokens scored | 100 | 100 |"


def test_aggregate_gives_mean_and_std_over_seeds_and_bolds_the_best(tmp_path):
    scores = [
        _score("rope/seed0", "ptb", 10.0),
        _score("rope/seed1", "ptb", 14.0),
        _score("mdlmpe/seed0", "ptb", 9.0),
        _score("mdlmpe/seed1", "ptb", 11.0),
    ]
    table = aggregate(scores)
    assert table["rope"]["ptb"]["mean"] == pytest.approx(12.0)
    assert table["rope"]["ptb"]["std"] == pytest.approx(math.sqrt(8.0))  # sample std of 10, 14
    assert table["mdlmpe"]["ptb"]["n"] == 2
    md = summary_markdown(table, ["ptb"])
    assert "| mdlmpe | **10.00 ± 1.41** |" in md and "| rope | 12.00 ± 2.83 |" in md
    png = bar_chart(table, ["ptb"], tmp_path / "c.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pretrain_command_changes_only_the_position_module():
    base = ["--max_steps", "5"]
    rope = pretrain_command(["python"], "rope", 1, Path("o/r"), "ds.json", base)
    full = pretrain_command(["python"], "mdlmpe-binary", 1, Path("o/m"), "ds.json", base)
    assert rope[rope.index("--position_encoding") + 1] == "rope"
    spec = json.loads(full[full.index("--model.mdlmpe") + 1])
    assert spec == ENCODINGS["mdlmpe-binary"]["mdlmpe"]
    for cmd in (rope, full):
        assert cmd[cmd.index("--seed") + 1] == "1" and cmd[-2:] == ["--resume", "auto"]
    with pytest.raises(ValueError, match="unknown encoding"):
        pretrain_command(["python"], "xpos", 1, Path("o"), "ds.json", base)


def _tiny_model_setup(assets, tmp_path, name: str):
    """A 400-piece SentencePiece tokenizer of Botchan and a tiny preset sized for it (L = 32)."""
    from transformers import AutoTokenizer

    from mdlmpe_ds.models.presets import preset

    tok_dir = sentencepiece_for_corpus(str(assets("botchan").botchan), 400, cache_root=tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    config = preset(
        name, vocab_size=448, mask_token_id=tokenizer.mask_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, max_seq_len=32,
    )  # fmt: skip
    return tokenizer, config


def test_score_corpus_uses_the_same_masks_for_every_model(tmp_path, assets):
    """One model scores the same whatever the batch size; another model is scored on the same tokens."""
    from mdlmpe_ds.models.transformer import DiffusionLM

    corpus = assets("news_excerpt").news_excerpt("test")
    tokenizer, config = _tiny_model_setup(assets, tmp_path, "llada-tiny")
    torch.manual_seed(0)
    model = DiffusionLM(config).eval()
    settings = EvalSettings(seq_len=32, max_sequences=6, num_samples=4, batch_size=4)
    a = score_corpus(model, tokenizer, str(corpus), settings, "a")
    b = score_corpus(model, tokenizer, str(corpus), dataclasses.replace(settings, batch_size=6), "b")
    assert a.nll == pytest.approx(b.nll, rel=1e-6) and a.tokens == b.tokens == 6 * 32
    assert a.ppl_low < a.perplexity < a.ppl_high
    # An untrained model is close to uniform over the vocabulary (paper-free sanity bound).
    assert 0.5 * 448 < a.perplexity < 2.0 * 448
    torch.manual_seed(1)
    other = score_corpus(DiffusionLM(config).eval(), tokenizer, str(corpus), settings, "other")
    assert other.tokens == a.tokens and other.nll != a.nll


def test_evaluate_cli_writes_markdown_and_json(tmp_path, assets):
    """launch/evaluate.py on two exported directories of one model: identical rows (same masks)."""
    import importlib.util

    from mdlmpe_ds.models.hf_io import save_pretrained
    from mdlmpe_ds.models.transformer import DiffusionLM

    tokenizer, config = _tiny_model_setup(assets, tmp_path, "dream-tiny")
    model = DiffusionLM(config)
    dirs = []
    for name in ("first", "second"):
        save_pretrained(model, tmp_path / name, config)
        tokenizer.save_pretrained(str(tmp_path / name))
        dirs.append(str(tmp_path / name))
    spec = importlib.util.spec_from_file_location(
        "evaluate_cli", Path(__file__).parents[2] / "launch" / "evaluate.py"
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "ppl"
    args = [*dirs, "--corpora", "botchan", "--max_sequences", "3", "--num_samples", "4", "--out", str(out)]
    assert cli.main(args) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    first, second = report["scores"]
    assert (first["model"], second["model"]) == ("first", "second")
    assert first["nll"] == second["nll"] and first["tokens"] == 3 * 31  # Dream: position 0 unscored
    assert report["settings"]["seq_len"] == 32 and report["settings"]["t_sampling"] == "antithetic"
    assert "| first |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize(("loss", "family"), [("dream", "llada"), ("llada", "dream"), ("auto", "dream")])
def test_a_loss_of_the_other_family_gets_masks_it_can_score(loss, family):
    """train.loss may pick the other family's loss: the corruption then never masks a position that
    loss cannot score (Dream's loss on a LLaDA model once stopped the run at its first update with
    'a masked position is not maskable')."""
    from types import SimpleNamespace

    from mdlmpe_ds.config.run import TrainConfig
    from mdlmpe_ds.diffusion.losses import dream_sft_loss, llada_pretrain_loss
    from mdlmpe_ds.tasks.pretrain import PretrainTask

    train = TrainConfig(loss=loss, dream_weighting="none", noise_eps=0.5)
    task = PretrainTask(train, SimpleNamespace(family=family, mask_token_id=1))
    batch = _batch(list(range(16)), 0)
    _, masked, p = task.corrupt(batch)
    assert not bool(masked[:, 0].any()) and bool(masked[:, 1:].any())
    logits = torch.randn(*batch["input_ids"].shape, 64)
    if task.loss_family == "dream":
        maskable = scored_positions(batch["valid"], "dream")
        loss_value, _ = dream_sft_loss(logits, batch["input_ids"], masked, p, maskable, weighting="none")
    else:
        loss_value, _ = llada_pretrain_loss(logits, batch["input_ids"], masked, p)
    assert torch.isfinite(loss_value)


def test_compare_reuses_a_run_only_if_it_finished_with_the_same_flags(tmp_path):
    """compare_pe.py reused a finished run by its summary.json alone: re-run with a larger
    --max_steps, it reported the new length for a run trained to the old one. A run is reused only
    when it finished with the same command; otherwise the command runs again (its --resume auto
    continues the run to the new length)."""
    import sys

    from mdlmpe_ds.experiments import compare

    calls = tmp_path / "calls.txt"
    fake = (  # a pretraining that records its flags and finishes
        "import sys, pathlib; args = sys.argv[1:]; "
        "out = pathlib.Path(args[args.index('--output_dir') + 1]); "
        f"open({str(calls)!r}, 'a').write(' '.join(args) + '\\n'); "
        "(out / 'summary.json').write_text('{}')"
    )
    launcher = [sys.executable, "-c", fake]

    def train(*flags):
        compare.train_all(["rope"], [0], tmp_path / "out", "ds.json", list(flags), launcher)
        return calls.read_text().splitlines()

    assert len(train("--max_steps", "2")) == 1
    assert len(train("--max_steps", "2")) == 1  # the same command: reused
    ran = train("--max_steps", "6")
    assert len(ran) == 2 and "--max_steps 6" in ran[-1]  # other flags: run again (resume auto)
    (compare.run_dir(tmp_path / "out", "rope", 0) / compare.COMMAND).unlink()  # a run from before the record
    assert len(train("--max_steps", "6")) == 3
