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

Prompts longer than ``max_length`` (with the continuation, or with ``gen_length``) lose their oldest
tokens after the BOS/prefix, as lm-eval's own models do; each call that cut any logs one warning
(how many requests, by how much), and the counts are in ``truncated`` and in lm-eval's results
(``config.truncated_requests``). The model_args are checked when the adapter is built, before the
model loads; a ``gen_length`` that ``block_length`` does not divide is refused there.

Requests are seeded from (``seed``, request text), and a row's generation does not depend on its
batch, so results do not depend on ``batch_size``, request order or the number of processes.

Data parallel: under ``torchrun`` (WORLD_SIZE > 1) every process loads the model on its own GPU
(``cuda:LOCAL_RANK``) and lm-eval shards the requests by rank; results are gathered on rank 0::

    torchrun --nproc_per_node 8 launch/lm_eval_harness.py run --model mdlmpe --device cuda \\
        --model_args pretrained=outputs/llada-sft/export,dtype=bf16 --tasks gsm8k --batch_size 8
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Sequence
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from mdlmpe_ds.data.chat_templates import template_for
from mdlmpe_ds.diffusion.blocks import check_block_context
from mdlmpe_ds.diffusion.sampling import SamplerConfig, generate, trim_at_eos
from mdlmpe_ds.diffusion.sampling_rules import canonical_algorithm
from mdlmpe_ds.distributed import collectives
from mdlmpe_ds.evaluation.likelihood import blockwise_elbo, conditional_elbo, greedy_matches
from mdlmpe_ds.evaluation.loading import load_model, load_tokenizer
from mdlmpe_ds.seeding import mix_seed

logger = logging.getLogger(__name__)


def _seed_for(seed: int, *texts: str) -> int:
    return mix_seed(seed, *(zlib.crc32(t.encode("utf-8")) for t in texts))


def _bool(value: Any, key: str = "value", label: str = "model_args") -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{label} {key}={value!r}: expected true or false")
        return value.lower() in ("true", "1")
    return bool(value)


#: Integer model_args: the least value each takes, and what it counts (for the message).
_COUNTS = {
    "batch_size": (1, "requests per forward pass"),
    "mc_num": (1, "Monte-Carlo rows per loglikelihood request"),
    "mc_batch_size": (1, "Monte-Carlo rows per forward pass"),
    "max_length": (2, "tokens of context + continuation"),
    "gen_length": (1, "tokens generated per request"),
    "steps": (1, "denoising steps per request"),
    "block_length": (1, "tokens per generated block"),
    "likelihood_block": (1, "tokens per scored block"),
    "top_k": (1, "candidate tokens per position"),
}
#: Float model_args that must be >= 0.
_NON_NEGATIVE = ("temperature", "alg_temp", "cfg_scale")


def _count(key: str, value: Any, label: str) -> int:
    """A whole number >= its least value, or a ValueError naming ``key`` (``int('abc')``'s own error
    names no key, and a 0 used to surface only at the first request, under another name)."""
    low, what = _COUNTS[key]
    try:
        number = int(value)
        whole = not isinstance(value, float) or value.is_integer()
    except (TypeError, ValueError):
        whole = False
    if not whole or isinstance(value, bool):
        raise ValueError(f"{label} {key}={value!r}: expected a whole number >= {low} ({what})")
    if number < low:
        raise ValueError(f"{label} {key}={number}: must be >= {low} ({what})")
    return number


