"""Reference lines of the layout evaluation (evaluation/reference_lines.py) and the two knockouts
added beside the layout ones (evaluation/knockout.py): the bigram line reads the *clean* left
neighbour, the unigram line is context-free, the context knockout keeps the layout and moves only
the visible tokens, and MDLMPE off gives the RoPE backbone's logits."""

from __future__ import annotations

import math

import torch

from mdlmpe_ds.experiments import reference_lines
from mdlmpe_ds.experiments.knockout import mdlmpe_off, shuffle_context
from mdlmpe_ds.experiments.layout_eval import LayoutEvalSettings, ratio_se
from mdlmpe_ds.models.presets import preset
from mdlmpe_ds.models.transformer import DiffusionLM

V, L, MASK = 16, 24, 15


def _cyclic_windows(n: int, offset: int = 0) -> list[dict]:
    """Windows where each token is the previous one plus 1 (mod V - 1, so the mask id never occurs)."""
    return [{"input_ids": (torch.arange(L) + i + offset) % (V - 1), "index": i} for i in range(n)]


def test_ngram_tables_and_the_bigram_reads_the_clean_neighbour(monkeypatch):
    monkeypatch.setattr(reference_lines, "load_packed_corpus", lambda *a, **k: _cyclic_windows(40))
    log_uni, log_bi = reference_lines.ngram_log_probs("train", None, L, V)
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
