"""ESTIMATE: the GPU time of the paper-scale mechanism study (``launch/mechanism_study.py --paper``).

Ten ``llada-100m`` pretraining runs (RoPE and MDLMPE x 5 seeds; App. B.3: 200K updates of 16
windows of 1,024 tokens on 8 GPUs, ZeRO-3, gradient checkpointing) and their scoring. No GPU has run
this shape. The figures are scaled from what one H100 measured for one LLaDA-8B layer at L 1024
(``measured_h100.json``, the pieces ``measured.assembled_step_ratio`` sums), each piece by the work
it does at the 100M shape, times an efficiency factor for small shapes (low / central / high), plus
the ZeRO-3 traffic a step cannot hide:

- MDLMPE attention (the fused kernels, fwd + bwd): the pair work, H x L^2 x |M|;
- RoPE attention (SDPA flash, fwd + bwd, and its forward again under checkpointing): H x L^2 x d_h;
- projections and SwiGLU (fwd + bwd, and the forward again): the layer's weight count (grouped
  K, V of 4 KV heads at the 100M shape);
- the LM head: hidden x vocabulary (the same 126,464 ids).

Left out on both sides: norms, embeddings, element-wise ops, the optimizer step, the in-training
validation (every 5K updates). The paper's runs used A100s; this is H100 time (an A100 has ~1/3 of
an H100's FP32 issue rate, which binds the MDLMPE kernels, and ~2/3 of its memory bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_cost import measured, step

MEASURED_LENGTH = 1024  # the recorded H100 length that the 100M recipe trains at


@dataclass(frozen=True)
class Shape:
    """What the scaled pieces depend on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    mdlmpe_pairs: int  # |M|: the rotary pairs MDLMPE turns (the odd f of F = d_h / 2)

    @property
    def layer_weights(self) -> int:
        """Q, K, V, O projections (grouped K, V) and the SwiGLU's three matrices."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden * self.ffn

    @property
    def parameters(self) -> int:
        """Weights ZeRO-3 gathers: the layers and one (tied) embedding table."""
        return self.layers * self.layer_weights + self.vocab * self.hidden


_SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab")
LLADA_8B = Shape(**{k: step.LLADA[k] for k in _SHAPE_KEYS}, mdlmpe_pairs=step.NUM_MDLMPE)
LLADA_100M = Shape(
    layers=12, hidden=768, heads=12, kv_heads=4, head_dim=64, ffn=3072, vocab=126464, mdlmpe_pairs=16
)

#: The recipe (mdlmpe_ds/config/recipes.py llada-100m) and the study (launch/mechanism_study.py).
STEPS, GLOBAL_BATCH, GPUS, SEEDS = 200_000, 16, 8, 5
#: Scoring: 256 windows x 8 draws x 3 layouts, forwards per model: RoPE plain, shuffle control,
#: context knockout; MDLMPE plain, shuffle, constant, off, context.
SCORED_FORWARDS = 256 * 8 * 3
MODES = {"rope": 3, "mdlmpe": 5}

#: (low, central, high) assumptions, each with why.
ASSUMPTIONS = {
    "small_shape": (
        (1.0, 1.5, 3.0),
        "time multiplier on every scaled piece: the 100M shape's matmuls (768 wide), 12-head flash "
        "and MDLMPE grids fill fewer of 132 SMs at lower efficiency than the 8B layer measured (no "
        "measurement at this shape: judgement)",
    ),
    "zero3_bytes_per_param": (
        (6.0, 8.0, 8.0),
        "bf16 bytes moved per parameter per step: all-gathers in forward, recompute and backward "
        "(up to 3 x 2 B; the low end keeps the gathered layers resident in the recompute) and the "
        "gradient reduce-scatter (2 B)",
    ),
    "nvlink_gbs": (
        (400.0, 300.0, 200.0),
        "NCCL ring bus bandwidth on 8 x H100 SXM (NVLink 4; nccl-tests all-gather ~350-450 GB/s at "
        "large messages, less at these 1-40 MB messages)",
    ),
    "exposed_comm": (
        (0.0, 0.5, 1.0),
        "fraction of that traffic not hidden behind compute (DeepSpeed prefetches the next "
        "layer's gather; a 100M model's layers are too short to hide all of it)",
    ),
}


def forward_share(kernels: dict[str, float]) -> float:
    """The forward's share of the fused MDLMPE kernels' fwd + bwd time, from their measured kernels
    (phase_forward + forward over all four; 0.17 at L 1024); used for the scoring only."""
    return (kernels["phase_forward"] + kernels["forward"]) / sum(kernels.values())


def scaled_pieces_ms(shape: Shape, ms: dict[str, float], fwd_share: float) -> dict[str, float]:
    """The measured 8B-layer pieces (``ms``, batch 1, L 1024) scaled to ``shape``, per sequence."""
    ref = LLADA_8B
    pair = shape.heads * shape.mdlmpe_pairs / (ref.heads * ref.mdlmpe_pairs)
    attn = shape.heads * shape.head_dim / (ref.heads * ref.head_dim)
    linear = shape.layer_weights / ref.layer_weights
    head = shape.hidden * shape.vocab / (ref.hidden * ref.vocab)
    return {
        "mdlmpe_attention": ms["mdlmpe_triton"] * pair,
        "rope_attention": (ms["rope_flash"] + ms["rope_flash_fwd"]) * attn,
        "linear": measured.linear_ms(ms) * linear,
        "lm_head": ms["lm_head"] * head,
        "mdlmpe_attention_fwd": ms["mdlmpe_triton"] * pair * fwd_share,
        "rope_attention_fwd": ms["rope_flash_fwd"] * attn,
        "linear_fwd": ms["linear_layer_fwd"] * linear,
    }


def sequence_ms(pieces: dict[str, float], encoding: str, layers: int, small: float) -> float:
    """One sequence's training work (fwd + bwd + recompute) on one GPU."""
    attention = pieces["mdlmpe_attention" if encoding == "mdlmpe" else "rope_attention"]
    return small * (layers * (pieces["linear"] + attention) + pieces["lm_head"])


