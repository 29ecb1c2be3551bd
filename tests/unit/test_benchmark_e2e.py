"""launch/benchmark.py --suite paper-table1 RUN_A RUN_B --limit 4 end to end on the CPU (with a
smaller decoding budget): two tiny exports (RoPE, and a perturbed copy with
MDLMPE) through local copies of the paper's tasks that lm-eval loads from tests/data/benchmark_tasks
(multiple choice, generation with an answer extractor, code with its execution guard): the pairing,
the intervals, the per-item JSON, and a rerun served from the cache."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mdlmpe_ds.evaluation.benchmark import session, stats

pytest.importorskip("lm_eval", reason="lm-eval is the optional 'eval' extra")
REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "data" / "benchmark_tasks"
sys.path.insert(0, str(TASKS))
import utils as task_utils  # noqa: E402  (the local tasks' helpers: the execution guard)


def _cli():
    spec = importlib.util.spec_from_file_location("benchmark_cli", REPO / "launch" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).parent))
    from benchmark_fixtures import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


def _args(pair, out: Path, *extra: str, steps: int = 1) -> list[str]:
    rope, mdlmpe = pair
    return [
        "--suite", "paper-table1", str(rope), str(mdlmpe), "--names", "rope", "mdlmpe",
        "--limit", "4", "--task_dir", str(TASKS),
        "--set", "gen_length=4", "block_length=4", f"steps={steps}", "mc_num=2",
        "--out", str(out / "table1"), "--no_progress", *extra,
    ]  # fmt: skip


def test_paired_table_from_two_tiny_checkpoints_and_a_cached_rerun(pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cli = _cli()
    assert cli.main(_args(pair, tmp_path, "--allow_code_execution")) == 0
    printed = capsys.readouterr().out
    assert "eval_llada_lm_eval.sh:24" in printed  # the suite was printed with its sources
    report = json.loads((tmp_path / "table1.json").read_text())
    rows = {r["key"]: r for r in report["rows"]}
    assert list(rows) == [
        "mmlu-5shot", "mmlu_pro-0shot", "hellaswag-0shot", "arc_challenge-0shot",
        "gsm8k-4shot", "minerva_math-4shot", "humaneval-0shot", "mbpp-4shot",
    ]  # fmt: skip
    for row in rows.values():
        assert row["n"] == 4 and len(row["items"]) == 4
        decoding = row["settings"]["decoding"]
        assert decoding.get("mc_num", 2) == 2 and decoding.get("steps", 1) == 1  # --set recorded
        keys = [(i["subtask"], i["doc_id"]) for i in row["items"]]
        assert len(set(keys)) == 4 and all(set(i["models"]) == {"rope", "mdlmpe"} for i in row["items"])
        a = [i["models"]["rope"]["score"] for i in row["items"]]
        b = [i["models"]["mdlmpe"]["score"] for i in row["items"]]
        assert set(a + b) <= {0.0, 1.0}
        assert row["scores"] == {"rope": sum(a) / 4, "mdlmpe": sum(b) / 4}
        p = row["paired"][0]
        again = stats.paired(a, b, report["statistics"]["resamples"], seed=report["statistics"]["seed"])
        assert {k: p[k] for k in again.to_dict()} == again.to_dict()  # re-analysable from the JSON alone
        assert -1 <= p["ci_low"] <= p["diff"] <= p["ci_high"] <= 1
        assert p["only_a"] == sum(x > y for x, y in zip(a, b)) and p["only_b"] == sum(
            y > x for x, y in zip(a, b)
        )
    # the answer extractor and the execution guard ran: extracted answers, programs built from prompts
    gsm = rows["gsm8k-4shot"]["items"][0]["models"]["rope"]["response"]
    assert gsm == ["[invalid]"] or gsm[0].replace(".", "").replace(",", "").lstrip("-$").isdigit()
    program = rows["humaneval-0shot"]["items"][0]["models"]["rope"]["response"][0][0]
    assert program.startswith("def add(a, b):")
    mmlu = rows["mmlu-5shot"]["items"][0]["models"]["rope"]["response"]
    assert len(mmlu) == 4  # one (log-likelihood, greedy) per option
    table = (tmp_path / "table1.md").read_text()
    assert "| MMLU (5) |" in table and "only rope / only mdlmpe" in table and "*code*" in table
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("*.json"))
    assert len(cached) == 16  # (2 models) x (8 tasks)

    # Rerun: every result comes from the cache; no model is loaded, nothing is scored.
    def fail(*a, **k):
        raise AssertionError("a cached result was recomputed")

    monkeypatch.setattr(session, "_load", fail)
    monkeypatch.setattr(session, "evaluate_job", fail)
    assert cli.main(_args(pair, tmp_path, "--allow_code_execution")) == 0
    rerun = json.loads((tmp_path / "table1.json").read_text())
    assert rerun["rows"] == report["rows"]
    assert capsys.readouterr().out.count("0 of 8 tasks to run") == 2
    # A changed setting is a different result: only the rows it touches would run again.
    assert cli.main(_args(pair, tmp_path, "--allow_code_execution", "--dry-run", steps=2)) == 0
    assert capsys.readouterr().out.count("5 of 8 tasks to run") == 2  # the generation rows


def test_chat_template_prompts_are_a_setting_of_their_own(pair, tmp_path, monkeypatch):
    """--chat_template renders the prompts through the family's template (other prompts, so other
    prompt hashes) and is part of the settings: a separate cache entry, never mixed with plain ones."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cli, runs = _cli(), {}
    for extra in ([], ["--chat_template"]):
        assert cli.main(_args(pair, tmp_path, "--only", "hellaswag", *extra)) == 0
        runs[bool(extra)] = json.loads((tmp_path / "table1.json").read_text())["rows"][0]
    assert runs[True]["settings"]["chat_template"] and not runs[False]["settings"]["chat_template"]
    plain = [i["prompt_hash"] for i in runs[False]["items"]]
    chat = [i["prompt_hash"] for i in runs[True]["items"]]
    assert [i["doc_hash"] for i in runs[False]["items"]] == [i["doc_hash"] for i in runs[True]["items"]]
    assert not set(plain) & set(chat)
    assert len(list((tmp_path / "cache").rglob("hellaswag-*.json"))) == 4  # 2 models x 2 settings


