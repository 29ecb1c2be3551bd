"""The paper's data command at CPU scale: 2-rank ZeRO-3 pretraining with ``--dataset openwebtext
--validation openwebtext``, the corpus read (streaming) from a local copy laid out like the hub
dataset. Rank 0 builds each token store once, the other rank maps it; training and validation use
disjoint slices (the first 100K documents held out); a resume maps the stores without rebuilding.

Cost: 2 two-rank launches of 2 updates, ~1 min on 2 shared cores (most of it tokenising the
100K held-out rows once).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hub_fixtures import write_hub_dataset
from sft_runs import DS_CONFIG, REPO, check, env, free_port

from mdlmpe_ds.data.named_corpora import HUB_DATASETS_ENV, OWT_HELDOUT

pytestmark = pytest.mark.dist
TRAIN_ROWS = 400


def launch(args: list[str], hub, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        str(REPO / "launch" / "pretrain.py"), "--deepspeed", str(DS_CONFIG), *args,
    ]  # fmt: skip
    return subprocess.run(
        cmd, env=env({HUB_DATASETS_ENV: str(hub)}), capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_openwebtext_by_name_store_built_once_and_shared(assets, tmp_path):
    from mdlmpe_ds.runs.pretrain_run import sentencepiece_for_corpus

    corpus = assets("botchan").botchan
    sentences = [s.strip() for s in corpus.read_text().replace("\n", " ").split(".") if len(s.split()) > 3]
    rows = [{"text": sentences[i % len(sentences)] + "."} for i in range(OWT_HELDOUT + TRAIN_ROWS)]
    hub = tmp_path / "hub"
    write_hub_dataset(hub, "Skylion007/openwebtext", {"default": {"train": rows}}, shards=4)
    tok = sentencepiece_for_corpus(str(corpus), 400, cache_root=tmp_path / "tok")
    out = tmp_path / "run"
    args = [
        "--dataset", "openwebtext", "--validation", "openwebtext", "--tokenizer", str(tok),
        "--max_len", "32", "--micro_batch_size", "2", "--max_steps", "2", "--save_every", "1",
        "--eval_every", "2", "--eval_sequences", "2", "--eval_samples", "2", "--output_dir", str(out),
    ]  # fmt: skip
    first = launch(args, hub)
    check(first, "pretraining on openwebtext by name")
    built = [line for line in first.stderr.splitlines() if "[data] token store" in line and "built in" in line]
    assert len(built) == 2, first.stderr[-4000:]  # train and held-out, each built by rank 0 only
    manifests = [json.loads(p.read_text()) for p in sorted((out / "data_cache").glob("store-*/manifest.json"))]
    slices = sorted(m["source"]["rows"] for m in manifests)
    assert slices == [[0, OWT_HELDOUT], [OWT_HELDOUT, None]]
    counts = {tuple(m["source"]["rows"]): m["num_documents"] for m in manifests}
    assert counts[(OWT_HELDOUT, None)] == TRAIN_ROWS and counts[(0, OWT_HELDOUT)] == OWT_HELDOUT
    assert all(m["dtype"] == "uint16" and m["source"]["corpus"] == "openwebtext" for m in manifests)
    # A resume maps both stores again: nothing is rebuilt, the data fingerprint matches.
    again = launch([*args, "--max_steps", "3", "--resume", "auto"], hub)
    check(again, "resumed run")
    assert "built in" not in again.stderr
