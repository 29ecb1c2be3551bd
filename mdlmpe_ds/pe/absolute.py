"""Learned absolute position embeddings: the paper's from-scratch diagnostic baseline (BERT style).

e~_i = e_i + p_i with p a learned [L_ref, d] table; no rotary embedding is applied with it.
"""

from __future__ import annotations

import torch
from torch import nn


class LearnedPositionEmbedding(nn.Module):
    """Table p [max_seq_len, hidden] ~ N(0, init_std^2), initialised in this module's own constructor
    so that building under ``deepspeed.zero.Init`` (which partitions each module after its
    ``__init__``) keeps the intended initial values."""

    def __init__(self, max_seq_len: int, hidden_size: int, init_std: float, device=None) -> None:
        super().__init__()
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(max_seq_len, hidden_size, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """[B, L, d] -> [B, L, d] with p_0..p_{L-1} added."""
        seq_len = embeddings.shape[1]
        if seq_len > self.weight.shape[0]:
            raise ValueError(
                f"sequence length {seq_len} exceeds the absolute position table ({self.weight.shape[0]} rows,"
                " the model's max_seq_len)"
            )
        return embeddings + self.weight[:seq_len].to(embeddings.dtype)