def test_code_tasks_need_the_explicit_flag(pair, tmp_path, capsys):
    assert _cli().main(_args(pair, tmp_path)) == 2
    assert "--allow_code_execution" in capsys.readouterr().err


def test_execution_guard_passes_correct_programs_only():
    doc = {
        "prompt": "def add(a, b):\n",
        "test": "def check(f):\n    assert f(1, 2) == 3\n",
        "entry_point": "add",
    }
    assert task_utils.humaneval_results(doc, [["def add(a, b):\n    return a + b\n"]]) == {"pass@1": 1.0}
    assert task_utils.humaneval_results(doc, [["def add(a, b):\n    return a - b\n"]]) == {"pass@1": 0.0}
    assert task_utils.humaneval_results(doc, [["def add(a, b):\n    return (\n"]]) == {
        "pass@1": 0.0
    }  # syntax
    assert not task_utils.run_guarded("while True:\n    pass\n", timeout_s=1.0)  # killed at the bound
    assert not task_utils.run_guarded("x = bytearray(2 * 1024**3)\n")  # over the memory bound
    mbpp = {"test_list": ["assert tri(1) == 3", "assert tri(2) == 6"]}
    assert task_utils.mbpp_results(mbpp, ["def tri(a):\n    return 3 * a"]) == {"pass_at_1": 1.0}
    assert task_utils.mbpp_results(mbpp, ["def tri(a):\n    return a"]) == {"pass_at_1": 0.0}


@pytest.mark.dist
def test_data_parallel_under_torchrun_scores_the_same_items(pair, tmp_path, monkeypatch):
    """Two gloo processes (lm-eval shards the documents by rank; rank 0 gathers, caches and reports)
    give the single process's per-item results: requests are seeded by their text, not their rank."""
    import os
    import socket
    import subprocess

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = ["--only", "mmlu", "gsm8k", "humaneval", "--device", "cpu", "--allow_code_execution"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, str(REPO / "launch" / "benchmark.py"), *_args(pair, tmp_path / "dp", *rows)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _cli().main(_args(pair, tmp_path / "sp", *rows)) == 0
    dp = json.loads((tmp_path / "dp" / "table1.json").read_text())
    sp = json.loads((tmp_path / "sp" / "table1.json").read_text())
    assert [r["n"] for r in dp["rows"]] == [4, 4, 4]
    assert dp["rows"] == sp["rows"]
