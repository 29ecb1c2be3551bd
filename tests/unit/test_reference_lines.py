"""Reference lines of the layout evaluation (evaluation/reference_lines.py) and the two knockouts
added beside the layout ones (evaluation/knockout.py): the bigram line reads the *clean* left
neighbour, the unigram line is context-free, the context knockout keeps the layout and moves only
the visible tokens, and MDLMPE off gives the RoPE backbone's logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mdlmpe_ds.data.packing import PackedTokenDataset
from mdlmpe_ds.experiments import reference_lines
from mdlmpe_ds.experiments.knockout import mdlmpe_off, shuffle_context
from mdlmpe_ds.experiments.layout_eval import LayoutEvalSettings, ratio_se
from mdlmpe_ds.models.presets import preset
from mdlmpe_ds.models.transformer import DiffusionLM

V, L, MASK = 16, 24, 15


def _cyclic_windows(n: int, offset: int = 0) -> list[dict]:
    """Windows where each token is the previous one plus 1 (mod V - 1, so the mask id never occurs)."""
    return [{"input_ids": (torch.arange(L) + i + offset) % (V - 1), "index": i} for i in range(n)]


def _packed(windows: list[dict]) -> PackedTokenDataset:
    """The windows as one packed stream (window i = stream tokens [i L, (i + 1) L))."""
    stream = torch.cat([w["input_ids"] for w in windows]).numpy().astype(np.uint16)  # a store's dtype
    return PackedTokenDataset(stream, np.array([stream.size]), L, separator_id=0)


def test_ngram_tables_and_the_bigram_reads_the_clean_neighbour():
    log_uni, log_bi = reference_lines.ngram_log_probs(_packed(_cyclic_windows(40)), V)
    assert torch.allclose(log_uni.exp().sum(), torch.tensor(1.0, dtype=torch.float64))
    assert int(log_bi[3].argmax()) == 4 and log_bi[3, 4].exp() > 0.8  # the learned successor
    windows = _cyclic_windows(8, offset=5)
    batches = []
    for s in range(0, 8, 4):
        items = windows[s : s + 4]
        ids = torch.stack([w["input_ids"] for w in items])
        valid = torch.ones_like(ids, dtype=torch.bool)
        batches.append({"input_ids": ids, "valid": valid, "index": torch.arange(s, s + 4), "maskable": valid})
    settings = LayoutEvalSettings(seq_len=L, windows=8, draws=2, layouts=("iid", "spans"), batch_size=4)
    scores = reference_lines.reference_scores(batches, MASK, settings, log_uni, log_bi)
    for layout in settings.layouts:
        uni, _ = ratio_se(scores["unigram"][layout].loss, scores["unigram"][layout].tokens)
        bi, _ = ratio_se(scores["bigram"][layout].loss, scores["bigram"][layout].tokens)
        # Tokens are near-uniform over V - 1 symbols: the unigram line sits near log(V - 1); with the
        # clean neighbour the next token is certain, even where the neighbour itself is masked.
        assert abs(uni - math.log(V - 1)) < 0.25, (layout, uni)
        assert bi < 0.25 * uni, (layout, bi, uni)


def test_ngram_fit_counts_in_chunks_stops_at_its_token_cap_and_never_pairs_across_windows(monkeypatch):
    """The fit reads a corpus a chunk of windows at a time (OpenWebText's store does not fit in
    memory as int64): chunked counts equal one-pass counts; ``max_tokens`` keeps the first windows
    only; the last token of a window is never the left neighbour of the next window's first."""
    rng = torch.Generator().manual_seed(0)
    windows = [{"input_ids": torch.randint(0, V - 1, (L,), generator=rng), "index": i} for i in range(23)]
    ids = torch.stack([w["input_ids"] for w in windows])  # [23, L]
    counts = torch.bincount(ids.flatten(), minlength=V).double() + reference_lines.SMOOTHING
    pairs = torch.zeros(V, V, dtype=torch.float64)
    for row in ids:
        for a, b in zip(row[:-1].tolist(), row[1:].tolist(), strict=True):
            pairs[a, b] += 1
    pairs += reference_lines.SMOOTHING
    monkeypatch.setattr(reference_lines, "FIT_CHUNK_WINDOWS", 5)  # 23 windows: five chunks, one short
    log_uni, log_bi = reference_lines.ngram_log_probs(_packed(windows), V)
    torch.testing.assert_close(log_uni, (counts / counts.sum()).log(), rtol=0, atol=1e-12)
    torch.testing.assert_close(log_bi, (pairs / pairs.sum(-1, keepdim=True)).log(), rtol=0, atol=1e-12)
    first = torch.bincount(ids[:7].flatten(), minlength=V).double() + reference_lines.SMOOTHING
    capped, _ = reference_lines.ngram_log_probs(_packed(windows), V, max_tokens=7 * L + L - 1)
    torch.testing.assert_close(capped, (first / first.sum()).log(), rtol=0, atol=1e-12)
    big, none = reference_lines.ngram_log_probs(_packed(windows), reference_lines.BIGRAM_MAX_VOCAB + 1)
    assert none is None and big.shape == (reference_lines.BIGRAM_MAX_VOCAB + 1,)
    with pytest.raises(ValueError, match=f"token id {int(ids.max())} >= vocab 3"):
        reference_lines.ngram_log_probs(_packed(windows), 3)


def test_context_knockout_keeps_the_layout_and_permutes_visible_tokens():
    ids = torch.tensor([[1, MASK, 2, 3, MASK, 4, 5, 0], [6, 7, MASK, 8, 9, 10, MASK, 11]])
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[0, -1] = False
    out = shuffle_context(ids, valid, MASK, torch.Generator().manual_seed(0))
    assert torch.equal(out == MASK, ids == MASK)  # the mask layout is untouched
    assert out[0, -1] == 0  # padding untouched
    for row in range(2):
        keep = (ids[row] != MASK) & valid[row]
        assert sorted(out[row, keep].tolist()) == sorted(ids[row, keep].tolist())
    assert not torch.equal(out, ids)


def test_mdlmpe_off_gives_the_rope_backbone_logits():
    torch.manual_seed(0)
    mdl = DiffusionLM(preset("llada-tiny", position_encoding="mdlmpe", max_seq_len=L)).eval()
    torch.manual_seed(0)
    rope = DiffusionLM(preset("llada-tiny", max_seq_len=L)).eval()
    with torch.no_grad():
        for layer in mdl.layers:
            layer.attn.phase.fc2.weight.normal_(0, 0.5)
    ids = torch.randint(0, 500, (2, L), generator=torch.Generator().manual_seed(1))
    ids[:, ::3] = mdl.config.mask_token_id
    with torch.no_grad():
        before = mdl(ids)
        assert (before - rope(ids)).abs().max() > 1e-3
        with mdlmpe_off(mdl):
            torch.testing.assert_close(mdl(ids), rope(ids), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mdl(ids), before, atol=0, rtol=0)
