"""Tokenising a corpus with several worker processes, in order and in bounded memory.

A token store of OpenWebText is ~9B tokens; one process tokenises ~0.1-0.15M tokens/s (see
benchmarks/bench_data.py), most of a day. Batches of texts go to a pool of ``workers`` processes
(spawned: nothing of the parent's process group or threads is inherited) and come back in the
order they were read, so the ids equal the single-process ones exactly; at most ``2 * workers``
batches are in flight, so a stream of any length is read as fast as it is consumed.
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor

from mdlmpe_ds.data.packing import token_documents

_tokenizer = None


def _init(tokenizer) -> None:
    global _tokenizer
    _tokenizer = tokenizer


def _encode(batch: list[str]) -> list[list[int]]:
    return _tokenizer(batch, add_special_tokens=False)["input_ids"]


def parallel_token_documents(
    texts: Iterable[str], tokenizer, workers: int, batch_size: int = 256
) -> Iterator[list[int]]:
    """Each text's ids (no special tokens), as ``data.pretrain.token_documents`` gives them, with
    ``workers`` processes (<= 1: in this process)."""

    if workers <= 1:
        yield from token_documents(texts, tokenizer, batch_size)
        return
    it = iter(texts)
    batches = iter(lambda: list(itertools.islice(it, batch_size)), [])
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init, initargs=(tokenizer,)) as pool:
        pending: deque = deque(pool.submit(_encode, b) for b in itertools.islice(batches, 2 * workers))
        while pending:
            done = pending.popleft().result()
            nxt = next(batches, None)
            if nxt is not None:
                pending.append(pool.submit(_encode, nxt))
            yield from done


def default_workers(cap: int = 32) -> int:
    """The CPUs this process may use, at most ``cap``."""
    import os

    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(cap, n))
