"""LLaDA / Dream masked diffusion LMs with RoPE or MDLMPE, for plain ``transformers``.

This file is copied into every export of mdlmpe_ds (``launch/export.py``) and named in the export's
``config.json`` ``auto_map``, so that

    model = AutoModel.from_pretrained(export_dir, trust_remote_code=True)

runs a fine-tuned model without mdlmpe_ds installed. It is self-contained on purpose: it imports
only torch and transformers (``trust_remote_code`` copies this one file), and it re-implements the
forward of ``mdlmpe_ds.models.DiffusionLM`` for inference: the same numbers within fp32 noise
(tested in ``tests/unit/test_hub_export.py``), including the MDLMPE availability features
(b, a, A, D), the gated embedding path and the per-pair phase of the attention (one phase MLP per
block, or one for the model when the ``mdlmpe_ds.mdlmpe.phase_mlp`` setting is ``"shared"``).

The checkpoint keys are the upstream ones (LLaDA's ``model.transformer.blocks.N.attn_out``,
Dream's ``model.layers.N.self_attn.o_proj``) plus the MDLMPE keys, and ``config.json`` keeps the
upstream keys; the project-only settings are in its ``mdlmpe_ds`` block. A RoPE-only export
therefore also loads with the official LLaDA / Dream modeling code.

Logits follow each family's upstream convention, so the official generation and evaluation code
of LLaDA and Dream run on an export unchanged: LLaDA's logit i predicts token i; Dream's logit i
predicts token i + 1 (Qwen2's next-token alignment; the official Dream sampler shifts them itself,
docs/models.md §2.3). ``aligned=True`` returns Dream's logits shifted so that logit i predicts
token i, as ``fill_masks`` and ``chat`` use them. Use ``attention_mask`` for padding and
``position_ids`` for left-padded rows (e.g. ``attention_mask.cumsum(-1) - 1``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

PROJECT_KEY = "mdlmpe_ds"


# ------------------------------------------------------------------------------------- config
class _ExportConfig(PretrainedConfig):
    """The upstream config.json keys of one family, plus the ``mdlmpe_ds`` block (kept as is)."""

    family = "llada"

    def __init__(self, **kwargs: Any) -> None:
        tied = kwargs.pop("weight_tying", None) if self.family == "llada" else None
        if self.family == "llada":
            kwargs.setdefault("tie_word_embeddings", bool(tied))
            kwargs["weight_tying"] = bool(tied)
        else:
            kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def settings(self) -> dict[str, Any]:
        """The model's sizes, ids and encoding, read from either family's key names."""
        raw = self.to_dict()
        if self.family == "llada":
            d = raw["d_model"]
            out = {
                "vocab_size": raw.get("embedding_size") or raw["vocab_size"],
                "hidden_size": d,
                "num_layers": raw["n_layers"],
                "num_heads": raw["n_heads"],
                "num_kv_heads": raw.get("n_kv_heads") or raw["n_heads"],
                "intermediate_size": raw.get("mlp_hidden_size") or int(raw.get("mlp_ratio", 4) * d),
                "rms_norm_eps": raw.get("rms_norm_eps", 1e-5),
                "rope_theta": raw.get("rope_theta", 10000.0),
                "max_seq_len": raw.get("max_sequence_length", 4096),
                "tie_embeddings": bool(raw.get("weight_tying", False)),
                "mask_token_id": raw.get("mask_token_id", 126336),
            }
        else:
            heads = raw["num_attention_heads"]
            out = {
                "vocab_size": raw["vocab_size"],
                "hidden_size": raw["hidden_size"],
                "num_layers": raw["num_hidden_layers"],
                "num_heads": heads,
                "num_kv_heads": raw.get("num_key_value_heads") or heads,
                "intermediate_size": raw["intermediate_size"],
                "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
                "rope_theta": raw.get("rope_theta", 10000.0),
                "max_seq_len": raw.get("max_position_embeddings", 2048),
                "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
                "mask_token_id": raw.get("mask_token_id", 151666),
            }
        project = dict(raw.get(PROJECT_KEY) or {})
        out["family"] = self.family
        out["position_encoding"] = project.get("position_encoding", "rope")
        out["init_std"] = project.get("init_std", 0.02)
        out["mdlmpe"] = dict(project.get("mdlmpe") or {})
        out["head_dim"] = out["hidden_size"] // out["num_heads"]
        return out


class MDLMPELLaDAConfig(_ExportConfig):
    """LLaDA's config.json (OLMo-style keys: d_model, n_layers, n_heads, ...)."""

    model_type = "llada"
    family = "llada"


