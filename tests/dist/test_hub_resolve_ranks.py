"""Hub ids on 2 ranks (gloo): rank 0 resolves first and the other rank then reads the cache; a
failure on rank 0 reaches every rank as the same clear error instead of a hang at a barrier."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.dist

REV = "0" * 40


def _worker(rank: int, world: int, port: int, cache: str, results: str) -> None:
    os.environ.update(HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1")
    from huggingface_hub import constants

    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = cache, True
    from mdlmpe_ds.hub.resolve import HubResolveError, resolve

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        found = resolve("org/tiny")
        try:
            resolve("org/absent")
            missing = "no error"
        except HubResolveError as err:
            missing = str(err)
        with open(os.path.join(results, f"rank{rank}.txt"), "w") as fh:
            fh.write(f"{found}\n{missing}\n")
    finally:
        dist.destroy_process_group()


def test_ranks_resolve_the_same_snapshot_and_share_rank0_errors(tmp_path):
    from mdlmpe_ds.runs.launching import free_port

    repo = tmp_path / "cache" / "models--org--tiny"
    (repo / "snapshots" / REV).mkdir(parents=True)
    (repo / "snapshots" / REV / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path / "cache"), str(tmp_path)), nprocs=2, join=True)
    lines = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(2)]
    assert lines[0][0] == lines[1][0] == str(repo / "snapshots" / REV)
    assert "rank 0 could not fetch it" in lines[1][1] and "org/absent" in lines[1][1]
    assert "HF_HUB_OFFLINE is set" in lines[0][1]


def test_a_checkpoint_records_the_hub_id_as_written_and_the_snapshot_it_used(tmp_path):
    """An SFT run whose model is a hub id (an offline cache on local files): every checkpoint's
    config.json keeps the id as the user wrote it in the run config and records, under
    ``resolved``, the snapshot folder the run read and its commit (also for the tokenizer it took
    from the model's repo)."""
    import json
    import shutil

    import torch
    from sft_fixtures import make_chat, make_tokenizer
    from sft_runs import BASE_ARGS, check, launch

    from mdlmpe_ds.models import DiffusionLM, preset, save_pretrained

    tok = make_tokenizer(tmp_path / "tok")
    snapshot = tmp_path / "cache" / "models--org--tiny-llada" / "snapshots" / REV
    config = preset("llada-tiny", vocab_size=128, mask_token_id=3, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    save_pretrained(DiffusionLM(config), snapshot, config)
    for file in tok.iterdir():
        shutil.copy2(file, snapshot / file.name)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(REV)
    out = tmp_path / "run"
    args = ["--model_name_or_path", "org/tiny-llada", "--dataset", str(make_chat(tmp_path / "chat.jsonl"))]
    hub = {"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    proc = launch([*args, *BASE_ARGS, "--max_steps", "2", "--save_every", "2", "--output_dir", str(out)], hub)
    check(proc, "SFT from a hub id")
    meta = json.loads((out / "checkpoints" / "step_000002" / "config.json").read_text())
    assert meta["run_config"]["model"]["model_name_or_path"] == "org/tiny-llada"
    assert meta["tokenizer"] == "org/tiny-llada"
    assert meta["resolved"] == {
        "model.model_name_or_path": {"value": str(snapshot), "commit": REV},
        "tokenizer": {"value": str(snapshot), "commit": REV},
        "train.precision": {"value": "fp32", "commit": None},  # what "auto" ran in, on the CPU
    }
