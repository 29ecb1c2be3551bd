"""Measuring one real transformer layer on the CPU: the bytes of live tensors it keeps after forward and
its peak during backward, the ground truth of the memory plan's activation terms.

Apart from the plan (memory_plan.py) because it runs a layer (a torch dispatch mode counting tensor
storages) where the plan only does arithmetic; the tests and benchmarks/memory_plan_check.py hold
the two side by side.
"""

from __future__ import annotations

import weakref

import torch

from mdlmpe_ds.attention.impl import AttentionImpl
from mdlmpe_ds.models.block import Block, LayerContext
from mdlmpe_ds.models.config import ModelConfig
from mdlmpe_ds.models.recompute import Recompute
from mdlmpe_ds.models.transformer import build_shared_phase
from mdlmpe_ds.pe.encoder import MDLMPEEncoder
from mdlmpe_ds.pe.rope import rotary_angles


class LiveTensorBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the tensor storages created under this mode and still alive: ``current``, and the
    ``peak`` since ``reset_peak``. Not counted: the storages of ``existing`` tensors (parameters,
    inputs, shared per-forward features; also when an op returns a view of them) and 2-D outputs
    with a parameter's element count (``ignore_numels``: weight gradients, listed separately)."""

    def __init__(self, existing: list[torch.Tensor] = (), ignore_numels: set[int] | None = None) -> None:
        super().__init__()
        self.ignore_numels = ignore_numels or set()
        self.current = self.peak = 0
        self._existing = {t.untyped_storage().data_ptr() for t in existing}
        self._seen: set[int] = set()

    def reset_peak(self) -> None:
        self.peak = self.current

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        for t in flat:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            if t.dim() == 2 and t.numel() in self.ignore_numels:
                continue
            storage = t.untyped_storage()
            key, nbytes = id(storage), storage.nbytes()
            if key in self._seen or nbytes == 0 or storage.data_ptr() in self._existing:
                continue
            self._seen.add(key)
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key, nbytes)
        return out


def measure_layer(
    cfg: ModelConfig,
    batch: int,
    length: int,
    seed: int = 0,
    impl: AttentionImpl | None = None,
    recompute: Recompute | None = None,
) -> dict[str, float]:
    """One real transformer layer of ``cfg`` (fp32, CPU, training mode, checkpointing as
    ``recompute`` says, default none) on [batch, length]: bytes per token of the tensors it keeps
    after forward (``kept``, the layer output standing in for the input it holds) and the peak of
    live tensors during its backward above what was kept (``backward``: the recomputed layer and
    the gradients)."""

    torch.manual_seed(seed)
    impl = impl or AttentionImpl()
    recompute = recompute or Recompute()
    block = Block(cfg, impl=impl, shared_phase=build_shared_phase(cfg)).train()
    # The layer's weights: its own, and the model's phase MLP when phase_mlp="shared".
    shared_mlp = block.attn.phase_mlp if block.attn.phase is None else None
    weights = [*block.parameters(), *(shared_mlp.parameters() if shared_mlp is not None else [])]
    ctx = LayerContext()
    ids = torch.randint(0, cfg.vocab_size, (batch, length))
    ids[:, ::3] = cfg.mask_token_id
    if cfg.uses_rotary:
        ctx.cos, ctx.sin = rotary_angles(length, cfg.head_dim, cfg.rope_theta)
    if cfg.position_encoding == "mdlmpe":
        encoder = MDLMPEEncoder(cfg.mdlmpe, cfg.head_dim, cfg.hidden_size, cfg.rope_theta, cfg.mask_token_id)
        with torch.no_grad():
            ctx.features = encoder.features(ids)
        for p in block.attn.phase_mlp.parameters():  # a non-zero residual, as after training starts
            torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(batch, length, cfg.hidden_size, requires_grad=True)
    grad = torch.randn(batch, length, cfg.hidden_size)
    numels = {p.numel() for p in weights if p.dim() == 2}
    shared = [x, grad, *weights, *(t for t in (ctx.cos, ctx.sin) if t is not None)]
    if ctx.features is not None:  # computed once per forward for every layer: not this layer's
        shared += [t for t in ctx.features if isinstance(t, torch.Tensor)]
    tracker = LiveTensorBytes(shared, numels)
    for p in weights:  # drop each weight gradient once formed (ZeRO-3 reduces it away)
        p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    with tracker:
        if recompute.layers:
            outside = recompute.attention_outside_checkpoint(cfg.position_encoding, impl.keeps_pair_tensors)
            y = block.checkpointed(x, ctx, outside)
        else:
            y = block(x, ctx)
        kept = tracker.current
        tracker.reset_peak()
        y.backward(grad)
        backward = tracker.peak - kept
    tokens = batch * length
    return {"kept": kept / tokens, "backward": backward / tokens}


__all__ = ["LiveTensorBytes", "measure_layer"]