def scoring_ms(pieces: dict[str, float], encoding: str, layers: int, small: float) -> float:
    """One scored forward (a third of the head's fwd + bwd)."""
    attention = pieces["mdlmpe_attention_fwd" if encoding == "mdlmpe" else "rope_attention_fwd"]
    return small * (layers * (pieces["linear_fwd"] + attention) + pieces["lm_head"] / 3)


def study_estimate(shape: Shape = LLADA_100M, record: dict | None = None) -> dict:
    """Per scenario (low, central, high): step ms, hours per run on 8 GPUs, GPU-hours of the study."""
    record = record or measured.load()
    row = record["benchmark"]["lengths"][str(MEASURED_LENGTH)]
    pieces = scaled_pieces_ms(shape, row["ms"], forward_share(row["kernels_ms"]["current"]))
    out = {"pieces_ms": pieces, "scenarios": {}}
    for i, name in enumerate(("low", "central", "high")):
        small = ASSUMPTIONS["small_shape"][0][i]
        traffic = shape.parameters * ASSUMPTIONS["zero3_bytes_per_param"][0][i] * (GPUS - 1) / GPUS
        comm = traffic / (ASSUMPTIONS["nvlink_gbs"][0][i] * 1e9) * 1e3 * ASSUMPTIONS["exposed_comm"][0][i]
        cells = {"exposed_comm_ms": comm}
        for encoding in ("rope", "mdlmpe"):
            per_gpu = GLOBAL_BATCH // GPUS
            step_ms = per_gpu * sequence_ms(pieces, encoding, shape.layers, small) + comm
            run_h = STEPS * step_ms / 3.6e6
            score_h = (
                SCORED_FORWARDS * MODES[encoding] * scoring_ms(pieces, encoding, shape.layers, small) / 3.6e6
            )
            cells[encoding] = {"step_ms": step_ms, "run_hours": run_h, "gpu_hours": GPUS * run_h + score_h}
        cells["step_ratio"] = cells["mdlmpe"]["step_ms"] / cells["rope"]["step_ms"]
        cells["study_gpu_hours"] = SEEDS * (cells["rope"]["gpu_hours"] + cells["mdlmpe"]["gpu_hours"])
        out["scenarios"][name] = cells
    return out
