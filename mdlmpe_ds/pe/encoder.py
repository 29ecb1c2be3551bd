"""The model-level MDLMPE module: availability -> (A, D) once per forward, and the embedding path
(paper Eqs. (11), (18); docs/method.md "Embedding path").

Construction does no weight-dependent work beyond ``reset_parameters`` so the module can be built
under ``deepspeed.zero.Init`` or on the meta device.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mdlmpe_ds.pe.availability import availability, gaussian_taps, sine_basis, token_summaries
from mdlmpe_ds.pe.config import MDLMPEConfig


class AvailabilityFeatures(NamedTuple):
    """What every layer of one forward shares. b, a: [B, L]; A, D: [B, L, F]; all fp32."""

    b: torch.Tensor
    a: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor


class LearnedCoordinate(nn.Module):
    """Ablation "MLP instead of the basis" (Appendix C): c_{t,f} = sigmoid(MLP(t / L_ref)) in (0, 1).

    Non-negative like the sine coordinate, so Eq. (17) (0 <= r <= 1) still holds.
    """

    def __init__(self, num_pairs: int, max_seq_len: int, hidden: int = 64, device=None) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.fc1 = nn.Linear(1, hidden, device=device)
        self.fc2 = nn.Linear(hidden, num_pairs, device=device)

    def forward(self, seq_len: int, device: torch.device) -> torch.Tensor:
        t = torch.arange(seq_len, dtype=torch.float32, device=device).unsqueeze(-1) / self.max_seq_len
        return torch.sigmoid(self.fc2(F.silu(self.fc1(t)))).float()  # [L, F]


class ProjectionLinear(nn.Linear):
    """W_p (F -> d) initialised N(0, 1/F) with b_p = 0 by its own constructor (docs/method.md
    "Embedding path": b_p = 0).

    With A in [0, 1]^F this keeps each coordinate of z = W_p A + b_p of order one, so the gate
    gamma alone sets the size of the embedding perturbation (Eq. (12)).
    """

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.in_features))
        nn.init.zeros_(self.bias)


class MDLMPEEncoder(nn.Module):
    """Builds the availability features once per forward and applies the gated embedding path.

    Parameters: W_p [d, F] and b_p [d] (the projection z = W_p A + b_p), and the gate logit g with
    gamma = gamma_max * sigmoid(g) initialised to gamma_init (b_p = 0 at init).
    """

    def __init__(
        self,
        config: MDLMPEConfig,
        head_dim: int,
        hidden_size: int,
        rope_theta: float,
        mask_token_id: int,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config.validate()
        self.head_dim = head_dim
        self.num_pairs = head_dim // 2
        self.rope_theta = rope_theta
        self.mask_token_id = mask_token_id
        if config.use_embedding:
            self.proj = ProjectionLinear(self.num_pairs, hidden_size, device=device)
            # Shape [1], not a 0-dim scalar: ZeRO-3 cannot partition 0-dim parameters.
            self.gate_logit = nn.Parameter(torch.full((1,), self.initial_gate_logit(), device=device))
        else:
            self.register_parameter("proj", None)
            self.register_parameter("gate_logit", None)
        self.coordinate = (
            LearnedCoordinate(self.num_pairs, config.max_seq_len, device=device)
            if config.coordinate == "mlp"
            else None
        )

    def initial_gate_logit(self) -> float:
        """g with gamma_max * sigmoid(g) = gamma_init."""
        ratio = self.config.gamma_init / self.config.gamma_max
        return math.log(ratio / (1.0 - ratio))

    def reset_parameters(self) -> None:
        """Re-initialise (e.g. on gathered ZeRO-3 parameters); construction needs no call to it."""
        if self.proj is not None:
            self.proj.reset_parameters()
            with torch.no_grad():
                self.gate_logit.fill_(self.initial_gate_logit())
        if self.coordinate is not None:
            self.coordinate.fc1.reset_parameters()
            self.coordinate.fc2.reset_parameters()

    @property
    def gamma(self) -> torch.Tensor:
        """gamma = gamma_max * sigmoid(g) in (0, gamma_max) (Eq. (11))."""
        return self.config.gamma_max * torch.sigmoid(self.gate_logit.float())

    def basis(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The coordinate c [L, F] selected by ``config.coordinate``."""
        if self.coordinate is not None:
            return self.coordinate(seq_len, device)
        if self.config.coordinate == "none":
            return torch.ones(seq_len, self.num_pairs, device=device)
        return sine_basis(seq_len, self.head_dim, self.rope_theta, device)

    def features(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> AvailabilityFeatures:
        """b, a from the model input (never clean targets), then A, D (fp32, O(L W F)).

        ``positions`` [B, L] (optional) are the RoPE positions t of each token when they are not
        0..L-1, e.g. ``cumsum(valid) - 1`` under left padding: the basis c_t is indexed by t, so a
        left-padded row gets the same features as the unpadded one.
        """
        b, a = availability(input_ids, self.mask_token_id, valid)
        taps = gaussian_taps(self.config.window, self.config.sigma, input_ids.device)
        if positions is None:
            coordinate = self.basis(input_ids.shape[-1], input_ids.device)  # [L, F]
        else:
            table = self.basis(int(positions.max()) + 1, input_ids.device)
            coordinate = table[positions.clamp(min=0)]  # [B, L, F]
        A, D = token_summaries(b, a, coordinate, taps, self.config.eps)
        return AvailabilityFeatures(b, a, A, D)

    def embed(self, embeddings: torch.Tensor, features: AvailabilityFeatures) -> torch.Tensor:
        """e~ = e + gamma * (W_p A + b_p) (Eq. (11)); identity when the path is off."""
        if self.proj is None:
            return embeddings
        z = F.linear(features.A, self.proj.weight.float(), self.proj.bias.float())  # [B, L, d]
        return embeddings + (self.gamma * z).to(embeddings.dtype)
