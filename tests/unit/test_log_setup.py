"""Logging is configured once per process: rank 0 shows notes, the other ranks only warnings, each
line names its rank; the run assembly's notes reach the console through it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging, sys
from mdlmpe_ds.training.log_setup import configure
configure()
configure(rank=5)  # a second call changes nothing
log = logging.getLogger("mdlmpe_ds.runs.common")
log.info("a note")
log.warning("a warning")
logging.getLogger("other").warning("not ours")
"""


def run(rank: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={"RANK": rank, "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_rank_zero_logs_notes_and_others_only_warnings():
    zero, one = run("0"), run("1")
    assert zero.returncode == 0 and one.returncode == 0, zero.stderr + one.stderr
    lines = zero.stdout.splitlines()
    assert len(lines) == 2 and all("[rank 0]" in line for line in lines), zero.stdout
    assert "INFO mdlmpe_ds.runs.common: a note" in lines[0] and "WARNING" in lines[1]
    assert len(one.stdout.splitlines()) == 1, one.stdout
    assert "a note" not in one.stdout and "[rank 1] WARNING mdlmpe_ds.runs.common: a warning" in one.stdout
    # loggers outside the package keep Python's defaults (a warning to stderr, once, unformatted)
    assert "not ours" in zero.stderr and "not ours" not in zero.stdout


def test_the_dry_run_plan_is_logged(tmp_path, capsys):
    """The plan of a dry run (runs/common.build_engine) is an INFO record of rank 0 on stdout."""
    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.runs.common import build_engine, model_config_for
    from mdlmpe_ds.training.log_setup import configure

    configure(rank=0, force=True)  # whatever an earlier test's entry point set
    run_config = build_config(None, ["--max_len", "32", "--output_dir", str(tmp_path)])

    class Tok:  # the preset needs the table size, a mask and an eos id
        mask_token_id, eos_token_id, unk_token_id = 5, 1, 0

        def __len__(self):
            return 64

    model_config = model_config_for(run_config, Tok())
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
    }
    build_engine(run_config, model_config, ds, total=3, n_examples=10, dry_run=True)
    out = capsys.readouterr().out
    assert "[rank 0] INFO mdlmpe_ds.runs.common: dry run" in out and "sequences per update" in out


CONSOLIDATE = """
import sys
from pathlib import Path
import deepspeed.utils.zero_to_fp32 as z2f
from deepspeed.utils import logger
print("MARK", flush=True)  # DeepSpeed's logger writes to the stdout it found at import


def reader(path, tag):
    print("Processing zero checkpoint", path)
    logger.warning("chatter from the reader")
    return {"w": tag}


z2f.get_fp32_state_dict_from_zero_checkpoint = reader
from mdlmpe_ds.distributed import engine

state = engine.fp32_state_dict_from_checkpoint(Path("step_8"))
logger.warning("outside again")
print("ANSWER", state["w"], flush=True)
"""


def test_checkpoint_consolidation_keeps_stdout_for_the_answers():
    """generate.py / evaluate.py read a run's checkpoint through DeepSpeed's zero_to_fp32 reader,
    which print()s its progress and logs to the stdout of import time: while it reads, both go to
    stderr, so `generate.py ... > out.txt` holds the completions only (and the logger is restored)."""
    proc = subprocess.run(
        [sys.executable, "-c", CONSOLIDATE],
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = proc.stdout.split("MARK\n", 1)[1]
    assert "Processing zero checkpoint" not in after and "chatter" not in after, proc.stdout
    assert "Processing zero checkpoint step_8" in proc.stderr and "chatter from the reader" in proc.stderr
    assert after.splitlines()[-1] == "ANSWER ds" and "outside again" in after, after
