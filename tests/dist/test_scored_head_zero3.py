"""The scored-positions LM head under real ZeRO-3 (2 CPU ranks, gloo): a run whose head works in
chunks of 5 rows (many chunks per micro-batch, each gathering the partitioned head weight through
DeepSpeed's module hooks, in forward and again in its backward recompute) gives the losses and
gradient norms of the default run (one chunk per micro-batch here).

Tolerance: the two runs differ only in how the head's GEMM is blocked (rows per call), i.e. the
summation order inside each logit, ~1e-7 relative per update in fp32; over 4 updates of Adam at
lr 3e-3 that stays far below 1e-4 relative (measured: see the assertion message on failure).
"""

from __future__ import annotations

import pytest
from sft_fixtures import make_chat, make_tokenizer
from sft_runs import BASE_ARGS, check, launch, metrics

pytestmark = pytest.mark.dist

STEPS = 4


def test_chunked_head_matches_one_chunk_under_zero3(tmp_path):
    data = [
        "--tokenizer", str(make_tokenizer(tmp_path / "tokenizer")),
        "--dataset", str(make_chat(tmp_path / "chat.jsonl")),
    ]  # fmt: skip
    args = [*data, *BASE_ARGS, "--max_steps", str(STEPS), "--save_every", "100"]
    runs = {}
    for name, chunk in (("one", "100000"), ("many", "5")):
        out = tmp_path / name
        proc = launch([*args, "--output_dir", str(out)], {"MDLMPE_DS_HEAD_CHUNK": chunk})
        check(proc, f"run with head chunk {chunk}")
        runs[name] = metrics(out)
    assert sorted(runs["one"]) == sorted(runs["many"]) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        masked = runs["one"][step]["train/masked_tokens"]
        assert masked > 2 * 5  # several chunks per update
        for key in ("train/loss", "train/grad_norm", "train/nll"):
            a, b = runs["one"][step][key], runs["many"][step][key]
            assert abs(a - b) <= 1e-4 * abs(a), f"update {step}: {key} one chunk {a!r} vs chunks of 5 {b!r}"
