"""Diffusion-ELBO perplexity of trained models on text corpora, as a table (markdown + JSON).

Each corpus (``data/corpora.py``) is tokenised with the model's own tokenizer, packed into windows
of ``seq_len`` tokens, and the first ``max_sequences`` windows are scored with
``diffusion/elbo.diffusion_elbo``: ``num_samples`` (t, mask) draws per window that depend only on
(seed, window index, sample), so two models with the same tokenizer are scored on exactly the same
tokens and masks. Every estimate carries its token count and Monte-Carlo standard error.
Perplexities of models with different tokenizers are per token of their own tokenization and are not
comparable with each other.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mdlmpe_ds.data.corpora import load_packed_corpus
from mdlmpe_ds.data.packing import packed_collate
from mdlmpe_ds.diffusion.elbo import diffusion_elbo, scored_positions


@dataclass(frozen=True)
class EvalSettings:
    seq_len: int = 128
    max_sequences: int = 64
    num_samples: int = 8
    seed: int = 0
    t_sampling: str = "antithetic"
    batch_size: int = 8
    eps: float = 1e-3


@dataclass(frozen=True)
class CorpusScore:
    model: str
    corpus: str
    nll: float  # ELBO bound on the NLL, nats per token
    stderr: float  # Monte-Carlo standard error of nll
    perplexity: float
    ppl_low: float  # exp(nll - 2 stderr)
    ppl_high: float  # exp(nll + 2 stderr)
    tokens: int
    sequences: int
    samples: int


def window_batches(
    corpus: str, tokenizer, seq_len: int, windows: int, batch_size: int, family: str, cache_dir=None
) -> list[dict]:
    """The first ``windows`` packed ``seq_len``-token windows of ``corpus``, in batches of
    ``batch_size``, each with the positions a ``family`` model is scored on (``maskable``).
    ``cache_dir``: tokenise the corpus once into a token store there (the same ids; a hub corpus
    such as OpenWebText's held-out slice is then built once, in parallel, not per call)."""
    packed = load_packed_corpus(corpus, tokenizer, seq_len, cache_dir=cache_dir)
    n = min(windows, len(packed))
    if n == 0:
        raise ValueError(f"corpus {corpus!r} is shorter than one {seq_len}-token window")
    items = [packed[i] for i in range(n)]
    batches = []
    for i in range(0, n, batch_size):
        batch = packed_collate(items[i : i + batch_size])
        batch["maskable"] = scored_positions(batch["valid"], family)
        batches.append(batch)
    return batches


def score_corpus(model, tokenizer, corpus: str, settings: EvalSettings, name: str = "model") -> CorpusScore:
    """The ELBO perplexity of ``model`` (a DiffusionLM in eval mode) on ``corpus``."""
    batches = window_batches(
        corpus, tokenizer, settings.seq_len, settings.max_sequences, settings.batch_size, model.config.family
    )
    device = next(model.parameters()).device

    def logits(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return model(ids.to(device), valid=valid.to(device))

    result = diffusion_elbo(
        logits, batches, model.config.mask_token_id, settings.num_samples, settings.seed,
        eps=settings.eps, t_sampling=settings.t_sampling,
    )  # fmt: skip
    low, high = result.perplexity_interval
    return CorpusScore(
        model=name,
        corpus=corpus,
        nll=result.nll_per_token,
        stderr=result.stderr,
        perplexity=result.perplexity,
        ppl_low=low,
        ppl_high=high,
        tokens=result.num_tokens,
        sequences=result.num_sequences,
        samples=result.num_samples,
    )


def markdown_table(scores: list[CorpusScore]) -> str:
    """Models as rows, corpora as columns: ``ppl (± 2 s.e. interval)``, plus the tokens per corpus."""
    models = list(dict.fromkeys(s.model for s in scores))
    corpora = list(dict.fromkeys(s.corpus for s in scores))
    cell = {(s.model, s.corpus): s for s in scores}
    lines = [
        "| model | " + " | ".join(corpora) + " |",
        "|---|" + "---|" * len(corpora),
    ]
    for m in models:
        row = []
        for c in corpora:
            s = cell.get((m, c))
            row.append("–" if s is None else f"{s.perplexity:.2f} [{s.ppl_low:.2f}, {s.ppl_high:.2f}]")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    tokens = []
    for c in corpora:
        counts = sorted({cell[(m, c)].tokens for m in models if (m, c) in cell})
        tokens.append("/".join(str(t) for t in counts))
    lines.append("| tokens scored | " + " | ".join(tokens) + " |")
    return "\n".join(lines)


def write_results(
    scores: list[CorpusScore], settings: EvalSettings, out_prefix: str | Path
) -> tuple[Path, Path]:
    """``<prefix>.md`` (the table and the settings) and ``<prefix>.json`` (every number)."""
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    md = out_prefix.with_suffix(".md")
    js = out_prefix.with_suffix(".json")
    note = (
        f"Diffusion-ELBO perplexity bound (lower is better); [ ] = exp(nll ± 2 Monte-Carlo s.e.). "
        f"{settings.num_samples} draws per window ({settings.t_sampling} t, seed {settings.seed}), "
        f"first {settings.max_sequences} windows of {settings.seq_len} tokens per corpus."
    )
    md.write_text(markdown_table(scores) + "\n\n" + note + "\n")
    js.write_text(
        json.dumps({"settings": asdict(settings), "scores": [asdict(s) for s in scores]}, indent=1) + "\n"
    )
    return md, js
