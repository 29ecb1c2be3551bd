"""Tables a test shows (the ``show_table`` fixture of tests/conftest.py) reach the terminal when the
unit tests run in pytest-xdist workers, as ``make test`` runs them: a worker's own prints never do,
so the Triton resource tables (registers, spills) would vanish from CI's log without it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

INNER = """
def test_one(show_table):
    show_table("first table", "row a1\\nrow a2")


def test_two(show_table):
    show_table("second table", "row b1")
"""


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    shutil.copy2(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    return subprocess.run(
        [*command, *args, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_tables_from_two_xdist_workers_reach_the_terminal(tmp_path):
    proc = _run(tmp_path, "-n", "2", "--dist", "load")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("first table", "row a1", "row a2", "second table", "row b1"):
        assert line in proc.stdout, proc.stdout


def test_tables_reach_the_terminal_without_xdist(tmp_path):
    proc = _run(tmp_path, "-p", "no:xdist")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "row a2" in proc.stdout and "row b1" in proc.stdout, proc.stdout
