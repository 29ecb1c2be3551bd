"""Worker for test_scored_head_zero3.py (torchrun, 2 CPU processes, gloo): a tiny MDLMPE model
under real ZeRO-3, four micro-batches in two updates (gradient accumulation 2) whose masked counts
differ between the ranks (13 vs 6 rows: 3 vs 2 chunks of 5 rows, one empty chunk; 4 vs 0 rows: a
rank with nothing to score), the LLaDA SFT loss through either the full logits (``full``) or the
scored head in chunks of 5 (``chunked``). Rank 0 saves the losses and every parameter's full
gradient of the last micro-batch (``deepspeed.utils.safe_get_full_grad``, before the step)."""

from __future__ import annotations

import sys
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad

from mdlmpe_ds.diffusion.losses import llada_sft_loss
from mdlmpe_ds.training.head_chunks import group_chunk_count
from mdlmpe_ds.models.presets import preset
from mdlmpe_ds.models.recompute import Recompute
from mdlmpe_ds.models.transformer import DiffusionLM

CHUNK = 5
COUNTS = [(2, 7), (7, 7), (13, 6), (4, 0)]  # masked rows per micro-batch, (rank 0, rank 1)
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 5000000},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "steps_per_print": 10**9,
}


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(minutes=3))
    try:
        rank = dist.get_rank()
        torch.manual_seed(0)
        config = preset("llada-tiny", position_encoding="mdlmpe")
        with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
            model = DiffusionLM(config, recompute=Recompute(layers=True))
        for module, param in model.zero3_external_parameters():
            deepspeed.zero.register_external_parameter(module, param)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
        engine.train()
        losses = []
        for step, counts in enumerate(COUNTS):
            gen = torch.Generator().manual_seed(100 + 10 * step + rank)
            ids = torch.randint(0, config.vocab_size - 2, (2, 24), generator=gen)
            masked = torch.zeros(48, dtype=torch.bool)
            masked[torch.randperm(48, generator=gen)[: counts[rank]]] = True
            masked = masked.view(2, 24)
            noisy = torch.where(masked, torch.full_like(ids, config.mask_token_id), ids)
            p_mask = torch.tensor([0.3, 0.8])
            if mode == "full":
                out_ = engine(noisy)
            else:
                out_ = engine(
                    noisy,
                    scored=masked,
                    targets=ids,
                    head_chunk=CHUNK,
                    head_chunks=group_chunk_count(masked, CHUNK),
                )
            loss, _ = llada_sft_loss(out_, ids, masked, p_mask, torch.full((2,), 24))
            engine.backward(loss)
            losses.append(float(loss))
            if step < len(COUNTS) - 1:
                engine.step()
        grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
        if rank == 0:
            torch.save({"losses": losses, "grads": grads}, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
