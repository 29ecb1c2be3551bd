"""The benchmark suites as data: every task resolves in the installed lm-eval, every metric and
answer extractor exists in that task's definition, every value has a source; the plan prints for hub
names with no network; unmatched comparisons are refused."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from mdlmpe_ds.evaluation.benchmark import runner, suites
from mdlmpe_ds.evaluation.benchmark.cache import ModelRef, describe_model
from mdlmpe_ds.evaluation.benchmark.suites import SUITES, TABLE1, TABLE3

pytest.importorskip("lm_eval", reason="lm-eval is the optional 'eval' extra")
REPO = Path(__file__).resolve().parents[2]
LOCAL_TASKS = REPO / "tests" / "data" / "benchmark_tasks"
# Function metrics report their own keys (lm-eval's humaneval: pass_at_k -> "pass@1").
FUNCTION_METRICS = {"pass@1": "pass_at_k", "pass_at_1": "pass_at_1"}


@pytest.fixture(scope="module")
def registry():
    """lm-eval's own task index (local YAML files of the installed package; no network)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def _leaves(registry, name: str) -> list[dict]:
    """The (include-resolved, functions unresolved) configs of a task or of a group's member tasks."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = registry.task_index[name]
    if entry.yaml_path is None:  # a tag: its members are listed in the entry
        members = sorted(entry.tags)
    else:
        members = entry.cfg.get("task") if entry.cfg and "group" in entry.cfg else None
    if members is None:
        return [load_yaml(entry.yaml_path, resolve_func=False)]
    out = []
    for member in members:
        out += _leaves(registry, member if isinstance(member, str) else member["task"])
    return out


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_row_resolves_in_the_installed_lm_eval(registry, suite):
    for spec in SUITES[suite].tasks:
        name = spec.task.value
        assert name in registry.all_tasks, f"{suite}: {spec.label}: lm-eval has no task {name!r}"
        leaves = _leaves(registry, name)
        assert len(leaves) == spec.subtasks, (name, len(leaves))
        metric, filt = spec.metric.value.split(",")
        for cfg in leaves:
            filters = [f["name"] for f in cfg.get("filter_list", [])] or ["none"]
            assert filt in filters, f"{name}/{cfg['task']}: no filter {filt!r} (has {filters})"
            metrics = [str(m["metric"]) for m in cfg["metric_list"]]
            ok = metric in metrics or any(
                m.endswith("." + FUNCTION_METRICS.get(metric, "?")) for m in metrics
            )
            assert ok, f"{name}/{cfg['task']}: no metric {metric!r} (has {metrics})"
            kind = cfg["output_type"]
            assert kind == ("multiple_choice" if spec.kind == suites.LIKELIHOOD else "generate_until"), name
            assert bool(cfg.get("unsafe_code")) == (spec.kind == suites.CODE), name


def test_every_value_has_a_source_and_both_families_their_decoding():
    for suite in SUITES.values():
        for spec in suite.tasks:
            for value in (spec.task, spec.num_fewshot, spec.metric, spec.items):
                assert value.source.strip(), (spec.label, value)
            assert set(spec.decoding) == set(suites.FAMILIES), spec.label
            for family, decoding in spec.decoding.items():
                assert set(decoding) <= set(suites.DECODING_KEYS), (spec.label, family)
                assert all(v.source.strip() for v in decoding.values()), (spec.label, family)
                needed = (
                    {"mc_num"} if spec.kind == suites.LIKELIHOOD else {"gen_length", "steps", "algorithm"}
                )
                assert needed <= set(decoding), (spec.label, family)


def test_table1_is_the_papers_rows_and_table3_its_block_sizes():
    assert [s.row_label() for s in TABLE1.tasks] == [
        "MMLU (5)", "MMLU-Pro (0)", "HellaSwag (0)", "ARC-C (0)",
        "GSM8K (4)", "MATH (4)", "HumanEval (0)", "MBPP (4)",
    ]  # fmt: skip
    assert [s.group for s in TABLE1.tasks] == ["general"] * 4 + ["math and reasoning"] * 2 + ["code"] * 2
    assert [(s.variant, s.label) for s in TABLE3.tasks][:3] == [
        ("B=16", "MMLU"),
        ("B=16", "ARC-C"),
        ("B=16", "HellaSwag"),
    ]
    assert sorted({s.decoding["llada"]["likelihood_block"].value for s in TABLE3.tasks}) == [16, 32, 64]
    assert len({s.key for s in TABLE3.tasks}) == len(TABLE3.tasks)  # distinct cache keys per block size


def test_local_task_copies_cover_every_suite_task():
    """tests/data/benchmark_tasks defines each task of the suites under lm-eval's own name."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    local = {yaml.load(p.read_text(), Loader=Loader)["task"] for p in LOCAL_TASKS.glob("*.yaml")}
    assert {s.task.value for suite in SUITES.values() for s in suite.tasks} <= local


