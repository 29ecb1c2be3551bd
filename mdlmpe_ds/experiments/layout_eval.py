"""Paired evaluation by corruption layout: the same windows and masks for every model.

For each window, draw ``k`` and layout (``diffusion/layouts.py``), the masks depend only on
(seed, window index, k), and the noise level of draw ``k`` is shared by all layouts (matched
density; ``t_sampling`` as in ``diffusion/elbo.py``). Per window and layout we keep

* ``loss``: ``sum_k sum_{scored} CE / p`` and ``tokens``: ``sum_k |scope|``; the layout's NLL per
  token is ``sum_w loss_w / sum_w tokens_w`` (the diffusion ELBO for iid, module doc of layouts.py
  for the others);
* per bucket of ``|local density - (1 - p)|`` (local density: the Gaussian-weighted visible fraction
  around a masked token, itself excluded, with the model length's MDLMPE window), the summed CE of
  the masked tokens in it and their count: where the layout around a token departs from the global
  level.

Uncertainty: windows are the independent units. A ratio ``R = sum_w x_w / sum_w n_w`` has the
linearised standard error ``sqrt(N / (N - 1) * sum_w (x_w - R n_w)^2) / sum_w n_w``; a paired
difference between two models uses ``x_w = loss_w(A) - loss_w(B)`` on the same ``n_w``, so the
spread shared by both models (hard windows, the draws) cancels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from mdlmpe_ds.diffusion.elbo import replicate_group
from mdlmpe_ds.diffusion.layouts import LAYOUTS, corrupt_layout, layout_draws
from mdlmpe_ds.evaluation.perplexity import window_batches
from mdlmpe_ds.pe.availability import gaussian_taps
from mdlmpe_ds.pe.config import MDLMPEConfig

ModelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DEFAULT_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.4, 1.0)


@dataclass(frozen=True)
class LayoutEvalSettings:
    seq_len: int = 256
    windows: int = 256
    draws: int = 8
    seed: int = 0
    t_sampling: str = "antithetic"
    eps: float = 1e-3
    batch_size: int = 8
    layouts: tuple[str, ...] = ("iid", "semi_ar", "spans")
    buckets: tuple[float, ...] = DEFAULT_BUCKETS  # edges of |local density - (1 - p)|
    span_mean: float | None = None

    def validate(self) -> LayoutEvalSettings:
        bad = [x for x in self.layouts if x not in LAYOUTS]
        if bad:
            raise ValueError(f"unknown layouts {bad}; expected some of {LAYOUTS}")
        if self.draws % replicate_group(self.t_sampling, self.draws):
            raise ValueError(
                f"t_sampling={self.t_sampling!r} needs an even number of draws, got {self.draws}"
            )
        if list(self.buckets) != sorted(self.buckets) or len(self.buckets) < 2:
            raise ValueError(f"bucket edges {self.buckets} must be increasing, at least two")
        return self


@dataclass
class WindowScores:
    """One model's sums per window for one layout: loss/tokens [N]; bucket_ce/bucket_n [N, nb]."""

    loss: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    bucket_ce: list[list[float]] = field(default_factory=list)
    bucket_n: list[list[float]] = field(default_factory=list)


def ratio_se(x: torch.Tensor, n: torch.Tensor) -> tuple[float, float]:
    """(sum x / sum n, its linearised standard error over the N units; module doc). The error is
    NaN when fewer than two units have n > 0."""
    x, n = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(n, dtype=torch.float64)
    total = float(n.sum())
    if total == 0:
        return float("nan"), float("nan")
    r = float(x.sum()) / total
    units = x.numel()
    if int((n > 0).sum()) < 2:  # one contributing unit: no spread to estimate an error from
        return r, float("nan")
    resid = x - r * n
    return r, math.sqrt(units / (units - 1) * float((resid**2).sum())) / total


def paired_difference(x_a, x_b, n) -> tuple[float, float]:
    """(per-token difference A - B, its paired standard error) from per-unit sums on the same n."""
    return ratio_se(torch.as_tensor(x_a, dtype=torch.float64) - torch.as_tensor(x_b, dtype=torch.float64), n)


