"""Multi-GPU startup without a GPU: our host-tensor collectives under NCCL's device rule, and the
data setup that waits on its own timeout, node by node.

NCCL carries CUDA tensors only, so on a GPU run an ``all_reduce`` of a CPU tensor on the default
group raises. ``nccl_mimic/sitecustomize.py`` makes the workers' default group follow that rule on
this CPU machine (module doc there); real SFT and pretraining runs (2 ranks, real DeepSpeed ZeRO-3)
must then pass, with every host collective of ours on a gloo group. ``setup_worker.py`` checks
``rank_zero_first``: each node's local rank 0 builds first, the others wait on
``train.setup_timeout_min`` rather than the (here 3 s) collective timeout.
A run started as two nodes from two folders (node-local output_dirs) must stop before it trains.
Cost: 6 two-rank launches, ~2.5 min on 2 shared cores.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sft_fixtures import make_chat, make_tokenizer
from sft_runs import BASE_ARGS, DS_CONFIG, REPO, check, env, free_port, launch_as_two_nodes, metrics

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent


def mimic_env(log: Path) -> dict[str, str]:
    path = [str(HERE / "nccl_mimic"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        "MDLMPE_DS_TEST_NCCL_MIMIC": "1",
        "MDLMPE_DS_TEST_NCCL_MIMIC_LOG": str(log),
        "PYTHONPATH": os.pathsep.join(path),
    }


def checked_calls(log: Path) -> collections.Counter:
    """(rank, op, caller module) -> how many collectives of ours the mimic let through."""
    return collections.Counter(tuple(line.split()) for line in log.read_text().splitlines() if line)


def test_sft_under_nccl_device_rule(tmp_path):
    """Started as two nodes of one GPU each (shared filesystem): every rank is its node's first,
    so both build the data cache at once into the one output_dir, and rank 0 commits a checkpoint
    holding both nodes' shards. (Checked by hand: this run, stopped at 2 and resumed, gives the
    losses and gradient norms of the same run on one node of 2 ranks bit for bit.)"""
    data = [
        "--tokenizer",
        str(make_tokenizer(tmp_path / "tok")),
        "--dataset",
        str(make_chat(tmp_path / "c.jsonl")),
    ]
    out, log = tmp_path / "out", tmp_path / "mimic.log"
    args = [*data, *BASE_ARGS, "--max_steps", "2", "--save_every", "2", "--output_dir", str(out)]
    for node, proc in enumerate(launch_as_two_nodes(args, mimic_env(log))):
        check(proc, f"SFT under the NCCL device rule, node {node} of 2")
    assert sorted(metrics(out)) == [1, 2]
    step = out / "checkpoints" / "step_000002"
    assert (step / "COMPLETE").is_file() and not list(step.parent.glob("*.saving"))
    assert sorted(p.name for p in step.glob("trainer_state_rank*.pt")) == [
        "trainer_state_rank0.pt",
        "trainer_state_rank1.pt",
    ]
    assert len(list(step.rglob("zero_pp_rank_*_model_states.pt"))) == 2
    calls = checked_calls(log)
    for rank in ("0", "1"):
        assert calls[(rank, "all_reduce", "mdlmpe_ds.distributed.collectives")] >= 2  # one per update
        assert calls[(rank, "all_gather", "mdlmpe_ds.distributed.collectives")] >= 1  # the data fingerprint
    # The tokenised data is cached under the output dir: a restart or resume does not tokenise again.
    assert len(list((out / "data_cache").glob("sft-*.npz"))) == 1


def test_pretrain_under_nccl_device_rule(assets, tmp_path):
    from mdlmpe_ds.runs.pretrain_run import sentencepiece_for_corpus

    corpus = assets("botchan").botchan
    tok = sentencepiece_for_corpus(str(corpus), 400, cache_root=tmp_path / "tok")
    out, log = tmp_path / "out", tmp_path / "mimic.log"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        str(REPO / "launch" / "pretrain.py"), "--deepspeed", str(DS_CONFIG),
        "--dataset", str(corpus), "--validation", str(corpus), "--tokenizer", str(tok),
        "--text_split", "paragraph", "--max_len", "32", "--micro_batch_size", "2", "--max_steps", "2",
        "--save_every", "2", "--eval_every", "2", "--eval_sequences", "2", "--eval_samples", "2",
        "--warmup_steps", "1", "--output_dir", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env(mimic_env(log)), capture_output=True, text=True, timeout=240, cwd=REPO)
    check(proc, "2-rank pretraining run under the NCCL device rule")
    assert sorted(metrics(out)) == [1, 2]
    calls = checked_calls(log)
    for rank in ("0", "1"):
        assert calls[(rank, "all_reduce", "mdlmpe_ds.distributed.collectives")] >= 2
        assert (
            calls[(rank, "all_gather", "mdlmpe_ds.distributed.collectives")] >= 1
        )  # the token-stream fingerprint
    # Training and validation windows of the same corpus: one token store, built once, complete.
    assert len(list((out / "data_cache").glob("store-*/COMPLETE"))) == 1


@pytest.mark.parametrize("mode", ["node", "two_nodes"])
def test_setup_waits_node_by_node_on_its_own_timeout(mode, tmp_path):
    """node: one node of 2 ranks; local rank 0 builds for 8 s (longer than the 3 s collective
    timeout), then rank 1. two_nodes: each rank alone on its node (LOCAL_RANK 0 on both): both build
    first, at the same time, each waiting for the other's start."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        str(HERE / "setup_worker.py"), mode, str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=180, cwd=REPO)
    check(proc, f"setup worker ({mode})")
    assert sorted(p.name for p in tmp_path.glob("done-*")) == ["done-0", "done-1"]


