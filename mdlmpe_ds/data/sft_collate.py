"""SFT micro-batches: ``SFTCollator`` pads tokenised examples (data/sft_encode.py) with EOS into the
trainer's tensors, with Dream-train's optional per-batch response cutoff, drawn from a generator
keyed by the batch alone so a resumed run redraws it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mdlmpe_ds.data.sft_encode import SFTExample
from mdlmpe_ds.seeding import mix_seed

PERBATCH_CUTOFFS = ("none", "random", "random_with_input_pad")
_CUTOFF_STREAM = 0x43555446  # "CUTF": keeps the cutoff draws apart from the sampler and noise streams


def response_body_len(example: SFTExample, pad_id: int) -> int:
    """Response tokens without the trailing run of ``pad_id`` (EOS): the length Dream-train's
    per-batch cutoff counts (it counts the response's non-pad tokens, and its pad is EOS)."""
    end = len(example.input_ids)
    while end > example.prompt_len and example.input_ids[end - 1] == pad_id:
        end -= 1
    return end - example.prompt_len


def cutoff_generator(seed: int, draw_key: Sequence[int]) -> torch.Generator:
    """The generator of one batch's cutoff draws, seeded by (seed, draw_key) only.

    The trainer's key is (sampler epoch, the batch's sample indices): the draw belongs to the batch,
    so a resumed run redraws it exactly, on any world size (the sampler's global micro-batch
    sequence does not depend on it), and never touches the global RNG.
    """
    g = torch.Generator()
    g.manual_seed(mix_seed(_CUTOFF_STREAM, seed, *draw_key))
    return g


class SFTCollator:
    """Pads a list of ``SFTExample`` with EOS into the tensors the trainer needs.

    Returns a dict with
    - ``input_ids`` [B, L] long: clean tokens (also the targets), pads = ``pad_id`` (EOS);
    - ``prompt_mask`` [B, L] bool: True on prompt tokens (never corrupted, never in the loss);
    - ``maskable`` [B, L] bool: response tokens plus EOS pads (official LLaDA/Dream: pads are
      trained targets); only the response when ``attend_padding=False``; never a left pad;
    - ``valid`` [B, L] bool: attention validity, True by default on everything but left pads
      (right pads are attended, as in LLaDA and official Dream SFT); also False on right pads with
      ``attend_padding=False`` (pads then neither attended nor in the loss);
    - ``answer_len`` [B] long: maskable tokens per row, LLaDA's loss normaliser;
    - ``seq_len`` [B] long: tokens of the example kept in the row (no pads of either side);
    - ``positions`` [B, L] long, only with ``perbatch_cutoff="random_with_input_pad"``: the RoPE /
      MDLMPE position of each token, 0 at the row's first real token (pads: 0). Pass it to the model.

    ``perbatch_cutoff`` (Dream-train's ``OptimizedCollateFunction``; ``DataConfig.perbatch_cutoff``):
    - ``"none"``: right-padding to the longest example, rounded up to ``pad_to_multiple_of`` but
      capped at ``max_len``;
    - ``"random"``: one row is drawn uniformly and every row is cut to (or EOS-padded up to) its
      length without trailing EOS; a row whose prompt is longer keeps only part of its prompt;
    - ``"random_with_input_pad"``: prompts are left-padded to the batch's longest prompt P (pads
      not attended, never masked, not in the loss); one row is drawn uniformly and every response
      is cut to (or EOS-padded up to) that row's response length R without trailing EOS, capped at
      ``max_len - P``; the width is P + R. The drawn row itself ends without EOS, as in Dream-train.
    Then, with probability ``resp_cutoff_ratio``, c ~ U{1 .. m - 1} columns are cut from the end of
    the batch, m the smallest ``answer_len`` (nothing when m <= 1), so each row keeps an answer token.

    Draws come from ``cutoff_generator(seed, draw_key)``; a cutoff needs ``draw_key``. An example
    longer than ``max_len`` is an error (``build_sft_dataset`` already truncates).
    """

    def __init__(
        self,
        pad_id: int,
        max_len: int | None = None,
        pad_to_multiple_of: int | None = None,
        attend_padding: bool = True,
        perbatch_cutoff: str = "none",
        resp_cutoff_ratio: float = 0.0,
        seed: int = 0,
    ) -> None:
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        if perbatch_cutoff not in PERBATCH_CUTOFFS:
            raise ValueError(f"perbatch_cutoff must be one of {PERBATCH_CUTOFFS}, got {perbatch_cutoff!r}")
        if not 0.0 <= resp_cutoff_ratio <= 1.0:
            raise ValueError(f"resp_cutoff_ratio must be in [0, 1], got {resp_cutoff_ratio}")
        self.cuts = perbatch_cutoff != "none" or resp_cutoff_ratio > 0.0
        if self.cuts and pad_to_multiple_of:
            # The rounding pads would be trained EOS right after responses the cutoff truncated.
            raise ValueError("pad_to_multiple_of cannot be combined with perbatch_cutoff / resp_cutoff_ratio")
        self.pad_id = int(pad_id)
        self.max_len = max_len
        self.pad_to_multiple_of = pad_to_multiple_of
        self.attend_padding = attend_padding
        self.perbatch_cutoff = perbatch_cutoff
        self.resp_cutoff_ratio = float(resp_cutoff_ratio)
        self.seed = int(seed)

    def __call__(
        self, examples: Sequence[SFTExample], draw_key: Sequence[int] | None = None
    ) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("SFTCollator got an empty batch")
        if self.cuts and draw_key is None:
            raise ValueError(
                "SFTCollator with a per-batch cutoff needs draw_key (e.g. the epoch and the batch's "
                "sample indices) to seed its draw"
            )
        lengths = [len(ex.input_ids) for ex in examples]
        longest = max(lengths)
        if self.max_len is not None and longest > self.max_len:
            raise ValueError(f"an SFT example has {longest} tokens > max_len {self.max_len}")
        for row, ex in enumerate(examples):
            if not 0 <= ex.prompt_len < len(ex.input_ids):
                raise ValueError(f"example {row} of the batch: prompt_len {ex.prompt_len} leaves no response")
        gen = cutoff_generator(self.seed, draw_key) if self.cuts else None
        B = len(examples)
        prompt_lens = [ex.prompt_len for ex in examples]
        # 1. Layout per row: `left` pads, then the first `kept` tokens of the example; width L.
        left, kept = [0] * B, lengths
        if self.perbatch_cutoff == "none":
            L = longest
            if self.pad_to_multiple_of:
                L = math.ceil(L / self.pad_to_multiple_of) * self.pad_to_multiple_of
                if self.max_len is not None:
                    L = min(L, self.max_len)
        else:
            drawn = int(torch.randint(B, (1,), generator=gen))
            body = response_body_len(examples[drawn], self.pad_id)
            if self.perbatch_cutoff == "random":
                L = max(1, examples[drawn].prompt_len + body)
                kept = [min(n, L) for n in lengths]
            else:  # random_with_input_pad
                P = max(prompt_lens)
                R = max(1, body)
                if self.max_len is not None:
                    R = min(R, self.max_len - P)
                L = P + R
                left = [P - p for p in prompt_lens]
                kept = [p + min(n - p, R) for p, n in zip(prompt_lens, lengths, strict=True)]
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        for row, ex in enumerate(examples):
            input_ids[row, left[row] : left[row] + kept[row]] = torch.as_tensor(
                ex.input_ids[: kept[row]], dtype=torch.long
            )
        # 2. Masks.                                                                   all [B, L]
        pos = torch.arange(L).unsqueeze(0)  # [1, L]
        start = torch.tensor(left, dtype=torch.long)[:, None]  # [B, 1] first real token
        prompt_end = start + torch.tensor(prompt_lens, dtype=torch.long)[:, None]
        prompt_mask = (pos >= start) & (pos < prompt_end)
        real = (pos >= start) & (pos < start + torch.tensor(kept, dtype=torch.long)[:, None])
        if self.perbatch_cutoff == "random_with_input_pad":
            valid = pos >= start if self.attend_padding else real
        else:
            valid = torch.ones(B, L, dtype=torch.bool) if self.attend_padding else real
        maskable = ~prompt_mask & valid
        # 3. Optional tail cut (Dream-train's resp_cutoff_ratio): keeps >= 1 answer token per row.
        if self.resp_cutoff_ratio > 0.0 and float(torch.rand(1, generator=gen)) < self.resp_cutoff_ratio:
            shortest = int(maskable.sum(dim=1).min())
            if shortest > 1:
                L -= int(torch.randint(1, shortest, (1,), generator=gen))
                input_ids, prompt_mask, real, valid, maskable = (
                    x[:, :L] for x in (input_ids, prompt_mask, real, valid, maskable)
                )
        out = {
            "input_ids": input_ids,
            "prompt_mask": prompt_mask,
            "maskable": maskable,
            "valid": valid,
            "answer_len": maskable.sum(dim=1),
            "seq_len": real.sum(dim=1),
        }
        if self.perbatch_cutoff == "random_with_input_pad":
            out["positions"] = (pos[:, :L] - start).clamp(min=0)  # [B, L]
        return out
