"""lm-evaluation-harness adapter: benchmark a LLaDA / Dream (RoPE or MDLMPE) model, paper Table 1.

Registered as lm-eval model ``mdlmpe``. One command (lm-eval's own CLI, run by
``launch/lm_eval_harness.py`` with this module imported so the name is registered)::

    python launch/lm_eval_harness.py run --model mdlmpe --device cuda \\
        --model_args pretrained=outputs/llada-sft/export,dtype=bf16,mc_num=128 \\
        --tasks mmlu,arc_challenge,hellaswag,gsm8k --batch_size 8 --output_path results/

The device is lm-eval's own ``--device`` flag (``cpu`` on a machine without a GPU); lm-eval passes
it to the model, so ``device=`` inside ``--model_args`` would be given twice.

- ``loglikelihood`` (MMLU / ARC / HellaSwag multiple choice): the conditional Monte-Carlo ELBO
  (``likelihood.conditional_elbo``; LLaDA's estimator, ``mc_num`` rows per request, seeded per
  request). ``is_greedy`` is computed only with ``check_greedy=true`` (a full greedy decode).
  ``likelihood_block=B`` scores the continuation as block diffusion does, block by block
  (``likelihood.blockwise_elbo``; later blocks as masks with ``block_context=full``, left out with
  ``blocked``).
- ``generate_until`` (GSM8K style): ``diffusion.sampling.generate`` with the sampler options below;
  the text is cut at EOS and at the task's ``until`` strings. ``gen_length`` defaults to the task's
  ``max_gen_toks``, ``steps`` to ``gen_length``.
- ``loglikelihood_rolling``: lm-eval's rolling windows (every token scored once, context +
  window <= ``max_length``); the sum of the windows' conditional ELBOs, each given its window's
  context (the BOS/EOS prefix for the first).

Requests are seeded from (``seed``, request text), and a row's generation does not depend on its
batch, so results do not depend on ``batch_size``, request order or the number of processes.

Data parallel: under ``torchrun`` (WORLD_SIZE > 1) every process loads the model on its own GPU
(``cuda:LOCAL_RANK``) and lm-eval shards the requests by rank; results are gathered on rank 0::

    torchrun --nproc_per_node 8 launch/lm_eval_harness.py run --model mdlmpe --device cuda \\
        --model_args pretrained=outputs/llada-sft/export,dtype=bf16 --tasks gsm8k --batch_size 8
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from mdlmpe_ds.data.chat_templates import template_for
from mdlmpe_ds.diffusion.sampling import SamplerConfig, generate, trim_at_eos
from mdlmpe_ds.distributed import collectives
from mdlmpe_ds.evaluation.likelihood import blockwise_elbo, conditional_elbo, greedy_matches
from mdlmpe_ds.evaluation.loading import load_model, load_tokenizer
from mdlmpe_ds.seeding import mix_seed


def _seed_for(seed: int, *texts: str) -> int:
    return mix_seed(seed, *(zlib.crc32(t.encode("utf-8")) for t in texts))


def _bool(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected a boolean, got {value!r}")
        return value.lower() in ("true", "1")
    return bool(value)


@register_model("mdlmpe")
class MDLMPEEvalLM(LM):
    """lm-eval ``LM`` over a ``DiffusionLM`` (see the module docstring for the request types).

    ``pretrained``: an exported HF directory / training output, or a ``DiffusionLM`` instance (then
    ``tokenizer`` must be given: a directory or an object with ``encode``/``decode``).
    """

    def __init__(
        self,
        pretrained: Any,
        tokenizer: Any = None,
        device: str | None = None,
        dtype: str = "fp32",
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        mc_num: int = 128,
        mc_batch_size: int = 32,
        check_greedy: bool = False,
        add_bos: bool | None = None,
        max_length: int | None = None,
        seed: int = 1234,
        gen_length: int | None = None,
        steps: int | None = None,
        block_length: int | None = None,
        block_context: str = "full",
        algorithm: str = "low_confidence",
        temperature: float = 0.0,
        top_p: float | None = None,
        top_k: int | None = None,
        alg_temp: float = 0.0,
        suppress_eos: bool = False,
        cfg_scale: float = 0.0,
        likelihood_block: int | None = None,
    ) -> None:
        super().__init__()
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._rank, self._world_size, device = _data_parallel(device)
        if isinstance(pretrained, torch.nn.Module):
            if tokenizer is None:
                raise ValueError("mdlmpe lm-eval adapter: a model object needs tokenizer=")
            self.model = pretrained.eval()
        else:
            self.model, run_tokenizer = load_model(pretrained, device=device, dtype=dtype)
            tokenizer = tokenizer if tokenizer is not None else run_tokenizer
            if tokenizer is None:
                raise ValueError(f"mdlmpe lm-eval adapter: no tokenizer in {pretrained}; pass tokenizer=DIR")
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self._device = next(self.model.parameters()).device
        cfg = self.model.config
        self.mask_id, self.eos_id = cfg.mask_token_id, cfg.eos_token_id
        self.batch_size = 1 if str(batch_size).startswith("auto") else int(batch_size)
        self.mc_num, self.mc_batch_size = int(mc_num), int(mc_batch_size)
        self.check_greedy = _bool(check_greedy)
        # Dream cannot predict position 0 (shifted logits), so its inputs start with a BOS (docs/models.md
        # §2.3).
        self.add_bos = (cfg.family == "dream") if add_bos is None else _bool(add_bos)
        self.max_length = int(max_length) if max_length is not None else cfg.max_seq_len
        self.seed = int(seed)
        self.likelihood_block = None if likelihood_block is None else int(likelihood_block)
        self.progress_desc: str | None = None  # the progress bars' label (a benchmark sets the task's)
        self.sampler = dict(
            gen_length=None if gen_length is None else int(gen_length),
            steps=None if steps is None else int(steps),
            block_length=None if block_length is None else int(block_length),
            block_context=block_context,
            algorithm=algorithm,
            temperature=float(temperature),
            top_p=None if top_p is None else float(top_p),
            top_k=None if top_k is None else int(top_k),
            alg_temp=float(alg_temp),
            suppress_eos=_bool(suppress_eos),
            cfg_scale=float(cfg_scale),
        )

    # ------------------------------------------------------------------ tokenisation
    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return self.eos_id if bos is None else int(bos)

    def tok_encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prefix(self) -> list[int]:
        return [self.prefix_token_id] if self.add_bos else []

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Tokens of context and continuation, split as lm-eval's ``TemplateLM`` does: trailing spaces
        of the context move to the continuation, which is the tail of the joint encoding."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            continuation, context = context[-spaces:] + continuation, context[:-spaces]
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        if whole[: len(ctx)] != ctx:  # the joint encoding merged across the boundary
            return self._prefix() + ctx, self.tok_encode(continuation)
        return self._prefix() + ctx, whole[len(ctx) :]

    # ------------------------------------------------------------------ requests
    def _progress(self, total: int, kind: str, disable: bool):
        from tqdm.auto import tqdm

        desc = f"{self.progress_desc}: {kind}" if self.progress_desc else kind
        return tqdm(total=total, desc=desc, unit="req", disable=disable or self._rank != 0, leave=False)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        bar = self._progress(len(requests), "loglikelihood", disable_tqdm)
        for req in requests:
            context, continuation = req.args
            ctx, cont = self._encode_pair(context, continuation)
            if not cont:
                raise ValueError(f"empty continuation for context {context[-80:]!r}")
            if len(cont) >= self.max_length:
                raise ValueError(
                    f"continuation of {len(cont)} tokens does not fit max_length {self.max_length}"
                )
            ctx = ctx[max(len(ctx) + len(cont) - self.max_length, 0) :]  # keep the context's tail
            g = torch.Generator().manual_seed(_seed_for(self.seed, context, continuation))
            if self.likelihood_block is None:
                ll = conditional_elbo(self.model, ctx, cont, self.mask_id, g, self.mc_num, self.mc_batch_size)
            else:
                ll = blockwise_elbo(
                    self.model, ctx, cont, self.mask_id, g, self.likelihood_block,
                    self.sampler["block_context"], self.mc_num, self.mc_batch_size,
                )  # fmt: skip
            greedy = greedy_matches(self.model, ctx, cont, self.mask_id) if self.check_greedy else False
            out.append((ll, greedy))
            self.cache_hook.add_partial("loglikelihood", req.args, (ll, greedy))
            bar.update(1)
        bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 1,  # context + continuation (all input here) fit max_length
                context_len=1,
            )
            total = 0.0
            for i, window in enumerate(map(make_disjoint_window, windows)):
                ctx, cont = window
                g = torch.Generator().manual_seed(_seed_for(self.seed, text, str(i)))
                total += conditional_elbo(
                    self.model, ctx, cont, self.mask_id, g, self.mc_num, self.mc_batch_size
                )
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    def _sampler_config(self, gen_kwargs: dict[str, Any]) -> SamplerConfig:
        opts = dict(self.sampler)
        gen_length = opts.pop("gen_length") or int(gen_kwargs.get("max_gen_toks", 256))
        block = opts.pop("block_length") or gen_length
        gen_length = -(-gen_length // block) * block  # a whole number of blocks
        steps = opts.pop("steps") or gen_length
        return SamplerConfig(
            gen_length=gen_length, steps=steps, block_length=block, seed=self.seed, **opts
        ).validate()

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        bar = self._progress(len(requests), "generate", disable_tqdm)
        for members in groups.values():
            gen_kwargs = requests[members[0]].args[1]
            config = self._sampler_config(gen_kwargs)
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                contexts = [requests[i].args[0] for i in chunk]
                room = self.max_length - config.gen_length
                if room < 1:
                    raise ValueError(
                        f"gen_length {config.gen_length} leaves no room in max_length {self.max_length}"
                    )
                prompts = [(self._prefix() + self.tok_encode(c))[-room:] for c in contexts]
                seeds = [_seed_for(self.seed, c) for c in contexts]
                gen = generate(self.model, prompts, config, seeds=seeds)
                for i, response in zip(chunk, gen.responses):
                    text = self.tokenizer.decode(trim_at_eos(response, self.eos_id), skip_special_tokens=True)
                    text = _cut_at_stop(text, until)
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ data parallel (lm-eval's hooks)
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor

        tensor = tensor if tensor.dim() else tensor[None]
        return torch.cat(collectives.all_gather(tensor))  # host tensors over gloo, never NCCL

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self._world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    # ------------------------------------------------------------------ chat
    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)).replace("/", "__")

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:

        template = template_for(self.model.config.family, self.tokenizer)
        return template.render(chat_history, add_generation_prompt=add_generation_prompt)


def _data_parallel(device: str) -> tuple[int, int, str]:
    """(rank, world size, device) from torchrun's environment; joins the process group if needed."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, device
    import torch.distributed as dist

    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def _cut_at_stop(text: str, until: Sequence[str]) -> str:
    for stop in until:
        if stop and stop in text:
            text = text.split(stop, 1)[0]
    return text


if __name__ == "__main__":
    raise SystemExit(
        "this command moved: python launch/lm_eval_harness.py run --model mdlmpe ... (lm-eval's flags)"
    )