def test_setup_timeout_names_its_setting(tmp_path):
    """A node's first rank slower than train.setup_timeout_min: the waiting ranks fail, and say
    which setting to raise."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        str(HERE / "setup_worker.py"), "late", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode != 0
    assert "not every rank finished data setup on each node's first rank" in proc.stderr
    assert "train.setup_timeout_min" in proc.stderr


def test_a_rank_that_fails_during_setup_is_not_called_a_timeout(tmp_path):
    """Rank 0 fails in its build after 1 s (say, on a damaged cache file): rank 1 says a rank stopped
    and after how long, instead of claiming that the 2 min setup timeout ran out."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        str(HERE / "setup_worker.py"), "fails", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode != 0
    assert "rank 0's own error" in proc.stderr
    assert "rank 1: another rank stopped during data setup on each node's first rank after" in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert "within 2 min" not in proc.stderr


def test_an_output_dir_on_node_local_disks_stops_the_run_before_it_trains(tmp_path):
    """Two nodes of one rank each started in different folders with the same relative --output_dir:
    each node's own disk at the same path. Without the check the run trained and exited 0 while
    rank 1's shards of every checkpoint stayed in step_N.saving on its disk, where the next start
    deletes them. Now both ranks stop before the data and the engine, naming the rank that does not
    see rank 0's directory."""
    data = [
        "--tokenizer",
        str(make_tokenizer(tmp_path / "tok")),
        "--dataset",
        str(make_chat(tmp_path / "c.jsonl")),
    ]
    folders = (tmp_path / "node0", tmp_path / "node1")
    for folder in folders:
        folder.mkdir()
    args = [*data, *BASE_ARGS, "--max_steps", "2", "--save_every", "1", "--output_dir", "out"]
    procs = launch_as_two_nodes(args, folders=folders)
    assert [proc.returncode for proc in procs] != [0, 0], procs[0].stdout[-3000:]
    for proc in procs:
        assert "is not one directory for every rank: rank 1 on" in proc.stdout, proc.stdout[-3000:]
        assert "does not see the run lock" in proc.stdout and "Nothing was trained" in proc.stdout
    for folder in folders:
        assert (
            not (folder / "out" / "checkpoints").exists() and not (folder / "out" / "metrics.jsonl").exists()
        )
