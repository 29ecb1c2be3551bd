"""Reference lines for a layout evaluation: what a model must beat before its result means anything.

Scored on exactly the windows, masks, noise levels and 1/p weights of ``layout_eval.score_layouts``:

* ``unigram``: a context-free model, p(token) from the training corpus (add-1/2 smoothing). A model
  at this level has not learned to use context, so neither positions nor the mask layout can matter
  to it, and a null knockout says nothing.
* ``bigram``: p(token | its clean left neighbour), the neighbour always visible even when masked:
  an optimistic one-token-context reference, out of reach for a heavily masked window; a model
  well below the unigram line but above this one uses little context.

Both are fitted on the run's own training windows (its corpus, split and tokenizer), their first
``REFERENCE_FIT_TOKENS`` tokens at most.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from mdlmpe_ds.data.packing import PackedTokenDataset
from mdlmpe_ds.experiments.layout_eval import LayoutEvalSettings, WindowScores, score_layouts

SMOOTHING = 0.5
BIGRAM_MAX_VOCAB = 8192  # a dense [V, V] table above this would not fit comfortably; skipped then
# Tokens the n-gram tables are fitted on at most (2^27, ~134M: ~1,000 per entry of LLaDA's 126k-id
# unigram table); a small corpus is fitted on all of its windows.
REFERENCE_FIT_TOKENS = 1 << 27
FIT_CHUNK_WINDOWS = 4096


def ngram_log_probs(
    windows: PackedTokenDataset, vocab_size: int, max_tokens: int = REFERENCE_FIT_TOKENS
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p_unigram [V] and log p_bigram [V, V] (row: previous token; None above BIGRAM_MAX_VOCAB)
    from the first ``max_tokens // L`` packed training windows (all when fewer), counted a chunk of
    windows at a time: memory stays at one chunk whatever the corpus (OpenWebText's token store
    holds ~9B ids). A bigram never pairs the last token of a window with the next window's first."""
    L = windows.seq_len
    n = min(len(windows), max(1, max_tokens // L))
    unigram = torch.zeros(vocab_size, dtype=torch.float64)
    bigram = (
        torch.zeros(vocab_size * vocab_size, dtype=torch.float64) if vocab_size <= BIGRAM_MAX_VOCAB else None
    )
    for start in range(0, n, FIT_CHUNK_WINDOWS):
        stop = min(n, start + FIT_CHUNK_WINDOWS)
        chunk = torch.from_numpy(np.asarray(windows.stream[start * L : stop * L], dtype=np.int64))
        chunk = chunk.view(stop - start, L)  # [n, L]
        top = int(chunk.max())
        if top >= vocab_size:
            raise ValueError(
                f"reference lines: the training windows hold token id {top} >= vocab {vocab_size}"
            )
        unigram += torch.bincount(chunk.flatten(), minlength=vocab_size)
        if bigram is not None:
            pairs = chunk[:, :-1] * vocab_size + chunk[:, 1:]  # [n, L - 1]
            bigram += torch.bincount(pairs.flatten(), minlength=vocab_size * vocab_size)
    unigram += SMOOTHING
    log_uni = (unigram / unigram.sum()).log()
    if bigram is None:
        return log_uni, None
    bigram = bigram.view(vocab_size, vocab_size) + SMOOTHING
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
