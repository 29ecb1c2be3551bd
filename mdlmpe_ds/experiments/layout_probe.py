"""How much of the run length k can be read from the layout feature A_i?

A depends only on the availability pattern (b, a), the fixed sine basis and the Gaussian window, not
on any trained weight, so one probe per geometry answers whether the feature *carries* the answer
(separately from whether a network *uses* it). Probes, fitted on masked scored tokens of the
``runs`` task and scored on held-out rows:

* ``prior``: a bias only (the layout-blind baseline: the size-biased entropy of k);
* ``linear`` / ``mlp`` (one hidden layer of 64) on A_i, and on A_{i-2..i+2} (own position and two
  neighbours each side);
* ``gap one-hot``: the oracle's feature, as the proof that the probe can decode what is there.

"Information recovered" is 1 - CE / CE(prior).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mdlmpe_ds.experiments.runlength_data import Geometry, make_batch
from mdlmpe_ds.models import preset
from mdlmpe_ds.pe.encoder import MDLMPEEncoder


def layout_features(geometry: Geometry, rows: int, seed: int) -> dict[str, torch.Tensor]:
    """Probe inputs at the masked scored tokens of ``rows`` rows: ``own`` A_i [N, F], ``context``
    A_{i-2..i+2} [N, 5F] (zeros beyond the row), ``gap`` one-hot [N, K + 2], and ``k`` [N] (0-based)."""
    ids = {
        "vocab_size": geometry.vocab_size,
        "mask_token_id": geometry.mask_id,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }
    config = preset("llada-mech", **ids, max_seq_len=geometry.length, position_encoding="mdlmpe")
    encoder = MDLMPEEncoder(
        config.mdlmpe, config.head_dim, config.hidden_size, config.rope_theta, geometry.mask_id
    )
    batch = make_batch(geometry, "runs", rows, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        A = encoder.features(batch.ids).A  # [B, L, F]
    padded = F.pad(A, (0, 0, 2, 2))  # [B, L + 4, F]
    context = torch.cat([padded[:, s : s + geometry.length] for s in range(5)], dim=-1)  # [B, L, 5F]
    gap = F.one_hot(batch.gap.clamp(max=geometry.max_run + 1), geometry.max_run + 2).float()
    scored = batch.scored
    return {
        "own": A[scored],
        "context": context[scored],
        "gap": gap[scored],
        "k": batch.run_length[scored] - 1,
    }


def fit_probe(
    train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
    classes: int, hidden: int | None, steps: int = 400, seed: int = 0,
) -> dict[str, float]:  # fmt: skip
    """Full-batch Adam on standardised inputs; held-out CE (nats) and accuracy. ``hidden`` None: linear;
    0 columns in the inputs: the prior (a bias only)."""
    torch.manual_seed(seed)
    width = train_x.shape[1]
    if width:
        mean, std = train_x.mean(0), train_x.std(0).clamp(min=1e-6)
        norm = lambda x: (x - mean) / std  # noqa: E731
    if width == 0:
        model = nn.Linear(1, classes)
        norm = lambda x: torch.zeros(x.shape[0], 1)  # noqa: E731
    elif hidden is None:
        model = nn.Linear(width, classes)
    else:
        model = nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, classes))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    x = norm(train_x)
    for _ in range(steps):
        loss = F.cross_entropy(model(x), train_y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        logits = model(norm(test_x))
        return {
            "ce": float(F.cross_entropy(logits, test_y)),
            "acc": float((logits.argmax(-1) == test_y).float().mean()),
        }


def probe_layout(geometry: Geometry, rows: int = 768, seed: int = 99) -> list[dict]:
    """Every probe of the module doc: ``[{"probe", "inputs", "ce", "acc", "recovered"}]``."""
    train = layout_features(geometry, rows, seed)
    test = layout_features(geometry, max(rows // 3, 8), seed + 1)
    classes = geometry.max_run
    results = []
    prior = fit_probe(train["own"][:, :0], train["k"], test["own"][:, :0], test["k"], classes, None)
    results.append({"probe": "prior", "inputs": "none", **prior})
    for inputs, hidden in (("own", None), ("own", 64), ("context", None), ("context", 64), ("gap", None)):
        name = "linear" if hidden is None else "mlp"
        fit = fit_probe(train[inputs], train["k"], test[inputs], test["k"], classes, hidden)
        label = {"own": "A_i", "context": "A_{i-2..i+2}", "gap": "gap one-hot (oracle)"}[inputs]
        results.append({"probe": name, "inputs": label, **fit})
    for r in results:
        r["recovered"] = 1.0 - r["ce"] / prior["ce"]
        r["tokens_train"], r["tokens_test"] = int(train["k"].numel()), int(test["k"].numel())
    return results
