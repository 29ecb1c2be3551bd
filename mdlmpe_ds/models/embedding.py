"""The model's input: the token embedding plus the absolute table or the MDLMPE embedding path.

Apart from the model (transformer.py) because it is the one place where the position encodings that
act on the input (learned absolute positions, MDLMPE's availability features and embedding path)
meet the tokens; each position module draws its initial weights from a stream of its own
(seeding.init_stream), so the backbone's initial weights are the same for every encoding.
"""

from __future__ import annotations

import torch
from torch import nn

from mdlmpe_ds.models.config import ModelConfig
from mdlmpe_ds.models.layers import NormalEmbedding
from mdlmpe_ds.pe.absolute import LearnedPositionEmbedding
from mdlmpe_ds.pe.encoder import AvailabilityFeatures, MDLMPEEncoder
from mdlmpe_ds.seeding import init_stream


class InputEmbedding(nn.Module):
    """Token embedding, plus the absolute table or the MDLMPE embedding path when selected.

    Returns the block input [B, L, d] and, for MDLMPE, the availability features (b, a, A, D),
    computed once per forward from the input ids and validity and shared by every layer.
    """

    def __init__(self, config: ModelConfig, device=None) -> None:
        super().__init__()
        self.tokens = NormalEmbedding(
            config.vocab_size, config.hidden_size, config.embedding_padding_idx, config.init_std, device
        )
        # The position modules draw from streams of their own (seeding.init_stream): the backbone's
        # initial weights are the same for every encoding of one seed.
        self.positions = self.mdlmpe = None
        if config.position_encoding == "absolute":
            with init_stream("absolute_positions"):
                self.positions = LearnedPositionEmbedding(
                    config.max_seq_len, config.hidden_size, config.init_std, device
                )
        if config.position_encoding == "mdlmpe":
            with init_stream("mdlmpe_encoder"):
                self.mdlmpe = MDLMPEEncoder(
                    config.mdlmpe,
                    config.head_dim,
                    config.hidden_size,
                    config.rope_theta,
                    config.mask_token_id,
                    device=device,
                )

    def forward(
        self, input_ids: torch.Tensor, valid: torch.Tensor | None, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, AvailabilityFeatures | None]:
        x = self.tokens(input_ids)  # [B, L, d]
        if self.positions is not None:
            x = self.positions(x)
        features = None
        if self.mdlmpe is not None:
            # b, a [B, L]; A, D [B, L, F] fp32; the basis is indexed by `positions` when given
            features = self.mdlmpe.features(input_ids, valid, positions)
            x = self.mdlmpe.embed(x, features)
        return x, features


__all__ = ["InputEmbedding"]
