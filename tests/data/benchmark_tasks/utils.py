"""Local stand-ins for the paper's lm-eval tasks (same task names, a handful of items each), so the
benchmark runs end to end offline: lm-eval loads these YAML files with ``--task_dir`` instead of its
own registry. The data sit next to this file (``*.jsonl``, a ``split`` field per row); nothing is
downloaded and no datasets cache is written.

The code tasks score a program by running it in a separate Python process: the execution guard
(``run_guarded``) isolates it (``python -I`` in a temporary directory), bounds its time and memory and
counts anything but a clean exit as a failure.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 5.0
MEMORY_BYTES = 512 * 2**20


def load_local(file: str, **_metadata):
    """``custom_dataset`` hook: the rows of ``file`` grouped into splits by their ``split`` field."""
    import datasets

    rows: dict[str, list[dict]] = {}
    for n, line in enumerate((HERE / file).read_text().splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            if "split" not in row:
                raise ValueError(f"{HERE / file}:{n}: row has no 'split' field")
            rows.setdefault(row.pop("split"), []).append(row)
    return datasets.DatasetDict({name: datasets.Dataset.from_list(r) for name, r in rows.items()})


def _limit_resources() -> None:  # runs in the child before exec (POSIX)
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (int(TIMEOUT_S) + 1, int(TIMEOUT_S) + 1))


def run_guarded(program: str, timeout_s: float = TIMEOUT_S) -> bool:
    """Whether ``program`` exits cleanly within the time and memory bounds (isolated interpreter)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", program],
                cwd=tmp,
                capture_output=True,
                timeout=timeout_s,
                preexec_fn=_limit_resources if sys.platform != "win32" else None,
                env={"PATH": "/usr/bin:/bin"},
            )
        except subprocess.TimeoutExpired:
            return False
    return proc.returncode == 0


def humaneval_program(resps, docs):
    """Filter (lm-eval's humaneval 'create_test' step): the prompt followed by the completion."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs)]


def humaneval_results(doc, results):
    program = results[0][0] if isinstance(results[0], list) else results[0]
    test = f"{program}\n\n{doc['test']}\ncheck({doc['entry_point']})\n"
    return {"pass@1": float(run_guarded(test))}


def mbpp_results(doc, results):
    completion = results[0]
    test = completion + "\n\n" + "\n".join(doc["test_list"]) + "\n"
    return {"pass_at_1": float(run_guarded(test))}


def mbpp_fewshot(**_):
    return [
        {
            "is_fewshot": True,
            "text": "Write a function to add two numbers.",
            "code": "def add(a, b):\n    return a + b",
            "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 4"],
        },
        {
            "is_fewshot": True,
            "text": "Write a function to negate a number.",
            "code": "def neg(a):\n    return -a",
            "test_list": ["assert neg(1) == -1", "assert neg(0) == 0", "assert neg(-2) == 2"],
        },
        {
            "is_fewshot": True,
            "text": "Write a function to double a number.",
            "code": "def dbl(a):\n    return 2 * a",
            "test_list": ["assert dbl(1) == 2", "assert dbl(0) == 0", "assert dbl(3) == 6"],
        },
        {
            "is_fewshot": True,
            "text": "Write a function to square a number.",
            "code": "def sq(a):\n    return a * a",
            "test_list": ["assert sq(1) == 1", "assert sq(0) == 0", "assert sq(3) == 9"],
        },
    ]
