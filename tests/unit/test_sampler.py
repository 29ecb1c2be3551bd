"""LengthGroupedSampler: exact resume, rank partition, length grouping, order determinism."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mdlmpe_ds.data.sampler import LengthGroupedSampler


def _lengths(n=203, seed=0):
    return np.random.default_rng(seed).integers(5, 500, size=n)


def _make(lengths, rank=0, world=2, **kw):
    kw = {"micro_batch_size": 4, "seed": 11, "mega_batch_mult": 3, **kw}
    return LengthGroupedSampler(lengths, rank=rank, world_size=world, **kw)


def _run(sampler, epochs):
    """Batches of ``epochs`` epochs, trainer-style (set_epoch before each)."""
    out = []
    for e in range(epochs):
        sampler.set_epoch(e)
        out.extend(sampler)
    return out


@pytest.mark.parametrize("k", [0, 1, 7, 24, 25, 26, 27, 40])
@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_continues_exactly(k, drop_last):
    lengths = _lengths()
    straight = _run(_make(lengths, rank=1, drop_last=drop_last), epochs=2)
    first = _make(lengths, rank=1, drop_last=drop_last)
    n = len(first)
    assert n in (25, 26)
    got = []
    # Train on exactly k micro-batches (possibly across the epoch boundary), then stop.
    for e in range(2):
        if len(got) == k:
            break
        first.set_epoch(e)
        it = iter(first)
        while len(got) < k:
            batch = next(it, None)
            if batch is None:
                break
            got.append(batch)
    state = first.state_dict()
    resumed = _make(lengths, rank=1, drop_last=drop_last)
    resumed.load_state_dict(state)
    for e in range(resumed.epoch, 2):
        resumed.set_epoch(e)
        got.extend(resumed)
    assert got == straight


def test_ranks_disjoint_same_count_and_cover_epoch():
    lengths = _lengths(n=203)
    world = 3
    per_rank = [list(_make(lengths, rank=r, world=world)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1  # every rank steps the same number of times
    flat = [i for batches in per_rank for b in batches for i in b]
    assert len(flat) == len(set(flat))  # disjoint
    assert len(flat) == (203 // 12) * 12  # whole global batches, tail < one global batch dropped
    assert all(len(b) == 4 for batches in per_rank for b in batches)

    # drop_last=False: every index at least once, the wrap-around fills the last global batch.
    per_rank = [list(_make(lengths, rank=r, world=world, drop_last=False)) for r in range(world)]
    flat = [i for batches in per_rank for b in batches for i in b]
    assert set(flat) == set(range(203)) and len(flat) == 17 * 12


def test_batches_group_similar_lengths():
    lengths = _lengths(n=600, seed=1)
    sampler = _make(lengths, world=1, micro_batch_size=8, mega_batch_mult=20)
    batches = list(sampler)
    padded = sum(len(b) * lengths[b].max() for b in batches)
    real = sum(lengths[b].sum() for b in batches)
    rng = np.random.default_rng(0)
    perm = rng.permutation(600)[: len(batches) * 8].reshape(-1, 8)
    padded_random = sum(8 * lengths[b].max() for b in perm)
    assert padded / real < 1.15  # near-uniform lengths within a batch
    assert padded_random / real > 1.5  # what random batching would cost
    assert lengths[batches[0]].max() == lengths[np.concatenate(batches)].max()  # longest first (OOM early)
    maxes = [lengths[b].max() for b in batches]
    descents = np.mean([x >= y for x, y in itertools.pairwise(maxes)])
    assert descents < 0.75  # batch order shuffled, not the sorted mega-batch order (~0.95 descents)


def test_order_depends_on_seed_and_epoch_only():
    lengths = _lengths()
    a = _make(lengths)
    b = _make(lengths)
    assert list(a) == list(b)  # both now in epoch 1
    assert list(a) == list(b)
    c = _make(lengths)
    c.set_epoch(1)
    epoch1 = list(c)
    c.set_epoch(0)
    assert list(c) != epoch1
    assert list(_make(lengths, seed=12)) != list(_make(lengths))


def test_set_epoch_keeps_resumed_position_and_state_checks():
    lengths = _lengths()
    s = _make(lengths)
    list(itertools.islice(iter(s), 5))
    state = s.state_dict()
    assert (state["epoch"], state["micro_batches_consumed"], state["batches_consumed"]) == (0, 10, 5)
    r = _make(lengths)
    r.load_state_dict(state)
    r.set_epoch(0)  # the trainer's loop calls this: must not rewind
    assert r.batches_consumed == 5
    assert next(iter(r)) == s.micro_batches(0)[10].tolist()
    with pytest.raises(ValueError, match="micro_batch_size=4 but this run has micro_batch_size=2"):
        _make(lengths, micro_batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples"):
        _make(_lengths(n=100)).load_state_dict(state)
    with pytest.raises(ValueError, match="group_size=2 but this run has group_size=3"):
        _make(lengths, world=4, group_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="cannot fill one group"):
        _make(_lengths(n=5))


@pytest.mark.parametrize("new_world", [1, 3, 4])
def test_resume_on_another_world_size_continues_the_sequence(new_world):
    lengths = _lengths()
    old = [_make(lengths, rank=r, world=2) for r in range(2)]
    for s in old:
        list(itertools.islice(iter(s), 6))  # 6 steps on 2 ranks: 12 micro-batches consumed
    state = old[0].state_dict()
    sequence = old[0].micro_batches(0).tolist()
    new = [_make(lengths, rank=r, world=new_world) for r in range(new_world)]
    for s in new:
        s.load_state_dict({**state, "world_size": new_world})
    per_rank = [list(s) for s in new]
    steps = (len(sequence) - 12) // new_world
    assert all(len(b) == steps for b in per_rank)
    # step j of rank r is micro-batch 12 + j * new_world + r of the unchanged sequence
    got = [per_rank[r][j] for j in range(steps) for r in range(new_world)]
    assert got == sequence[12 : 12 + steps * new_world]
    assert all(s.epoch == 1 for s in new)


def test_ranks_of_one_step_get_similar_lengths():
    """Step time is set by the slowest rank: the micro-batches of one step come from one group."""
    lengths = _lengths(n=800, seed=2)
    world = 4

    def median_spread(batches):  # batches[j][r]: rank r's micro-batch at step j
        return np.median(
            [max(lengths[b].max() for b in step) / min(lengths[b].max() for b in step) for step in batches]
        )

    per_rank = [list(_make(lengths, rank=r, world=world, mega_batch_mult=50)) for r in range(world)]
    steps = list(zip(*per_rank))
    shuffled = [steps[j][r] for j in range(len(steps)) for r in range(world)]
    np.random.default_rng(0).shuffle(shuffled)  # same micro-batches, ranks paired at random
    random_steps = [shuffled[k : k + world] for k in range(0, len(shuffled), world)]
    assert median_spread(steps) < 1.1
    assert median_spread(random_steps) > 1.5


def test_other_data_allowed_continues_at_the_position_or_the_next_epoch():
    """train.allow_data_change on data of another size (appended rows, the usual reason): the
    documented override used to fail after the engine was built (num_samples differs). Now the
    position is kept in the same epoch of the new data's order, or the next epoch begins where the
    new epoch is shorter than the position; without the override the size change is refused."""
    s = _make(_lengths())
    list(itertools.islice(iter(s), 5))
    state = s.state_dict()  # epoch 0, 10 micro-batches consumed
    grown = _make(_lengths(n=300))
    notes = grown.load_state_dict(state, data_changed=True)
    assert (grown.epoch, grown.micro_batches_consumed) == (0, 10)
    assert "the data has 300 examples where the checkpoint's had 203" in notes[0]
    assert next(iter(grown)) == grown.micro_batches(0)[10].tolist()
    shrunk = _make(_lengths(n=16))  # 4 micro-batches per epoch: position 10 is past it
    assert "epoch 1 begins" in shrunk.load_state_dict(state, data_changed=True)[-1]
    assert (shrunk.epoch, shrunk.micro_batches_consumed) == (1, 0)
    with pytest.raises(ValueError, match="num_samples"):
        _make(_lengths(n=300)).load_state_dict(state)
    assert _make(_lengths()).load_state_dict(state, data_changed=True) == []  # same size: nothing adapted
