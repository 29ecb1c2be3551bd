"""ALiBi and absolute position embeddings against their textbook definitions (paper baselines)."""

from __future__ import annotations

import math

import pytest
import torch

from mdlmpe_ds.attention.common import alibi_attention
from mdlmpe_ds.models import DiffusionLM, preset
from mdlmpe_ds.pe.absolute import LearnedPositionEmbedding
from mdlmpe_ds.pe.alibi import alibi_bias, alibi_slopes


def test_slopes_are_press_et_al():
    # Power of two: 2^(-8/H), 2^(-16/H), ... (Press et al. 2022, Sec. 3).
    assert alibi_slopes(8).tolist() == [2.0 ** -(h + 1) for h in range(8)]
    assert alibi_slopes(4).tolist() == [2.0 ** (-2 * (h + 1)) for h in range(4)]
    # 12 heads: the 8-head slopes, then every other slope of the 16-head set: 2^-0.5, 2^-1.5, ...
    want12 = [2.0 ** -(h + 1) for h in range(8)] + [2.0 ** -(0.5 + h) for h in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(want12), atol=0, rtol=1e-6)
    # 6 heads: 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8 then 8-head slopes at even index: 2^-1, 2^-3.
    torch.testing.assert_close(
        alibi_slopes(6), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]), atol=0, rtol=1e-6
    )


def test_bias_is_symmetric_distance_and_masks_padding():
    bias = alibi_bias(5, 2)
    assert bias.shape == (1, 2, 5, 5)
    for h, m in enumerate(alibi_slopes(2).tolist()):
        for i in range(5):
            for j in range(5):
                assert bias[0, h, i, j].item() == pytest.approx(-m * abs(i - j))
    valid = torch.tensor([[True, True, True, False, False]])
    masked = alibi_bias(5, 2, valid)
    assert (masked[0, :, :, 3:] == torch.finfo(torch.float32).min).all()
    assert torch.equal(masked[0, :, :, :3], bias[0, :, :, :3])


def test_alibi_attention_is_the_explicit_softmax():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8)
    k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)  # GQA: query head h reads KV head h // 2
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    got = alibi_attention(q, k, v, alibi_bias(6, 4, valid))
    slopes = alibi_slopes(4)
    pos = torch.arange(6.0)
    for b in range(2):
        for h in range(4):
            kh, vh = k[b, h // 2], v[b, h // 2]
            scores = q[b, h] @ kh.T / math.sqrt(8) - slopes[h] * (pos[:, None] - pos[None, :]).abs()
            scores[:, ~valid[b]] = -float("inf")
            want = scores.softmax(-1) @ vh
            torch.testing.assert_close(got[b, h], want, atol=1e-5, rtol=0)


def test_absolute_adds_the_learned_row_of_each_position():
    torch.manual_seed(0)
    table = LearnedPositionEmbedding(10, 4, init_std=0.02)
    x = torch.randn(2, 7, 4)
    torch.testing.assert_close(table(x), x + table.weight[:7].unsqueeze(0), atol=0, rtol=0)
    assert table.weight.std().item() == pytest.approx(0.02, rel=0.5)
    with pytest.raises(ValueError, match="exceeds the absolute position table"):
        table(torch.randn(1, 11, 4))


@pytest.mark.parametrize("encoding", ["alibi", "absolute"])
def test_models_use_no_rotary_and_see_positions(encoding, monkeypatch):
    import mdlmpe_ds.models.block as block
    import mdlmpe_ds.models.transformer as transformer

    def no_rotary(*args, **kwargs):
        raise AssertionError("rotary embedding used with " + encoding)

    monkeypatch.setattr(block, "apply_rotary", no_rotary)
    monkeypatch.setattr(transformer, "rotary_angles", no_rotary)
    torch.manual_seed(0)
    model = DiffusionLM(preset("llada-tiny", position_encoding=encoding)).eval()
    if encoding == "absolute":
        with torch.no_grad():
            model.embed.positions.weight.normal_(std=1.0)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5]])
    with torch.no_grad():
        out = model(ids)
        # Same token at positions 0 and 5 with a permutation-invariant context: only the encoding
        # tells the two apart.
        assert (out[0, 0] - out[0, 5]).abs().max() > 1e-4
    plain = DiffusionLM(preset("llada-tiny", position_encoding=encoding))
    names = {n for n, _ in plain.named_parameters()}
    assert ("embed.positions.weight" in names) == (encoding == "absolute")