class MDLMPEDreamConfig(_ExportConfig):
    """Dream's config.json (Qwen2 keys: hidden_size, num_hidden_layers, ...)."""

    model_type = "Dream"
    family = "dream"


# ---------------------------------------------------------------------------- position maths
def _inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """w_f = theta^(-2f/d_h), f = 0..F-1, fp32 [F]."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponent)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool) -> torch.Tensor:
    """Rotate pairs (x_f, x_{f+F}) of x [..., L, d_h] by angles with cos/sin [.., L, F]."""
    half, dtype = x.shape[-1] // 2, x.dtype
    if fp32:  # LLaDA rotates in fp32; Dream multiplies in the activation dtype
        x = x.float()
    else:
        cos, sin = cos.to(dtype), sin.to(dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


def _repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, Hkv, L, d] -> [B, Hq, L, d] (GQA)."""
    rep = num_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _masked_key_value(dtype: torch.dtype) -> float:
    """The additive bias of a padding key: finfo(dtype).min / 16, the rule training uses. Finite in
    ``dtype`` (finfo(float32).min cast to bf16 or fp16 is -inf, and a sequence with no valid key
    would give NaN), with room for the log2(e) and scale factors SDPA's fused GPU kernels apply
    before subtracting the row max. For a row with a valid key it changes nothing (exp underflows
    to 0 either way); an all-padding row gets the uniform average of V, as in training."""
    return torch.finfo(dtype).min / 16


