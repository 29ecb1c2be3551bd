"""Group-by-length, distributed, resumable batch sampler for SFT.

Per epoch, with a generator seeded by (seed, epoch) that every rank shares:
1. shuffle all indices;
2. cut the permutation into mega-batches of ``mega_batch_mult`` groups and sort each by length
   (longest first), so neighbouring examples have similar lengths (little EOS padding);
3. cut into groups of ``group_size`` micro-batches of ``micro_batch_size`` examples; a group is what
   the ranks of one step consume together (``group_size`` defaults to the world size), so all
   ranks of a step get similar lengths and finish together;
4. shuffle the order of the groups (optionally putting the one with the longest example first, so an
   out-of-memory error shows up at the first step, not hours later);
5. flatten to one sequence of micro-batches. At global step s, rank r takes micro-batch
   ``pos + r`` where ``pos`` is the number of micro-batches all ranks consumed so far this epoch,
   then ``pos += world_size``.
The tail that does not fill a group is dropped (``drop_last=True``) or filled by wrapping around to
the start of the permutation.

The micro-batch sequence does not depend on the world size, only on (seed, epoch, lengths,
micro_batch_size, mega_batch_mult, group_size, drop_last, longest_first). The position is
``(epoch, micro_batches_consumed)``, the same on every rank, so "run k steps, save, resume in a
fresh process" yields exactly the batches a straight run would have, and a resume
on a different number of ranks continues the same sequence at the same place (group_size is then
taken from the checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from mdlmpe_ds.seeding import mix_seed

_SAMPLER_STREAM = 0x5A3D  # separates the sampler's seeds from the noise generator's
_ORDER_KEYS = ("seed", "num_samples", "micro_batch_size", "mega_batch_mult", "drop_last", "longest_first")


class LengthGroupedSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of dataset indices); iterate it directly or pass it
    as ``DataLoader(batch_sampler=...)`` with ``num_workers=0``.

    ``lengths[i]`` is example i's token count. The position advances when a batch is yielded (a
    yielded batch counts as consumed; a prefetching DataLoader would run ahead of training).

    Epochs: exhausting an epoch moves the sampler to the next one by itself, so ``while True: for b
    in sampler`` walks epoch after epoch; ``sampler.epoch`` is the authoritative counter.
    ``set_epoch(e)`` moves to epoch e at position 0 unless the sampler is already in epoch e, which
    keeps a resumed position (the usual ``for e in ...: sampler.set_epoch(e)`` loop is safe after
    ``load_state_dict``).
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        micro_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        mega_batch_mult: int = 50,
        group_size: int | None = None,
        drop_last: bool = True,
        longest_first: bool = True,
    ) -> None:
        if micro_batch_size < 1 or world_size < 1 or mega_batch_mult < 1:
            raise ValueError("micro_batch_size, world_size and mega_batch_mult must be >= 1")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if len(self.lengths) == 0:
            raise ValueError("LengthGroupedSampler got an empty dataset")
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.mega_batch_mult = mega_batch_mult
        self.drop_last = drop_last
        self.longest_first = longest_first
        self._group_size_given = group_size is not None
        self._set_group_size(group_size or world_size)
        self.epoch = 0
        self.micro_batches_consumed = 0
        self._cache: tuple[int, np.ndarray] | None = None

    def _set_group_size(self, group_size: int) -> None:
        n, unit = len(self.lengths), self.micro_batch_size * group_size
        if self.drop_last and n < unit:
            raise ValueError(
                f"{n} examples cannot fill one group of {unit} (micro_batch_size {self.micro_batch_size} "
                f"x group_size {group_size}) with drop_last=True"
            )
        self.group_size = group_size
        self.num_groups = n // unit if self.drop_last else -(-n // unit)
        self.num_micro_batches = self.num_groups * group_size  # per epoch, all ranks together
        self._cache = None

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank (= global steps per epoch from position 0)."""
        return self.num_micro_batches // self.world_size

    @property
    def batches_consumed(self) -> int:
        """Micro-batches this rank has taken in the current epoch (global steps)."""
        return self.micro_batches_consumed // self.world_size

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.micro_batches_consumed = 0

    def micro_batches(self, epoch: int) -> np.ndarray:
        """Every micro-batch of ``epoch`` in order, all ranks: int64 [num_micro_batches, micro_batch_size]."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        g = torch.Generator().manual_seed(mix_seed(_SAMPLER_STREAM, self.seed, epoch))
        n, unit = len(self.lengths), self.micro_batch_size * self.group_size
        total = self.num_groups * unit
        perm = torch.randperm(n, generator=g).numpy()
        if total > n:  # drop_last=False: wrap around to fill the last group
            perm = np.concatenate([perm, np.resize(perm, total - n)])
        perm = perm[:total]
        mega = unit * self.mega_batch_mult
        chunks = []
        for start in range(0, total, mega):
            chunk = perm[start : start + mega]
            chunks.append(chunk[np.argsort(-self.lengths[chunk], kind="stable")])  # longest first
        groups = np.concatenate(chunks).reshape(self.num_groups, unit)
        order = torch.randperm(self.num_groups, generator=g).numpy()
        if self.longest_first:
            longest = int(np.argmax(self.lengths[groups].max(axis=1)))
            where = int(np.nonzero(order == longest)[0][0])
            order[[0, where]] = order[[where, 0]]
        batches = groups[order].reshape(self.num_micro_batches, self.micro_batch_size)
        self._cache = (epoch, batches)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        while self.micro_batches_consumed + self.world_size <= self.num_micro_batches:
            batch = self.micro_batches(epoch)[self.micro_batches_consumed + self.rank].tolist()
            self.micro_batches_consumed += self.world_size
            yield batch
            if self.epoch != epoch:  # set_epoch during iteration: stop this pass
                return
        self.epoch = epoch + 1
        self.micro_batches_consumed = 0

    def state_dict(self) -> dict[str, Any]:
        """The position plus every setting that decides the order (checked on load)."""
        return {
            "epoch": self.epoch,
            "micro_batches_consumed": self.micro_batches_consumed,
            "batches_consumed": self.batches_consumed,  # informative; the position is the line above
            "seed": self.seed,
            "num_samples": len(self.lengths),
            "micro_batch_size": self.micro_batch_size,
            "mega_batch_mult": self.mega_batch_mult,
            "group_size": self.group_size,
            "drop_last": self.drop_last,
            "longest_first": self.longest_first,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any], data_changed: bool = False) -> list[str]:
        """Continue at ``state``'s position; returns what had to be adapted (for the log).

        Raises if a setting that decides the order changed. A different world size is fine: the
        micro-batch sequence is the same, and the group size is taken from ``state`` unless this
        sampler was built with an explicit, different one (an error). ``data_changed`` (the run
        allows other data than the checkpoint's, train.allow_data_change): another number of
        examples is accepted too, in the same epoch at the same position (the order is the new
        data's), or at the start of the next epoch when the new epoch is shorter than that.
        """
        mine = self.state_dict()
        notes: list[str] = []
        for key in (*_ORDER_KEYS, "group_size"):
            if key not in state:
                raise KeyError(f"sampler state has no {key!r}")
        for key in _ORDER_KEYS:
            if key == "num_samples" and data_changed and state[key] != mine[key]:
                notes.append(f"the data has {mine[key]} examples where the checkpoint's had {state[key]}")
                continue
            if state[key] != mine[key]:
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this run has "
                    f"{key}={mine[key]!r}; the batch order would differ, so the position cannot be resumed"
                )
        if state["group_size"] != self.group_size:
            if self._group_size_given:
                raise ValueError(
                    f"sampler state was saved with group_size={state['group_size']} but this run has "
                    f"group_size={self.group_size}; the batch order would differ"
                )
            self._set_group_size(int(state["group_size"]))
        consumed = int(state["micro_batches_consumed"])
        epoch = int(state["epoch"])
        if notes and consumed >= self.num_micro_batches:
            notes.append(
                f"epoch {epoch}'s position {consumed} is past the new epoch's end: epoch {epoch + 1} begins"
            )
            epoch, consumed = epoch + 1, 0
        elif notes:
            notes.append(f"continuing epoch {epoch} at micro-batch {consumed} of {self.num_micro_batches}")
        if not 0 <= consumed <= self.num_micro_batches:
            raise ValueError(
                f"sampler state micro_batches_consumed {consumed} outside 0..{self.num_micro_batches}"
            )
        self.epoch = epoch
        self.micro_batches_consumed = consumed
        return notes