def _real(key: str, value: Any, label: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{label} {key}={value!r}: expected a number") from None


def check_model_args(values: dict[str, Any], label: str = "model_args") -> dict[str, Any]:
    """The adapter's scoring and decoding arguments parsed and checked, before any model loads:
    each message names the key at fault (``label`` names where it was given: lm-eval's
    ``model_args``, the benchmark's ``--set``). Keys absent or None are left to their defaults.

    A ``gen_length`` that ``block_length`` does not divide is refused, as ``launch/generate.py``
    refuses it: the sampler decodes whole blocks, so it would decode more tokens than asked.
    """
    out = parse_model_args(values, label)
    _check_blocks(out, label)
    return out


def parse_model_args(values: dict[str, Any], label: str = "model_args") -> dict[str, Any]:
    """Each value parsed and checked on its own (types and ranges), without the rules between keys:
    for values that are only part of the settings (the benchmark's ``--set`` before the suite's
    row is merged in)."""
    out = dict(values)
    for key, value in values.items():
        if value is None:
            continue
        if key in _COUNTS:
            out[key] = _count(key, value, label)
        elif key in _NON_NEGATIVE or key == "top_p":
            out[key] = _real(key, value, label)
            if key == "top_p" and not 0.0 < out[key] <= 1.0:
                raise ValueError(f"{label} top_p={out[key]}: must be in (0, 1] (nucleus sampling's mass)")
            if key != "top_p" and out[key] < 0:
                raise ValueError(f"{label} {key}={out[key]}: must be >= 0")
        elif key in ("check_greedy", "add_bos", "suppress_eos"):
            out[key] = _bool(value, key, label)
        elif key in ("algorithm", "block_context"):
            check = canonical_algorithm if key == "algorithm" else check_block_context
            try:
                check(str(value))
            except ValueError as err:
                raise ValueError(f"{label} {key}={value!r}: {err}") from None
    return out


def _check_blocks(args: dict[str, Any], label: str) -> None:
    """The sampler's cross-key rules (blocks, steps, Dream-only options) on the values given; a
    missing ``gen_length`` (the task's ``max_gen_toks`` at request time) is checked there."""
    gen, block, steps = args.get("gen_length"), args.get("block_length"), args.get("steps")
    if gen is not None and block is not None and gen % block:
        whole = -(-gen // block) * block
        raise ValueError(
            f"{label} gen_length={gen} is not a multiple of block_length={block}: the sampler decodes "
            f"whole blocks, so it would decode {whole} tokens; set gen_length={whole}, or a "
            f"block_length that divides {gen}"
        )
    length = gen or block or 1
    sampler = {k: args[k] for k in _SAMPLER_KEYS if args.get(k) is not None}
    sampler.update(gen_length=length, block_length=block, steps=steps or length)
    try:
        SamplerConfig(**sampler).validate()
    except ValueError as err:
        raise ValueError(f"{label.rstrip(':')}: {err}".replace("sampler: ", "")) from None


_SAMPLER_KEYS = ("block_context", "algorithm", "temperature", "top_p", "top_k", "alg_temp", "cfg_scale")


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
        args = check_model_args(
            dict(
                batch_size=None if str(batch_size).startswith("auto") else batch_size,
                mc_num=mc_num, mc_batch_size=mc_batch_size, check_greedy=check_greedy, add_bos=add_bos,
                max_length=max_length, gen_length=gen_length, steps=steps, block_length=block_length,
                block_context=block_context, algorithm=algorithm, temperature=temperature, top_p=top_p,
                top_k=top_k, alg_temp=alg_temp, suppress_eos=suppress_eos, cfg_scale=cfg_scale,
                likelihood_block=likelihood_block,
            )
        )  # fmt: skip
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
        self.batch_size = args["batch_size"] or 1
        self.mc_num, self.mc_batch_size = args["mc_num"], args["mc_batch_size"]
        self.check_greedy = args["check_greedy"]
        # Dream cannot predict position 0 (shifted logits), so its inputs start with a BOS (docs/models.md
        # §2.3).
        self.add_bos = (cfg.family == "dream") if add_bos is None else args["add_bos"]
        self.max_length = args["max_length"] or cfg.max_seq_len
        self.seed = int(seed)
        self.likelihood_block = args["likelihood_block"]
        self.progress_desc: str | None = None  # the progress bars' label (a benchmark sets the task's)
        self.sampler = {k: args[k] for k in ("gen_length", "steps", "block_length", "suppress_eos")}
        self.sampler.update({k: args[k] for k in _SAMPLER_KEYS})
        # Requests whose prompt lost its oldest tokens to max_length, per request type (this process's
        # requests); in lm-eval's results under config.truncated_requests (get_model_info).
        self.truncated: dict[str, int] = {"loglikelihood": 0, "generate_until": 0}

    # ------------------------------------------------------------------ tokenisation
    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return self.eos_id if bos is None else int(bos)

    def tok_encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prefix(self) -> list[int]:
        return [self.prefix_token_id] if self.add_bos else []

    def _fit(self, tokens: list[int], room: int, cuts: list[int]) -> list[int]:
        """``tokens`` (the adapter's prefix first) in at most ``room`` tokens: the oldest tokens after
        the prefix are dropped (a few-shot prompt loses its first examples, never the BOS the model
        needs), and the number dropped is appended to ``cuts`` for ``_report_cuts``."""
        if len(tokens) <= room:
            return tokens
        keep = len(self._prefix())
        cut = len(tokens) - room
        cuts.append(cut)
        return tokens[:keep] + tokens[keep + cut :]

    def _report_cuts(self, kind: str, cuts: list[int], total: int, room: str) -> None:
        """One warning per call (not per request) when prompts were cut, and the running count in
        ``self.truncated``: lm-eval scores a cut prompt without complaint, so the cut must be loud."""
        if not cuts:
            return
        self.truncated[kind] += len(cuts)
        logger.warning(
            "lm-eval adapter: %d of %d %s requests did not fit %s and lost their oldest prompt tokens "
            "(the BOS/prefix kept): %d tokens cut on average, at most %d. Their scores are of shortened "
            "prompts (few-shot examples missing); raise max_length (model_args; the model's max_seq_len "
            "is %d), or lower num_fewshot%s",
            len(cuts), total, kind, room, sum(cuts) // len(cuts), max(cuts), self.model.config.max_seq_len,
            " or gen_length" if kind == "generate_until" else "",
        )  # fmt: skip

    def get_model_info(self) -> dict[str, Any]:
        """Added by lm-eval's ``simple_evaluate`` to its results' ``config``: how many requests of
        this process had their prompts cut to fit ``max_length``."""
        return {"truncated_requests": dict(self.truncated), "max_length": self.max_length}

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
        out, cuts = [], []
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
            ctx = self._fit(ctx, self.max_length - len(cont), cuts)  # the prefix and the context's tail
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
        self._report_cuts(
            "loglikelihood", cuts, len(requests), f"max_length {self.max_length} with their continuations"
        )
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
        """The sampler for one group of requests. A ``gen_length`` given in model_args is a whole
        number of blocks (checked at construction); the task's ``max_gen_toks`` is rounded up to one,
        with a warning, since the task cannot be changed from here."""
        opts = dict(self.sampler)
        gen_length = opts.pop("gen_length")
        block = opts.pop("block_length")
        if gen_length is None:
            asked = int(gen_kwargs.get("max_gen_toks", 256))
            block = block or asked
            gen_length = -(-asked // block) * block
            if gen_length != asked:
                logger.warning(
                    "lm-eval adapter: the task's max_gen_toks=%d is not a multiple of model_args "
                    "block_length=%d; decoding %d tokens (whole blocks). Set gen_length= in model_args "
                    "to choose the length yourself",
                    asked, block, gen_length,
                )  # fmt: skip
        steps = opts.pop("steps") or gen_length
        return SamplerConfig(
            gen_length=gen_length, steps=steps, block_length=block or gen_length, seed=self.seed, **opts
        ).validate()

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        bar = self._progress(len(requests), "generate", disable_tqdm)
        cuts: list[int] = []
        rooms: set[int] = set()
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
                rooms.add(room)
                prompts = [self._fit(self._prefix() + self.tok_encode(c), room, cuts) for c in contexts]
                seeds = [_seed_for(self.seed, c) for c in contexts]
                gen = generate(self.model, prompts, config, seeds=seeds)
                for i, response in zip(chunk, gen.responses):
                    text = self.tokenizer.decode(trim_at_eos(response, self.eos_id), skip_special_tokens=True)
                    text = _cut_at_stop(text, until)
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        sizes = "/".join(map(str, sorted(rooms)))
        room = f"the {sizes} prompt tokens max_length {self.max_length} leaves beside gen_length"
        self._report_cuts("generate_until", cuts, len(requests), room)
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