def _key_bias(key_valid: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[B, L] bool -> additive [B, 1, 1, L] in ``dtype``: 0 where valid, ``_masked_key_value``
    where not."""
    if key_valid is None:
        return None
    bias = torch.zeros(key_valid.shape, dtype=dtype, device=key_valid.device)
    bias.masked_fill_(~key_valid, _masked_key_value(dtype))
    return bias[:, None, None, :]


def _alibi_slopes(num_heads: int) -> torch.Tensor:
    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    lower = 1 << (num_heads.bit_length() - 1)
    slopes = powers(lower)
    if lower != num_heads:
        slopes += powers(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


class _MDLMPEMaths:
    """The MDLMPE hyper-parameters of the ``mdlmpe_ds.mdlmpe`` block, with the defaults of docs/method.md
    "Decisions the paper leaves open"."""

    def __init__(self, values: dict[str, Any], max_seq_len: int) -> None:
        self.window_ratio = float(values.get("window_ratio", 3 / 16))
        self.rho = float(values.get("rho", 0.25))
        self.eps = float(values.get("eps", 1e-6))
        self.clip_kappa = float(values.get("clip_kappa", 1e-4))
        self.gamma_max = float(values.get("gamma_max", 0.10))
        self.gamma_init = float(values.get("gamma_init", 0.01))
        self.tau_max = float(values.get("tau_max", 0.25))
        self.phase_hidden = values.get("phase_hidden")
        self.use_gaussian = bool(values.get("use_gaussian", True))
        self.coordinate = values.get("coordinate", "sine")
        self.use_embedding = bool(values.get("use_embedding", True))
        # "per_layer": one phase MLP per block; "shared": one for the model (absent: per_layer).
        self.phase_mlp = values.get("phase_mlp", "per_layer")
        if self.phase_mlp not in ("per_layer", "shared"):
            raise ValueError(
                f"config.json: mdlmpe_ds.mdlmpe.phase_mlp={self.phase_mlp!r} must be 'per_layer' or 'shared'"
            )
        self.max_seq_len = max_seq_len  # L_ref fixes the window, never the batch length
        self.query_block = int(values.get("block_size", 128))

    def hidden_width(self, num_pairs: int) -> int:
        return self.phase_hidden if self.phase_hidden is not None else max(16, num_pairs // 2)

    @property
    def window(self) -> int:
        return math.floor(self.window_ratio * self.max_seq_len + 0.5) if self.use_gaussian else 0

    @property
    def sigma(self) -> float:
        return max(self.rho * self.window, 1.0)

    def taps(self, device) -> torch.Tensor:
        """Truncated Gaussian exp(-d^2 / 2 sigma^2), d = -W..W, computed in fp64. fp32 [2W+1]."""
        offsets = torch.arange(-self.window, self.window + 1, dtype=torch.float64)
        return torch.exp(-(offsets**2) / (2.0 * self.sigma**2)).to(torch.float32).to(device)


def _sine_basis(seq_len: int, head_dim: int, theta: float, device) -> torch.Tensor:
    """c_{t,f} = (1 + sin(t w_f)) / 2 computed in fp64 then stored fp32. [L, F]."""
    t = torch.arange(seq_len, dtype=torch.float64)
    omega = _inverse_frequencies(head_dim, theta).to(torch.float64)
    return (0.5 * (1.0 + torch.sin(torch.outer(t, omega)))).to(torch.float32).to(device)


def _banded_sum(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """y_i = sum_{|d| <= W} taps[d] x_{i+d}, zero outside [0, L). [N, L] -> [N, L]."""
    window = (taps.numel() - 1) // 2
    if window == 0:
        return x * taps[0]
    return F.conv1d(x.unsqueeze(1), taps.view(1, 1, -1), padding=window).squeeze(1)


def _summaries(b, a, coordinate, taps, eps):
    """A = sum_t w_it b_t c_t, D = sum_t w_it a_t c_t + eps with w the row-normalised window. [B, L, F]."""
    batch, length = a.shape
    coordinate = coordinate.float()
    if coordinate.dim() == 2:
        coordinate = coordinate.unsqueeze(0).expand(batch, -1, -1)
    num_pairs = coordinate.shape[-1]
    row_mass = _banded_sum(a, taps)  # [B, L]
    signals = torch.cat((b.unsqueeze(-1) * coordinate, a.unsqueeze(-1) * coordinate), dim=-1)  # [B, L, 2F]
    sums = _banded_sum(signals.transpose(1, 2).reshape(batch * 2 * num_pairs, length), taps)
    sums = sums.view(batch, 2 * num_pairs, length).transpose(1, 2)  # [B, L, 2F]
    norm = (row_mass + eps).unsqueeze(-1)
    return sums[..., :num_pairs] / norm, sums[..., num_pairs:] / norm + eps


class MDLMPEEmbedding(nn.Module):
    """Availability features and the gated embedding path e~ = e + gamma (W_p A + b_p).

    Parameters (checkpoint names): ``proj`` (W_p [d, F], b_p), ``gate_logit`` [1], and the
    ``coordinate`` MLP of the "MLP instead of basis" ablation.
    """

    def __init__(self, maths: _MDLMPEMaths, head_dim: int, hidden: int, theta: float, mask_id: int) -> None:
        super().__init__()
        self.maths, self.head_dim, self.theta, self.mask_id = maths, head_dim, theta, mask_id
        self.num_pairs = head_dim // 2
        if maths.use_embedding:
            self.proj = nn.Linear(self.num_pairs, hidden)
            self.gate_logit = nn.Parameter(torch.zeros(1))
        else:
            self.proj, self.gate_logit = None, None
        if maths.coordinate == "mlp":
            self.coordinate = nn.Module()
            self.coordinate.fc1 = nn.Linear(1, 64)
            self.coordinate.fc2 = nn.Linear(64, self.num_pairs)
        else:
            self.coordinate = None

    def basis(self, seq_len: int, device) -> torch.Tensor:
        if self.coordinate is not None:
            t = (
                torch.arange(seq_len, dtype=torch.float32, device=device).unsqueeze(-1)
                / self.maths.max_seq_len
            )
            return torch.sigmoid(self.coordinate.fc2(F.silu(self.coordinate.fc1(t)))).float()
        if self.maths.coordinate == "none":
            return torch.ones(seq_len, self.num_pairs, device=device)
        return _sine_basis(seq_len, self.head_dim, self.theta, device)

    def features(self, input_ids, valid, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """A, D [B, L, F] fp32 from b_t = 1[x_t != mask] a_t and a_t = valid_t."""
        a = torch.ones(input_ids.shape, device=input_ids.device) if valid is None else valid.float()
        b = (input_ids != self.mask_id).float() * a
        if positions is None:
            coordinate = self.basis(input_ids.shape[-1], input_ids.device)  # [L, F]
        else:
            coordinate = self.basis(int(positions.max()) + 1, input_ids.device)[positions.clamp(min=0)]
        return _summaries(b, a, coordinate, self.maths.taps(input_ids.device), self.maths.eps)

    def embed(self, x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        if self.proj is None:
            return x
        gamma = self.maths.gamma_max * torch.sigmoid(self.gate_logit.float())
        z = F.linear(A, self.proj.weight.float(), self.proj.bias.float())  # [B, L, d]
        return x + (gamma * z).to(x.dtype)


class PhaseMLP(nn.Module):
    """delta = tau_max tanh(W2 SiLU(W1 s + b1) + b2) on the odd rotary pairs (|M| = F/2 outputs)."""

    def __init__(self, num_pairs: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(num_pairs, hidden)
        self.fc2 = nn.Linear(hidden, len(range(1, num_pairs, 2)))

    def delta(self, A_i, D_i, A_j, D_j, maths: _MDLMPEMaths) -> torch.Tensor:
        """Pair phases for query rows i and key columns j. A_i [B, C, F], A_j [B, L, F] -> [B, C, L, |M|]."""
        r = (A_i.unsqueeze(-2) + A_j.unsqueeze(-3)) / (D_i.unsqueeze(-2) + D_j.unsqueeze(-3))
        s = torch.acos((2.0 * r - 1.0).clamp(-1.0 + maths.clip_kappa, 1.0 - maths.clip_kappa)) - math.pi / 2
        hidden = F.silu(F.linear(s, self.fc1.weight.float(), self.fc1.bias.float()))
        return maths.tau_max * torch.tanh(F.linear(hidden, self.fc2.weight.float(), self.fc2.bias.float()))


def _mdlmpe_attention(q, k, v, A, D, phase: PhaseMLP, maths: _MDLMPEMaths, key_valid) -> torch.Tensor:
    """Attention whose odd rotary pairs see the key rotated by R(delta_ij), in query blocks. fp32 inside.

    For a pair with q = (q1, q2), k = (k1, k2): q . R(delta) k = cos(delta) P + sin(delta) Q with
    P = q1 k1 + q2 k2 (the plain RoPE term) and Q = q2 k1 - q1 k2, so each block adds
    sum_m [(cos delta - 1) P + sin delta Q] to the plain scores. q [B, H, L, d]; out like q.
    """
    _, heads, length, head_dim = q.shape
    num_pairs = head_dim // 2
    odd = torch.arange(1, num_pairs, 2, device=q.device)
    qf, kf, vf = q.float(), _repeat_kv(k, heads).float(), _repeat_kv(v, heads).float()
    k1, k2 = kf[..., odd].unsqueeze(2), kf[..., odd + num_pairs].unsqueeze(2)  # [B, H, 1, L, M]
    bias = _key_bias(key_valid, torch.float32)
    out = []
    for start in range(0, length, maths.query_block):
        stop = min(start + maths.query_block, length)
        qb = qf[:, :, start:stop]  # [B, H, C, d]
        scores = qb @ kf.transpose(-1, -2)  # [B, H, C, L]
        q1, q2 = qb[..., odd].unsqueeze(3), qb[..., odd + num_pairs].unsqueeze(3)  # [B, H, C, 1, M]
        p, r = q1 * k1 + q2 * k2, q2 * k1 - q1 * k2  # [B, H, C, L, M]
        delta = phase.delta(A[:, start:stop], D[:, start:stop], A, D, maths).unsqueeze(1)  # [B, 1, C, L, M]
        scores = scores + ((delta.cos() - 1.0) * p + delta.sin() * r).sum(-1)
        scores = scores / math.sqrt(head_dim)
        if bias is not None:
            scores = scores + bias
        out.append(torch.softmax(scores, dim=-1) @ vf)
    return torch.cat(out, dim=2).to(q.dtype)


# ------------------------------------------------------------------------------------ modules
class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


# Checkpoint path of each part, per family (upstream names; see mdlmpe_ds/models/names.py).
_BLOCK_PATHS = {
    "llada": {
        "attn_norm": "attn_norm",
        "q": "q_proj",
        "k": "k_proj",
        "v": "v_proj",
        "o": "attn_out",
        "phase": "mdlmpe_phase",
        "mlp_norm": "ff_norm",
        "gate": "ff_proj",
        "up": "up_proj",
        "down": "ff_out",
    },
    "dream": {
        "attn_norm": "input_layernorm",
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "phase": "self_attn.mdlmpe_phase",
        "mlp_norm": "post_attention_layernorm",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
    },
}
_TOP_PATHS = {
    "llada": {
        "tokens": "model.transformer.wte",
        "positions": "model.transformer.wpe",
        "mdlmpe": "model.transformer.mdlmpe",
        "phase": "model.transformer.mdlmpe_phase",
        "blocks": "model.transformer.blocks",
        "norm": "model.transformer.ln_f",
        "head": "model.transformer.ff_out",
    },
    "dream": {
        "tokens": "model.embed_tokens",
        "positions": "model.embed_positions",
        "mdlmpe": "model.mdlmpe",
        "phase": "model.mdlmpe_phase",
        "blocks": "model.layers",
        "norm": "model.norm",
        "head": "lm_head",
    },
}


def _place(root: nn.Module, path: str, module: nn.Module | None) -> None:
    """Attach ``module`` at dotted ``path`` under ``root``, creating empty containers on the way."""
    *parents, leaf = path.split(".")
    for name in parents:
        if not hasattr(root, name):
            setattr(root, name, nn.Module())
        root = getattr(root, name)
    setattr(root, leaf, module)


class Block(nn.Module):
    """Pre-norm block: h = x + o(Attn(norm(x))), y = h + down(silu(gate(norm h)) * up(norm h))."""

    def __init__(self, s: dict[str, Any], maths: _MDLMPEMaths | None) -> None:
        super().__init__()
        self.paths = _BLOCK_PATHS[s["family"]]
        d, hd = s["hidden_size"], s["head_dim"]
        self.heads, self.kv_heads, self.head_dim = s["num_heads"], s["num_kv_heads"], hd
        self.family, self.encoding, self.maths = s["family"], s["position_encoding"], maths
        bias = s["family"] == "dream"
        parts: dict[str, nn.Module | None] = {
            "attn_norm": RMSNorm(d, s["rms_norm_eps"]),
            "q": nn.Linear(d, self.heads * hd, bias=bias),
            "k": nn.Linear(d, self.kv_heads * hd, bias=bias),
            "v": nn.Linear(d, self.kv_heads * hd, bias=bias),
            "o": nn.Linear(self.heads * hd, d, bias=False),
            "mlp_norm": RMSNorm(d, s["rms_norm_eps"]),
            "gate": nn.Linear(d, s["intermediate_size"], bias=False),
            "up": nn.Linear(d, s["intermediate_size"], bias=False),
            "down": nn.Linear(s["intermediate_size"], d, bias=False),
        }
        if self.encoding == "mdlmpe" and maths.phase_mlp == "per_layer":  # shared: the model's
            parts["phase"] = PhaseMLP(hd // 2, maths.hidden_width(hd // 2))
        for role, module in parts.items():
            _place(self, self.paths[role], module)

    def part(self, role: str) -> nn.Module:
        return self.get_submodule(self.paths[role])

    def forward(self, x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        batch, length, _ = x.shape
        h = self.part("attn_norm")(x)
        q = self.part("q")(h).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.part("k")(h).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.part("v")(h).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.encoding in ("rope", "mdlmpe"):
            fp32 = self.family == "llada"
            q, k = (
                _apply_rotary(q, ctx["cos"], ctx["sin"], fp32),
                _apply_rotary(k, ctx["cos"], ctx["sin"], fp32),
            )
        if self.encoding == "mdlmpe":
            phase = ctx["phase"] if self.maths.phase_mlp == "shared" else self.part("phase")
            out = _mdlmpe_attention(q, k, v, ctx["A"], ctx["D"], phase, self.maths, ctx["key_valid"])
        else:
            if self.encoding == "alibi":
                # padding keys at the dtype's own masked value (finite: fp32's would be -inf in bf16)
                mask = ctx["alibi"].clamp(min=_masked_key_value(q.dtype)).to(q.dtype)
            else:
                mask = _key_bias(ctx["key_valid"], q.dtype)
            out = F.scaled_dot_product_attention(
                q, _repeat_kv(k, self.heads), _repeat_kv(v, self.heads), attn_mask=mask, is_causal=False
            )
        x = x + self.part("o")(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))
        h = self.part("mlp_norm")(x)
        return x + self.part("down")(F.silu(self.part("gate")(h)) * self.part("up")(h))


class MDLMPEPreTrainedModel(PreTrainedModel):
    config_class = MDLMPELLaDAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Init for weights a checkpoint lacks (an export holds them all; needed by from_config)."""
        std = self.config.settings()["init_std"]
        if isinstance(module, nn.Linear):
            module.weight.normal_(std=std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(std=std)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, MDLMPEEmbedding) and module.gate_logit is not None:
            ratio = module.maths.gamma_init / module.maths.gamma_max
            module.gate_logit.fill_(math.log(ratio / (1.0 - ratio)))
        elif isinstance(module, PhaseMLP):  # zero output: the layer starts as plain RoPE attention
            module.fc2.weight.zero_()
            module.fc2.bias.zero_()


class MDLMPEForMaskedDiffusion(MDLMPEPreTrainedModel):
    """The whole LM (embedding, blocks, final norm, head) under the upstream checkpoint names."""

    def __init__(self, config: _ExportConfig) -> None:
        super().__init__(config)
        s = self.settings = config.settings()
        if s["position_encoding"] not in ("rope", "mdlmpe", "alibi", "absolute"):
            raise ValueError(f"config.json: unknown mdlmpe_ds.position_encoding {s['position_encoding']!r}")
        self.maths = (
            _MDLMPEMaths(s["mdlmpe"], s["max_seq_len"]) if s["position_encoding"] == "mdlmpe" else None
        )
        paths = _TOP_PATHS[s["family"]]
        self.paths = paths
        d = s["hidden_size"]
        _place(self, paths["tokens"], nn.Embedding(s["vocab_size"], d))
        if s["position_encoding"] == "absolute":
            _place(self, paths["positions"], nn.Embedding(s["max_seq_len"], d))
        if s["position_encoding"] == "mdlmpe":
            encoder = MDLMPEEmbedding(self.maths, s["head_dim"], d, s["rope_theta"], s["mask_token_id"])
            _place(self, paths["mdlmpe"], encoder)
            if self.maths.phase_mlp == "shared":  # one phase MLP read by every block
                num_pairs = s["head_dim"] // 2
                _place(self, paths["phase"], PhaseMLP(num_pairs, self.maths.hidden_width(num_pairs)))
        _place(self, paths["blocks"], nn.ModuleList(Block(s, self.maths) for _ in range(s["num_layers"])))
        _place(self, paths["norm"], RMSNorm(d, s["rms_norm_eps"]))
        if not s["tie_embeddings"]:  # tied: the head reads the token table (no separate key)
            _place(self, paths["head"], nn.Linear(d, s["vocab_size"], bias=False))
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.get_submodule(self.paths["tokens"])

    def get_output_embeddings(self) -> nn.Module | None:
        return None  # never tie through transformers: a tied checkpoint has no head key at all

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        aligned: bool = False,
        **_: Any,
    ) -> MaskedLMOutput:
        """Logits [B, L, V] in the family's upstream alignment (Dream: logit i predicts token i + 1;
        ``aligned=True``: token i); ``attention_mask`` [B, L] (1 = real token; for MDLMPE also a_t);
        ``position_ids`` [B, L] the RoPE / basis positions (default 0..L-1)."""
        s = self.settings
        length = input_ids.shape[1]
        valid = None if attention_mask is None else attention_mask.bool()
        key_valid = None if valid is None or bool(valid.all()) else valid
        positions = None if position_ids is None else position_ids.long()
        x = self.get_input_embeddings()(input_ids)  # [B, L, d]
        ctx: dict[str, Any] = {"key_valid": key_valid}
        if s["position_encoding"] == "absolute":
            if length > s["max_seq_len"]:
                raise ValueError(f"sequence length {length} exceeds the absolute table ({s['max_seq_len']})")
            x = x + self.get_submodule(self.paths["positions"]).weight[:length].to(x.dtype)
        if s["position_encoding"] == "mdlmpe":
            encoder = self.get_submodule(self.paths["mdlmpe"])
            ctx["A"], ctx["D"] = encoder.features(input_ids, valid, positions)
            x = encoder.embed(x, ctx["A"])
            if self.maths.phase_mlp == "shared":
                ctx["phase"] = self.get_submodule(self.paths["phase"])
        if s["position_encoding"] in ("rope", "mdlmpe"):
            count = length if positions is None else int(positions.max()) + 1
            t = torch.arange(count, dtype=torch.float32, device=input_ids.device)
            angles = torch.outer(t, _inverse_frequencies(s["head_dim"], s["rope_theta"], input_ids.device))
            cos, sin = angles.cos(), angles.sin()  # [L, F]
            if positions is not None:
                cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [B, 1, L, F]
            ctx["cos"], ctx["sin"] = cos, sin
        if s["position_encoding"] == "alibi":
            pos = torch.arange(length, dtype=torch.float32, device=input_ids.device)
            slopes = _alibi_slopes(s["num_heads"]).to(input_ids.device)
            bias = (-slopes[:, None, None] * (pos[None, :] - pos[:, None]).abs()).unsqueeze(0)
            if key_valid is not None:
                bias = bias.masked_fill(~key_valid[:, None, None, :], _masked_key_value(torch.float32))
            ctx["alibi"] = bias  # [B|1, H, L, L] fp32
        for block in self.get_submodule(self.paths["blocks"]):
            x = block(x, ctx)
        x = self.get_submodule(self.paths["norm"])(x)
        if s["tie_embeddings"]:
            logits = F.linear(x, self.get_input_embeddings().weight)
        else:
            logits = self.get_submodule(self.paths["head"])(x)  # [B, L, V]
        if s["family"] == "dream" and aligned:  # raw logit i-1 predicts token i
            logits = torch.cat((logits[:, :1], logits[:, :-1]), dim=1)
        return MaskedLMOutput(logits=logits)

    @torch.no_grad()
    def fill_masks(self, input_ids: torch.Tensor, steps: int | None = None) -> torch.Tensor:
        """Fill every mask token of ``input_ids`` [B, L] in ``steps`` rounds (default: one per mask):
        each round predicts all masks and keeps the most confident ones, as LLaDA's low-confidence
        remasking does; the availability features see the revealed tokens of every round."""
        mask_id = self.settings["mask_token_id"]
        ids = input_ids.clone()
        remaining = int((ids == mask_id).sum(-1).max())
        steps = remaining if steps is None else max(1, min(steps, remaining))
        for step in range(steps):
            masked = ids == mask_id  # [B, L]
            if not bool(masked.any()):
                break
            probs = torch.softmax(self(ids, aligned=True).logits.float(), dim=-1)
            confidence, guess = probs.max(-1)  # [B, L]
            confidence = confidence.masked_fill(~masked, -1.0)
            for row in range(ids.shape[0]):
                left = int(masked[row].sum())
                take = math.ceil(left / (steps - step)) if left else 0
                if take:
                    chosen = confidence[row].topk(take).indices
                    ids[row, chosen] = guess[row, chosen]
        return ids

    def chat(self, tokenizer: Any, message: str, answer_length: int = 64, steps: int | None = None) -> str:
        """Answer one user ``message``: the chat template (with the generation prompt), then
        ``answer_length`` mask tokens filled by :meth:`fill_masks`; the decoded answer."""
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        device = next(self.parameters()).device
        masks = torch.full((1, answer_length), self.settings["mask_token_id"], dtype=ids.dtype)
        out = self.fill_masks(torch.cat([ids, masks], dim=1).to(device), steps)
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


class MDLMPELLaDAModel(MDLMPEForMaskedDiffusion):
    config_class = MDLMPELLaDAConfig


class MDLMPEDreamModel(MDLMPEForMaskedDiffusion):
    config_class = MDLMPEDreamConfig
