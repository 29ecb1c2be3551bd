"""The memory plan (mdlmpe_ds/training/memory_plan.py) against measured CPU runs, and the 8-GPU plans.

1. Activation terms: one real layer at LLaDA-8B width (d 4096, 32 heads, SwiGLU 12288) and at
   Dream-7B width (d 3584, 28 query and 4 KV heads, SwiGLU 18944), fp32 on the CPU, every
   checkpointing mode: live tensor bytes per token kept after forward and at
   the peak of backward (``measure_layer``) next to the plan's ``layer_activation_bytes``.
2. The scored-positions head: peak live bytes of ``scored_cross_entropy`` fwd + bwd on M rows in
   chunks, real vocabulary, next to the plan's ``head_bytes`` (fp32).
3. The per-GPU plan of LLaDA-8B and Dream-7B SFT on 8 GPUs (bf16, ZeRO-3, with and without
   offload) for micro-batches 1, 2, 4 at L = 2048 and 4096 -- the table of docs/gpu.md.

    python benchmarks/memory_plan_check.py               # all three (~2-3 min, ~2 GB RAM)
    python benchmarks/memory_plan_check.py --plans-only  # 3. only (seconds)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mdlmpe_ds.attention.impl import AttentionImpl
from mdlmpe_ds.models.presets import preset
from mdlmpe_ds.models.recompute import Recompute
from mdlmpe_ds.models.scored_head import scored_cross_entropy
from mdlmpe_ds.pe.config import MDLMPEConfig
from mdlmpe_ds.training.activation_bytes import head_bytes, layer_activation_bytes
from mdlmpe_ds.training.memory_measure import LiveTensorBytes, measure_layer
from mdlmpe_ds.training.memory_plan import GIB, plan_memory

REPO = Path(__file__).resolve().parents[1]
CHECKPOINTED = Recompute(layers=True)  # what a training run uses (model.gradient_checkpointing)
MODES = (
    ("rope", False, {}),
    ("rope", True, {}),
    ("mdlmpe", True, {}),
    ("mdlmpe", False, {}),
    ("mdlmpe", True, {"backend": "reference"}),
)


def layer_table(length: int, batch: int) -> list[dict]:
    rows = []
    for name in ("llada-8b", "dream-7b"):
        base = preset(name)
        for encoding, ckpt, extra in MODES:
            cfg = preset(
                name,
                num_layers=1,
                max_seq_len=length,
                position_encoding=encoding,
                mdlmpe=MDLMPEConfig(max_seq_len=length),
            )
            impl, recompute = AttentionImpl(**extra), Recompute(layers=ckpt)
            start = time.perf_counter()
            measured = measure_layer(cfg, batch, length, impl=impl, recompute=recompute)
            plan = layer_activation_bytes(cfg, 4, batch, length, impl=impl, recompute=recompute)
            peak = measured["kept"] + measured["backward"]
            label = f"{name} {encoding}{' ckpt' if ckpt else ''}{' reference' if extra else ''}"
            rows.append(
                {
                    "layer": label,
                    "d": base.hidden_size,
                    "kept_measured_kb": measured["kept"] / 1024,
                    "kept_plan_kb": plan["kept"] / 1024,
                    "peak_measured_kb": peak / 1024,
                    "peak_plan_kb": plan["peak"] / 1024,
                    "peak_ratio": plan["peak"] / peak,
                    "seconds": time.perf_counter() - start,
                }
            )
            r = rows[-1]
            print(
                f"{label:<36} kept {r['kept_measured_kb']:7.1f} / plan {r['kept_plan_kb']:7.1f} KB/token   "
                f"peak {r['peak_measured_kb']:7.1f} / plan {r['peak_plan_kb']:7.1f} KB/token  "
                f"plan/measured {r['peak_ratio']:.3f}  ({r['seconds']:.0f} s)",
                flush=True,
            )
    return rows


def head_check(rows: int, chunk: int, width: int = 512) -> dict:
    """Peak live bytes of the chunked head + fp32 CE, fwd + bwd, LLaDA's vocabulary, fp32."""
    cfg = preset("llada-8b")
    torch.manual_seed(0)
    head = torch.nn.Linear(width, cfg.vocab_size, bias=False)
    hidden = torch.randn(rows, width, requires_grad=True)
    targets = torch.randint(0, cfg.vocab_size, (rows,))
    tracker = LiveTensorBytes([hidden, targets, head.weight], {head.weight.numel()})
    head.weight.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    with tracker:
        ce = scored_cross_entropy(head, hidden, targets, chunk)
        ce.sum().backward()
    planned = head_bytes(preset("llada-8b", hidden_size=width, num_heads=4, num_kv_heads=4), 4, rows, chunk)
    planned -= 2 * rows * width * 4  # the gathered hidden rows and their norm live outside this call
    out = {"rows": rows, "chunk": chunk, "measured_mb": tracker.peak / 2**20, "plan_mb": planned / 2**20}
    out["ratio"] = planned / tracker.peak
    print(
        f"scored head, {rows} rows in chunks of {chunk}, V {cfg.vocab_size}: "
        f"peak {out['measured_mb']:.0f} MB / plan {out['plan_mb']:.0f} MB "
        f"(plan/measured {out['ratio']:.3f}); full logits would hold "
        f"{rows * cfg.vocab_size * 4 * 3 / 2**20:.0f} MB",
        flush=True,
    )
    return out


def gpu_plans() -> list[dict]:
    out = []
    for config in ("zero3.json", "zero3_offload.json"):
        ds = json.loads((REPO / "ds_configs" / config).read_text())
        ds["bf16"] = {"enabled": True}
        for name in ("llada-8b", "dream-7b"):
            for backend in ("triton", "blocked"):
                for length in (2048, 4096):
                    cfg = preset(
                        name,
                        max_seq_len=length,
                        position_encoding="mdlmpe",
                        mdlmpe=MDLMPEConfig(max_seq_len=length),
                    )
                    impl = AttentionImpl(backend=backend)
                    totals = [
                        plan_memory(cfg, ds, 8, b, length, impl=impl, recompute=CHECKPOINTED).total / GIB
                        for b in (1, 2, 4)
                    ]
                    out.append(
                        {
                            "config": config,
                            "model": name,
                            "backend": backend,
                            "L": length,
                            "gib_b1_b2_b4": totals,
                        }
                    )
                    print(
                        f"{config:<19} {name:<9} {backend:<8} L {length}: micro-batch 1/2/4 -> "
                        + " / ".join(f"{t:5.1f}" for t in totals)
                        + " GiB per GPU (plan)",
                        flush=True,
                    )
    cfg = preset("llada-8b", position_encoding="mdlmpe")
    ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    ds["bf16"] = {"enabled": True}
    print(plan_memory(cfg, ds, 8, 1, 4096, recompute=CHECKPOINTED).format())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=128, help="L of the measured layers")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--plans-only", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict = {}
    if not args.plans_only:
        result["layers"] = layer_table(args.length, args.batch)
        result["head"] = head_check(3000, 1024)
    result["plans"] = gpu_plans()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