def test_select_and_overrides_check_their_input():
    assert [s.label for s in suites.select(TABLE1, ["code", "gsm8k"]).tasks] == ["GSM8K", "HumanEval", "MBPP"]
    assert {s.variant for s in suites.select(TABLE3, ["b=32"]).tasks} == {"B=32"}
    with pytest.raises(ValueError, match="match no row"):
        suites.select(TABLE1, ["winogrande"])
    assert suites.parse_overrides(["steps=8", "temperature=0.5", "suppress_eos=true"], TABLE1) == {
        "steps": 8, "temperature": 0.5, "suppress_eos": True,
    }  # fmt: skip
    with pytest.raises(ValueError, match="KEY=VALUE"):
        suites.parse_overrides(["stepz=8"], TABLE1)
    with pytest.raises(ValueError, match="no row"):
        suites.parse_overrides(["likelihood_block=4"], TABLE1)


def test_dry_run_prints_the_full_plan_for_hub_names_without_network(tmp_path, monkeypatch, capsys):
    """Real checkpoint names, nothing on disk, every socket refused: the suite and plan still print."""
    import importlib.util

    def refuse(*args, **kwargs):
        raise OSError("network access attempted during --dry-run")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache
    spec = importlib.util.spec_from_file_location("benchmark_cli", REPO / "launch" / "benchmark.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    rc = cli.main(
        ["--suite", "paper-table1", "GSAI-ML/LLaDA-8B-Instruct", "GSAI-ML/LLaDA-8B-Base", "--dry-run",
         "--out", str(tmp_path / "t1")]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "eval_llada_lm_eval.sh:24" in out and "EVAL.md:74-75" in out  # values with their sources
    for spec_ in TABLE1.tasks:
        assert spec_.row_label() in out
    # MMLU: 14042 items x 4 options x mc_num 1; GSM8K: 1319 x 512 steps
    assert "~56,168 forwards" in out and f"~{1319 * 512:,} forwards" in out
    assert out.count("8 of 8 tasks to run") == 2
    assert "\nGSAI-ML/LLaDA-8B-Instruct: GSAI-ML/LLaDA-8B-Instruct [llada, hub id" in out  # default names
    rc = cli.main(["--suite", "paper-table3", "Dream-org/Dream-v0-Instruct-7B", "x/Dream-mdlmpe", "--dry-run",
                   "--out", str(tmp_path / "t3"), "--limit", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "[dream, hub id" in out and "9 of 9 tasks to run" in out
    # MMLU at --limit 2: 2 docs x 57 subtasks x 4 options x mc_num 1
    assert f"~{2 * 57 * 4:,} forwards" in out


def test_models_of_different_families_are_refused(tmp_path, capsys):
    llada = describe_model("GSAI-ML/LLaDA-8B-Instruct")
    dream = describe_model("Dream-org/Dream-v0-Instruct-7B")
    assert (llada.family, dream.family) == ("llada", "dream")
    jobs = runner.plan(TABLE1, [llada, dream], runner.RunOptions(), cache=None)
    with pytest.raises(ValueError, match=r"different settings.*gen_length"):
        runner.check_matched(TABLE1, jobs)
    with pytest.raises(ValueError, match="family"):
        describe_model("someone/model-7b")


def test_items_that_differ_between_models_are_refused():
    one = {"subtask": "t", "doc_id": 0, "doc_hash": "a", "prompt_hash": "p"}
    runner.check_same_items(TABLE1.tasks[0], {"A": [one], "B": [dict(one)]})
    with pytest.raises(ValueError, match="different items or prompts"):
        runner.check_same_items(TABLE1.tasks[0], {"A": [one], "B": [{**one, "prompt_hash": "q"}]})


def test_cache_entries_are_keyed_by_model_task_and_settings(tmp_path):
    from mdlmpe_ds.evaluation.benchmark.cache import ResultCache

    cache = ResultCache(tmp_path)
    model = ModelRef("a", "a", "llada", "{}", local=True)
    settings = {"task": "gsm8k", "decoding": {"steps": 8}}
    assert cache.load(model, "gsm8k-4shot", settings) is None
    cache.store(model, "gsm8k-4shot", settings, [{"score": 1.0}])
    assert cache.load(model, "gsm8k-4shot", settings)["items"] == [{"score": 1.0}]
    assert cache.load(model, "gsm8k-4shot", {**settings, "decoding": {"steps": 16}}) is None
    assert cache.load(ModelRef("a", "a", "llada", '{"other": 1}', True), "gsm8k-4shot", settings) is None


def test_default_names_tell_two_exports_apart(tmp_path):
    from mdlmpe_ds.evaluation.benchmark.session import default_names

    for run in ("rope", "mdlmpe"):
        (tmp_path / run / "export").mkdir(parents=True)
    assert default_names([str(tmp_path / "rope"), "GSAI-ML/LLaDA-8B-Base"]) == [
        "rope",
        "GSAI-ML/LLaDA-8B-Base",
    ]
    paths = [str(tmp_path / "rope" / "export"), str(tmp_path / "mdlmpe" / "export")]
    assert default_names(paths) == ["rope/export", "mdlmpe/export"]


def test_every_rows_decoding_is_accepted_by_the_adapter_and_the_sampler():
    """Each row's settings are keyword arguments of the lm-eval adapter, for both families, and the
    generation rows give a valid sampler configuration (names and values, not only their sources)."""
    import torch

    from mdlmpe_ds.evaluation.lm_eval_adapter import MDLMPEEvalLM
    from mdlmpe_ds.models import DiffusionLM, preset

    class Tok:
        bos_token_id = None

    torch.manual_seed(0)
    model = DiffusionLM(preset("llada-tiny")).eval()
    for suite in SUITES.values():
        for spec in suite.tasks:
            for family in suites.FAMILIES:
                lm = MDLMPEEvalLM(model, tokenizer=Tok(), device="cpu", **suites.decoding_for(spec, family))
                if spec.kind != suites.LIKELIHOOD:
                    config = lm._sampler_config({"max_gen_toks": 7})
                    assert config.gen_length == suites.decoding_for(spec, family)["gen_length"]
                else:
                    assert lm.mc_num == suites.decoding_for(spec, family)["mc_num"]


def test_hub_ids_are_identified_by_their_snapshot_for_a_real_run(tmp_path, monkeypatch):
    """A real run resolves a hub id to its snapshot first (as load_model would), so a new revision
    is a new model for the cache; the id stays the column name. A dry run resolves nothing."""
    import json

    from mdlmpe_ds.evaluation.benchmark import cache
    from mdlmpe_ds.hub import resolve as hub_resolve

    snapshots = {}
    for rev in ("aaa", "bbb"):
        snap = tmp_path / "snapshots" / rev
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps({"model_type": "llada"}))
        (snap / "model.safetensors").write_bytes(b"x" * (3 if rev == "aaa" else 4))
        snapshots[rev] = snap
    current = {"rev": "aaa"}
    fake_resolve = lambda name, **k: snapshots[current["rev"]]  # noqa: E731
    monkeypatch.setattr(hub_resolve, "resolve", fake_resolve)
    monkeypatch.setattr(cache, "resolve", fake_resolve)  # the name as the cache imported it
    first = cache.resolve_hub("GSAI-ML/LLaDA-8B-Instruct")
    assert first.name == "GSAI-ML/LLaDA-8B-Instruct" and first.family == "llada" and first.local
    assert str(snapshots["aaa"]) in first.identity
    current["rev"] = "bbb"
    assert cache.resolve_hub("GSAI-ML/LLaDA-8B-Instruct").cache_dir_name != first.cache_dir_name
    assert not describe_model("GSAI-ML/LLaDA-8B-Instruct").local  # the dry run's description