def local_deviation(masked: torch.Tensor, valid: torch.Tensor, p: torch.Tensor, length: int) -> torch.Tensor:
    """|local visible fraction - (1 - p)| of every position [B, L] fp64 (module doc)."""

    cfg = MDLMPEConfig(max_seq_len=max(length, 2))
    taps = gaussian_taps(cfg.window, cfg.sigma).double().clone()
    taps[cfg.window] = 0.0  # the token itself does not count
    a = valid.double()
    b = (~masked).double() * a

    def band(x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x.unsqueeze(1), taps.view(1, 1, -1), padding=cfg.window).squeeze(1)

    local = band(b) / band(a).clamp(min=1e-12)
    return (local - (1.0 - p.double()[:, None])).abs()


def draw_levels(
    seed: int, index: torch.Tensor, length: int, draws: int, t_sampling: str
) -> list[torch.Tensor]:
    """The noise level t [B] of each draw k under ``t_sampling`` (as diffusion/elbo.py)."""
    group = replicate_group(t_sampling, draws)
    out, first = [], None
    for k in range(draws):
        t = layout_draws(seed, index, length, sample=k)[0]
        if k % group == 0:
            first = t
        elif t_sampling == "antithetic":
            t = 1.0 - first
        else:
            t = torch.remainder(first + (k % group) / group, 1.0)
        out.append(t)
    return out


@torch.no_grad()
def score_layouts(
    model_fn: ModelFn, batches: Iterable[dict], mask_id: int, settings: LayoutEvalSettings
) -> dict[str, WindowScores]:
    """Per-window sums of one model for every layout of ``settings`` (module doc). Each batch holds
    ``input_ids`` [B, L], ``valid`` [B, L], ``index`` [B] and ``maskable`` [B, L]."""
    settings.validate()
    edges = torch.tensor(settings.buckets, dtype=torch.float64)
    nb = len(settings.buckets) - 1
    out = {layout: WindowScores() for layout in settings.layouts}
    for batch in batches:
        ids, valid, index = batch["input_ids"], batch["valid"].bool(), batch["index"]
        maskable = batch.get("maskable", valid).bool() & valid
        B, L = ids.shape
        levels = draw_levels(settings.seed, index, L, settings.draws, settings.t_sampling)
        for layout in settings.layouts:
            loss = torch.zeros(B, dtype=torch.float64)
            tokens = torch.zeros(B, dtype=torch.float64)
            bce = torch.zeros(B, nb, dtype=torch.float64)
            bn = torch.zeros(B, nb, dtype=torch.float64)
            for k, t in enumerate(levels):
                draw = corrupt_layout(
                    layout,
                    settings.seed,
                    index,
                    maskable,
                    k,
                    eps=settings.eps,
                    t=t,
                    span_mean=settings.span_mean,
                )
                noisy = torch.where(draw.masked, torch.full_like(ids, mask_id), ids)
                logits = model_fn(noisy, valid)  # [B, L, V]
                sel = draw.scored.to(logits.device)
                ce = F.cross_entropy(logits[sel].float(), ids.to(logits.device)[sel], reduction="none")
                ce = ce.double().cpu()  # [M]
                rows, cols = draw.scored.nonzero(as_tuple=True)
                loss.index_add_(0, rows, ce / draw.p[rows])
                tokens += draw.scope.sum(1).double()
                dev = local_deviation(draw.masked, valid, draw.p, L)[rows, cols]  # [M]
                bucket = (torch.bucketize(dev, edges[1:-1], right=True)).clamp(max=nb - 1)
                flat = rows * nb + bucket
                bce.view(-1).index_add_(0, flat, ce)
                bn.view(-1).index_add_(0, flat, torch.ones_like(ce))
            scores = out[layout]
            scores.loss += loss.tolist()
            scores.tokens += tokens.tolist()
            scores.bucket_ce += bce.tolist()
            scores.bucket_n += bn.tolist()
    return out


