"""Reference lines for a layout evaluation: what a model must beat before its result means anything.

Scored on exactly the windows, masks, noise levels and 1/p weights of ``layout_eval.score_layouts``:

* ``unigram``: a context-free model, p(token) from the training corpus (add-1/2 smoothing). A model
  at this level has not learned to use context, so neither positions nor the mask layout can matter
  to it, and a null knockout says nothing.
* ``bigram``: p(token | its clean left neighbour), the neighbour always visible even when masked:
  an optimistic one-token-context reference, out of reach for a heavily masked window; a model
  well below the unigram line but above this one uses little context.

Both are fitted on the training corpus tokenised by the run's own tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from mdlmpe_ds.data.corpora import load_packed_corpus
from mdlmpe_ds.experiments.layout_eval import LayoutEvalSettings, WindowScores, score_layouts

SMOOTHING = 0.5
BIGRAM_MAX_VOCAB = 8192  # a dense [V, V] table above this would not fit comfortably; skipped then


def ngram_log_probs(
    corpus: str, tokenizer, seq_len: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p_unigram [V] and log p_bigram [V, V] (row: previous token; None above BIGRAM_MAX_VOCAB)
    from every packed training window of ``corpus``."""
    packed = load_packed_corpus(corpus, tokenizer, seq_len, role="train")
    windows = torch.stack([packed[i]["input_ids"] for i in range(len(packed))])  # [N, L]
    if int(windows.max()) >= vocab_size:
        raise ValueError(
            f"reference lines: {corpus!r} has token id {int(windows.max())} >= vocab {vocab_size}"
        )
    unigram = torch.bincount(windows.flatten(), minlength=vocab_size).double() + SMOOTHING
    log_uni = (unigram / unigram.sum()).log()
    if vocab_size > BIGRAM_MAX_VOCAB:
        return log_uni, None
    pairs = windows[:, :-1] * vocab_size + windows[:, 1:]  # [N, L - 1]
    bigram = torch.bincount(pairs.flatten(), minlength=vocab_size * vocab_size).double().view(vocab_size, -1)
    bigram += SMOOTHING
    return log_uni, (bigram / bigram.sum(-1, keepdim=True)).log()


def reference_scores(
    batches: list[dict],
    mask_id: int,
    settings: LayoutEvalSettings,
    log_uni: torch.Tensor,
    log_bi: torch.Tensor | None,
) -> dict[str, dict[str, WindowScores]]:
    """``{"unigram": {layout: WindowScores}, "bigram": ...}`` on ``batches`` (score_layouts' own)."""
    out = {}

    def unigram(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return log_uni.float().expand(*ids.shape, -1)  # [B, L, V]

    out["unigram"] = score_layouts(unigram, batches, mask_id, settings)
    if log_bi is None:
        return out
    current: dict[str, torch.Tensor] = {}

    def tracked(items: Iterable[dict]) -> Iterator[dict]:
        for batch in items:  # score_layouts scores each batch right after taking it
            current["clean"] = batch["input_ids"]
            yield batch

    def bigram(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        clean = current["clean"]  # [B, L]: the left neighbour as it really is, never masked
        logits = log_bi.float()[clean[:, :-1]]  # [B, L - 1, V]
        first = log_uni.float().expand(clean.shape[0], 1, -1)  # no left neighbour: the unigram
        return torch.cat([first, logits], dim=1)

    out["bigram"] = score_layouts(bigram, tracked(batches), mask_id, settings)
    return out
