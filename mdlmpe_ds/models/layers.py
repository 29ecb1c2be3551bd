"""Leaf modules that initialise their own parameters, so the model can be built under ZeRO-3.

``deepspeed.zero.Init`` partitions each module right after its own ``__init__`` returns; a parent
that writes into a child's parameters afterwards (``nn.init.zeros_(self.fc2.weight)``) writes into
an empty shard and the intended value is lost, and a 0-dim parameter cannot be partitioned at all.
The classes here put every initialisation inside the constructor of the module that owns the
parameter (the pe/ modules ``PhaseMLP`` and ``MDLMPEEncoder`` follow the same rule).
"""

from __future__ import annotations

import torch
from torch import nn


class NormalLinear(nn.Linear):
    """``nn.Linear`` initialised N(0, std^2) (bias 0) by its own constructor (see the ZeRO-3 notes)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, std: float, device=None) -> None:
        self.init_std = std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias, device=device)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class NormalEmbedding(nn.Embedding):
    """``nn.Embedding`` initialised N(0, std^2); the ``padding_idx`` row (Dream) starts at 0 and never
    receives a gradient, as upstream (docs/models.md §2.2 "Embedding detail")."""

    def __init__(self, num: int, dim: int, padding_idx: int | None, std: float, device=None) -> None:
        self.init_std = std
        super().__init__(num, dim, padding_idx=padding_idx, device=device)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        self._fill_padding_idx_with_zero()


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) computed in fp32, cast back to the input dtype, then times the weight.

    This is both LLaDA's ``RMSLayerNorm`` and Dream's (Llama) RMSNorm: elementwise products commute,
    so ``(normed.to(dtype)) * w`` and ``w * normed.to(dtype)`` are the same numbers.
    """

    def __init__(self, hidden_size: int, eps: float, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight
