"""Generation with masked diffusion LMs: LLaDA's and Dream's samplers, semi-AR blocks, both block regimes.

``generate(model, prompts, SamplerConfig(...))`` fills a canvas of ``gen_length`` mask tokens after
each prompt, block by block (``block_length``; one block = plain LLaDA/Dream), revealing at every
step the scheduled number of the most confident masked positions of the active block
(``sampling_rules``). The model is called on the current state at every step, so MDLMPE's
availability (b from ``ids != mask``, a from ``valid``) is recomputed from that state after every
update, exactly as in training (paper §3.4). Family differences stay in the model: logits are
aligned (Dream's shift is applied inside ``DiffusionLM.forward``).

Layout of a batch: row r is ``[prompt_r, gen_length masks, padding]``; padding is only at the end
and is invalid (never attended, a_t = 0). Every real token therefore sits at the position it would
have alone, which keeps RoPE, absolute embeddings and MDLMPE's absolute sine basis (docs/method.md "Token
summaries") unchanged by batching; left padding would shift MDLMPE's features. Randomness comes from
one generator per row seeded from that row's seed, so a batch gives the rows' single-prompt results.

EOS early stop (``stop_at_eos``): a row is finished once an EOS has been revealed and every response
position before the first revealed EOS is revealed. Revealed tokens are never remasked, so its text
up to that EOS can no longer change: stopping saves compute without changing the output. The rest of
a finished row is returned as EOS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from mdlmpe_ds.diffusion.blocks import check_block_context, num_blocks, sampling_visibility
from mdlmpe_ds.diffusion.sampling_rules import (
    LLADA_ALGORITHMS,
    SCHEDULES,
    canonical_algorithm,
    dream_proposal,
    llada_proposal,
    origin_positions,
    select_positions,
    transfer_counts,
)
from mdlmpe_ds.seeding import mix_seed

_SEED_STREAM = 0x53414D50  # "SAMP": keeps sampling streams apart from training-noise streams


@dataclass
class SamplerConfig:
    """Sampler options (docs/models.md §4). Defaults are LLaDA's ``generate()`` defaults.

    ``block_length`` None = one block of ``gen_length``; ``steps`` must be a multiple of the number
    of blocks. ``schedule`` 'auto' = 'linear' (LLaDA) for ``low_confidence``/``random``, 'dream' for
    the Dream algorithms (``origin`` has none: it reveals each mask with probability 1 - s/t).
    ``temperature`` is the Gumbel temperature for LLaDA algorithms and the
    logit temperature for Dream ones; ``top_p``/``top_k``/``alg_temp`` are Dream's (``alg_temp`` > 0
    draws the revealed positions from softmax(confidence / alg_temp)). ``suppress_eos`` sets the EOS
    logit to -inf (LLaDA's ``logits_eos_inf``). ``cfg_scale`` > 0 is LLaDA's unsupervised
    classifier-free guidance: logits = u + (cfg + 1)(c - u), u from a copy whose prompt is masked.
    """

    gen_length: int = 128
    steps: int = 128
    block_length: int | None = None
    block_context: str = "full"
    algorithm: str = "low_confidence"
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    alg_temp: float = 0.0
    schedule: str = "auto"
    eps: float = 1e-3
    stop_at_eos: bool = True
    suppress_eos: bool = False
    cfg_scale: float = 0.0
    seed: int = 0

    @property
    def block(self) -> int:
        return self.gen_length if self.block_length is None else self.block_length

    @property
    def resolved_schedule(self) -> str:
        if self.schedule != "auto":
            return self.schedule
        return "linear" if canonical_algorithm(self.algorithm) in LLADA_ALGORITHMS else "dream"

    def validate(self) -> SamplerConfig:
        blocks = num_blocks(self.gen_length, self.block)
        if self.steps < 1 or self.steps % blocks:
            raise ValueError(
                f"sampler: steps={self.steps} must be a positive multiple of the {blocks} blocks"
            )
        check_block_context(self.block_context)
        algorithm = canonical_algorithm(self.algorithm)
        if self.schedule != "auto" and self.schedule not in SCHEDULES:
            raise ValueError(f"sampler: schedule={self.schedule!r} must be 'auto' or one of {SCHEDULES}")
        if self.temperature < 0 or self.alg_temp < 0 or self.cfg_scale < 0:
            raise ValueError("sampler: temperature, alg_temp and cfg_scale must be >= 0")
        if algorithm in LLADA_ALGORITHMS and (
            self.top_p is not None or self.top_k is not None or self.alg_temp > 0
        ):
            raise ValueError(
                f"sampler: top_p/top_k/alg_temp are Dream options; algorithm {self.algorithm!r} uses "
                "LLaDA's Gumbel sampling (choose maskgit_plus, margin or entropy)"
            )
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampler: top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"sampler: top_k={self.top_k} must be >= 1")
        return self


class Canvas(NamedTuple):
    """A batch laid out for generation: ``ids`` [B, L] long, ``real`` [B, L] bool (False on the
    trailing padding), ``gen_start`` [B] long (first response position = prompt length)."""

    ids: torch.Tensor
    real: torch.Tensor
    gen_start: torch.Tensor


def build_canvas(
    prompts: Sequence[Sequence[int] | torch.Tensor],
    gen_length: int,
    mask_id: int,
    pad_id: int,
    device: torch.device | str | None = None,
) -> Canvas:
    """Rows ``[prompt_r, gen_length masks, pad...]`` padded at the end to the longest row."""
    if not prompts:
        raise ValueError("generate: no prompts given")
    if pad_id == mask_id:
        raise ValueError(f"pad id {pad_id} equals the mask id; padding would read as masked tokens")
    rows = [torch.as_tensor(p, dtype=torch.long).flatten().cpu() for p in prompts]
    for r, row in enumerate(rows):
        if row.numel() == 0:
            raise ValueError(f"prompt {r} is empty (give at least a BOS token)")
        if bool((row == mask_id).any()):
            raise ValueError(f"prompt {r} contains the mask token id {mask_id}")
    lengths = torch.tensor([row.numel() for row in rows])  # [B]
    L = int(lengths.max()) + gen_length
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : row.numel()] = row
        ids[r, row.numel() : row.numel() + gen_length] = mask_id
    pos = torch.arange(L)[None, :]  # [1, L]
    real = pos < (lengths[:, None] + gen_length)  # [B, L]
    return Canvas(ids.to(device), real.to(device), lengths.to(device))


class StepRecord(NamedTuple):
    """One denoising step: ``block``, ``step`` (global index), the ``input_ids`` and ``valid`` [B, L]
    the model was called on, and ``revealed`` [B] long, tokens committed per row by this step."""

    block: int
    step: int
    input_ids: torch.Tensor
    valid: torch.Tensor
    revealed: torch.Tensor


class GenerationOutput(NamedTuple):
    """``responses`` [B, gen_length] (no mask tokens left; EOS after a finished row's first EOS),
    ``sequences`` [B, L] the final canvas, ``gen_start`` [B], ``finished`` [B] bool (stopped at EOS),
    ``steps_run`` (model calls), ``history`` (``StepRecord`` per step when asked, else None)."""

    responses: torch.Tensor
    sequences: torch.Tensor
    gen_start: torch.Tensor
    finished: torch.Tensor
    steps_run: int
    history: list[StepRecord] | None


def eos_finished(responses: torch.Tensor, mask_id: int, eos_id: int) -> torch.Tensor:
    """Rows whose first revealed EOS has no mask before it (see module docstring). [B, G] -> [B] bool."""
    G = responses.shape[1]
    pos = torch.arange(G, device=responses.device)[None, :]  # [1, G]
    is_eos = responses == eos_id  # [B, G]
    first = torch.where(is_eos, pos, G).min(1).values  # [B], G when none
    masked_before = ((responses == mask_id) & (pos < first[:, None])).any(1)  # [B]
    return (first < G) & ~masked_before


def trim_at_eos(response: Sequence[int] | torch.Tensor, eos_id: int) -> list[int]:
    """The response tokens before the first EOS (all of them when there is none)."""
    tokens = [int(x) for x in response]
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


def _special_ids(
    model: Any, mask_id: int | None, eos_id: int | None, pad_id: int | None
) -> tuple[int, int, int]:
    config = getattr(model, "config", None)
    ids = []
    for given, key in ((mask_id, "mask_token_id"), (eos_id, "eos_token_id"), (pad_id, "pad_token_id")):
        if given is None:
            if config is None or not hasattr(config, key):
                raise ValueError(f"generate: {key} not given and the model has no config.{key}")
            given = getattr(config, key)
        ids.append(int(given))
    return ids[0], ids[1], ids[2]


def row_generators(seeds: Sequence[int], device: torch.device | str) -> list[torch.Generator]:
    """One generator per row, seeded from the row's seed only (batch-composition independent)."""
    gens = []
    for seed in seeds:
        g = torch.Generator(device=device)
        g.manual_seed(mix_seed(_SEED_STREAM, int(seed)))
        gens.append(g)
    return gens


def _guided_logits(
    model: Callable[..., torch.Tensor],
    ids: torch.Tensor,
    valid: torch.Tensor,
    gen_start: torch.Tensor,
    mask_id: int,
    cfg_scale: float,
) -> torch.Tensor:
    """The model's logits on the state, with LLaDA's classifier-free guidance when cfg_scale > 0:
    the unconditional copy has every prompt token masked (same validity). -> [B, L, V]."""
    if cfg_scale <= 0:
        return model(ids, valid=valid)
    B, L = ids.shape
    prompt = torch.arange(L, device=ids.device)[None, :] < gen_start[:, None]  # [B, L]
    both = model(torch.cat([ids, ids.masked_fill(prompt, mask_id)]), valid=torch.cat([valid, valid]))
    cond, uncond = both[:B], both[B:]  # [B, L, V] each
    return uncond + (cfg_scale + 1.0) * (cond - uncond)


@torch.no_grad()
def generate(
    model: Callable[..., torch.Tensor],
    prompts: Sequence[Sequence[int] | torch.Tensor],
    config: SamplerConfig,
    *,
    seeds: Sequence[int] | None = None,
    mask_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    record_history: bool = False,
    on_step: Callable[[int, int, torch.Tensor], None] | None = None,
) -> GenerationOutput:
    """Generate ``config.gen_length`` tokens after each prompt.

    ``model(input_ids [B, L], valid=[B, L] bool) -> aligned logits [B, L, V]`` (``DiffusionLM``).
    Special ids default to ``model.config``. ``seeds`` [B] (default: ``config.seed`` for every
    row): the output of a row depends only on its prompt and seed. ``on_step(step, block,
    responses [B, G])`` is called after every update (e.g. to print each denoising step).
    """
    config.validate()
    mask_id, eos_id, pad_id = _special_ids(model, mask_id, eos_id, pad_id)
    device = next(model.parameters()).device if isinstance(model, torch.nn.Module) else torch.device("cpu")
    algorithm = canonical_algorithm(config.algorithm)
    canvas = build_canvas(prompts, config.gen_length, mask_id, pad_id, device)
    ids, real, gen_start = canvas
    B = ids.shape[0]
    seeds = [config.seed] * B if seeds is None else list(seeds)
    if len(seeds) != B:
        raise ValueError(f"generate: got {len(seeds)} seeds for {B} prompts")
    gens = row_generators(seeds, device)
    Bl = config.block
    steps_per_block = config.steps // num_blocks(config.gen_length, Bl)
    gen_pos = gen_start[:, None] + torch.arange(config.gen_length, device=device)[None, :]  # [B, G]
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    history: list[StepRecord] | None = [] if record_history else None
    steps_run, step = 0, 0
    for block in range(num_blocks(config.gen_length, Bl)):
        lo, hi = block * Bl, (block + 1) * Bl
        idx = gen_pos[:, lo:hi]  # [B, Bl] absolute positions of the active block
        valid = sampling_visibility(real, gen_start, hi, config.block_context)  # [B, L]
        num_masked = (ids.gather(1, idx) == mask_id).sum(1)  # [B]
        counts = transfer_counts(num_masked, steps_per_block, config.resolved_schedule, config.eps)
        for k in range(steps_per_block):
            step_counts = counts[:, k].masked_fill(finished, 0)  # [B]
            if bool(finished.all()):
                break
            if algorithm == "origin":  # a random count: every live row takes every step (as Dream)
                step_counts = (~finished).long()
            if int(step_counts.sum()) == 0:  # nothing scheduled for any live row: no call, no draw
                step += 1
                continue
            state = ids.clone() if record_history else None
            # 1. One forward on the current state: MDLMPE recomputes (b, a, A, D) from it.
            logits = _guided_logits(model, ids, valid, gen_start, mask_id, config.cfg_scale)  # [B, L, V]
            V = logits.shape[-1]
            block_logits = logits.gather(1, idx[..., None].expand(-1, -1, V))  # [B, Bl, V]
            # The mask token is never a prediction (a "revealed" mask would stay masked forever).
            block_logits[..., mask_id] = float("-inf")
            if config.suppress_eos:
                block_logits[..., eos_id] = float("-inf")
            # 2. Propose a token and a confidence for every position of the active block.
            if algorithm in LLADA_ALGORITHMS:
                proposal = llada_proposal(block_logits, algorithm, config.temperature, gens)
            else:
                proposal = dream_proposal(
                    block_logits, algorithm, config.temperature, config.top_p, config.top_k, gens
                )
            # 3. Reveal the scheduled number of the most confident masked positions.
            block_ids = ids.gather(1, idx)  # [B, Bl]
            eligible = (block_ids == mask_id) & ~finished[:, None]  # [B, Bl]
            if algorithm == "origin":
                chosen = origin_positions(eligible, k, steps_per_block, config.eps, gens)
            else:
                chosen = select_positions(proposal.confidence, eligible, step_counts, config.alg_temp, gens)
            ids.scatter_(1, idx, torch.where(chosen, proposal.x0, block_ids))
            steps_run += 1
            if history is not None:
                history.append(StepRecord(block, step, state, valid.clone(), chosen.sum(1)))
            responses = ids.gather(1, gen_pos)  # [B, G]
            if config.stop_at_eos:
                finished |= eos_finished(responses, mask_id, eos_id)
            if on_step is not None:
                on_step(step, block, responses)
            step += 1
    responses = ids.gather(1, gen_pos)  # [B, G]
    # A finished row keeps its text up to the first EOS; the (possibly masked) rest becomes EOS.
    first = torch.where(
        responses == eos_id, torch.arange(config.gen_length, device=device)[None, :], config.gen_length
    )
    after = torch.arange(config.gen_length, device=device)[None, :] > first.min(1).values[:, None]  # [B, G]
    responses = torch.where(after & finished[:, None], torch.full_like(responses, eos_id), responses)
    ids.scatter_(1, gen_pos, responses)
    return GenerationOutput(responses, ids, gen_start, finished, steps_run, history)