def summarise(
    scores: dict[str, dict[str, WindowScores]], settings: LayoutEvalSettings, reference: str | None = None
) -> dict:
    """Tables from ``{model: {layout: WindowScores}}``: per model and layout the NLL per token with
    its standard error and the masked-token CE per deviation bucket; per other model and layout the
    paired difference to ``reference`` (default: the first model), overall and per bucket."""
    models = list(scores)
    reference = reference or models[0]
    labels = [f"[{lo:g}, {hi:g})" for lo, hi in zip(settings.buckets[:-1], settings.buckets[1:])]
    table: dict = {"models": models, "reference": reference, "buckets": labels, "nll": {}, "paired": {}}
    for m in models:
        table["nll"][m] = {}
        for layout, s in scores[m].items():
            nll, se = ratio_se(s.loss, s.tokens)
            bce, bn = (
                torch.tensor(s.bucket_ce, dtype=torch.float64),
                torch.tensor(s.bucket_n, dtype=torch.float64),
            )
            table["nll"][m][layout] = {
                "nll": nll,
                "se": se,
                "tokens": float(sum(s.tokens)),
                "windows": len(s.loss),
                "buckets": [
                    dict(zip(("ce", "se"), ratio_se(bce[:, j], bn[:, j])), tokens=float(bn[:, j].sum()))
                    for j in range(len(labels))
                ],
            }
    for m in models:
        if m == reference:
            continue
        table["paired"][m] = {}
        for layout, s in scores[m].items():
            r = scores[reference][layout]
            if s.tokens != r.tokens or s.bucket_n != r.bucket_n:
                raise ValueError(
                    f"{m} and {reference} were not scored on the same {layout} windows and masks"
                )
            delta, se = paired_difference(s.loss, r.loss, s.tokens)
            bce_m, bce_r = torch.tensor(s.bucket_ce), torch.tensor(r.bucket_ce)
            bn = torch.tensor(s.bucket_n, dtype=torch.float64)
            table["paired"][m][layout] = {
                "delta": delta,
                "se": se,
                "buckets": [
                    dict(zip(("delta", "se"), paired_difference(bce_m[:, j], bce_r[:, j], bn[:, j])))
                    for j in range(len(labels))
                ],
            }
    return table


def corpus_batches(
    corpus: str, tokenizer, settings: LayoutEvalSettings, family: str, cache_dir=None
) -> list[dict]:
    """The first ``settings.windows`` packed windows of ``corpus`` in batches, with ``maskable``
    (``cache_dir``: perplexity.window_batches)."""

    return window_batches(
        corpus, tokenizer, settings.seq_len, settings.windows, settings.batch_size, family, cache_dir
    )


def scores_to_json(scores: dict[str, WindowScores]) -> dict:
    return {layout: asdict(s) for layout, s in scores.items()}


def scores_from_json(saved: dict) -> dict[str, WindowScores]:
    return {layout: WindowScores(**s) for layout, s in saved.items()}


def layout_markdown(table: dict, corpus: str) -> str:
    """``summarise``'s table as markdown: NLL per model and layout (± s.e. over windows), then each
    model's paired difference to the reference."""
    models = table["models"]
    layouts = list(table["nll"][models[0]])
    lines = [
        f"NLL per token by corruption layout on {corpus} (nats, ± s.e. over windows):",
        "",
        "| model | " + " | ".join(layouts) + " |",
        "|---|" + "---|" * len(layouts),
    ]
    for m in models:
        cells = [f"{table['nll'][m][x]['nll']:.4f} ± {table['nll'][m][x]['se']:.4f}" for x in layouts]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append(
        "| tokens scored | "
        + " | ".join(str(int(table["nll"][models[0]][x]["tokens"])) for x in layouts)
        + " |"
    )
    for m, cells in table["paired"].items():
        diffs = [f"{cells[x]['delta']:+.4f} ± {cells[x]['se']:.4f}" for x in layouts]
        lines.append(f"| {m} − {table['reference']} (paired) | " + " | ".join(diffs) + " |")
    return "\n".join(lines)
