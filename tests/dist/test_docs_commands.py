"""Every command the README and docs/*.md show in a fenced block works as written.

Each fenced ``bash`` command is parsed into (environment, launcher, target, arguments) and handled
by the rule of the script or module it runs (``HANDLERS``), never by a list of exact lines, so a
command added to any page is checked the same way. A command whose target has no rule, a fence
language that is not known, or a placeholder that is not known fails the test.

- Training launchers (launch/sft.py, launch/pretrain.py, launch/compare_pe.py) run as a dry run
  in-process against a hub cache that holds only the models' config.json files: every flag must
  exist (the config parser refuses unknown keys) and the plan must build without weights, tokenizer
  or data. The two demo commands also train for real (2 ranks, CPU, few updates) in the module's
  fixture, whose run and export the commands below read.
- Tools on a trained model (export, generate, evaluate, analyze, convert_checkpoint,
  lm_eval_harness): run for real on
  the fixture's tiny run and export when the paths they name exist there (``outputs/llada-sft`` is
  the demo run; ``SMALL`` appends CPU sizes); with a hub id or another machine's path, their
  argument parser must accept them.
- Long studies, benchmarks (launch/benchmark.py: tests/unit/test_benchmark_e2e.py runs the same
  suite on the same tiny pair) and the GPU runbook: their parser must accept the arguments (their
  own tests run them). Small scripts that build their own inputs (the benchmark's tiny pair) run.
- ``make`` targets must exist; ``pip install -e '.[x]'`` extras must be declared.
- ``python`` blocks run in a process that cannot import mdlmpe_ds (the transformers snippet).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
NOT_COMMANDS = {"text", "json", "yaml", "toml", "jinja", "diff"}
# Paths a command may name that belong to another machine's runs: only parsed, never run.
ELSEWHERE = re.compile(r"^(/|outputs/(llada|dream)-(lora|100m)|outputs/dream-)")
# Placeholders the docs use, and what they stand for in the fixture's workspace.
PLACEHOLDERS = {
    "CHECKPOINT_DIR": "outputs/sft-demo/checkpoints/step_000002",
    "RUN": "outputs/pretrain-demo",
    "RUN_A": "outputs/pretrain-demo",
    "RUN_B": "outputs/pretrain-demo",
}
HUB_MODELS = {  # config-only hub cache entries for the dry runs: id -> preset
    "GSAI-ML/LLaDA-8B-Instruct": "llada-8b",
    "GSAI-ML/LLaDA-8B-Base": "llada-8b",
    "Dream-org/Dream-v0-Base-7B": "dream-7b",
    "Dream-org/Dream-v0-Instruct-7B": "dream-7b",
}
DEMO_SFT = "deepspeed launch/sft.py --deepspeed ds_configs/zero3.json"
DEMO_PRETRAIN = "deepspeed launch/pretrain.py --deepspeed ds_configs/zero3.json"


# ------------------------------------------------------------------------------- reading the docs
@dataclass
class Command:
    where: str  # doc:line
    text: str  # as written, continuation lines joined, comments dropped
    env: dict[str, str] = field(default_factory=dict)
    launcher: list[str] = field(default_factory=list)  # deepspeed / torchrun / python and their flags
    target: str = ""  # launch/x.py, benchmarks/x.py, -m module, make, pip, tensorboard, hf
    args: list[str] = field(default_factory=list)


def fenced_blocks(doc: Path) -> list[tuple[str, int, str]]:
    """(language, first line number, body) of every fenced block."""
    out, lines, i = [], doc.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m:
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            out.append((m.group(1), i + 2, "\n".join(lines[i + 1 : j])))
            i = j
        i += 1
    return out


def shell_commands(doc: Path, start: int, body: str) -> list[tuple[str, str]]:
    """(doc:line, command) for each command of a shell block (``\\`` continuations joined)."""
    out, pending, first = [], "", None
    for offset, line in enumerate(body.splitlines()):
        if first is None:
            first = start + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = " ".join(shlex.split(pending + line, comments=True))
        if text:
            out.append((f"{doc.name}:{first}", pending + line))
        pending, first = "", None
    return out


def parse(where: str, raw: str) -> Command:
    words = shlex.split(raw, comments=True)
    cmd = Command(where, " ".join(words))
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, value = words.pop(0).split("=", 1)
        cmd.env[key] = value
    if not words:
        raise AssertionError(f"{where}: empty command {raw!r}")
    head = words.pop(0)
    if head in ("make", "pip", "tensorboard", "hf"):
        cmd.target, cmd.args = head, words
        return cmd
    if head in ("deepspeed", "torchrun", "python"):
        cmd.launcher.append(head)
        while words and words[0].startswith("-") and words[0] != "-m":
            flag = words.pop(0)
            cmd.launcher.append(flag)
            if "=" not in flag and flag not in ("--standalone",):
                cmd.launcher.append(words.pop(0))
        if words and words[0] == "-m":
            cmd.target, cmd.args = f"-m {words[1]}", words[2:]
            return cmd
        if words and words[0].endswith(".py"):
            cmd.target, cmd.args = words[0], words[1:]
            return cmd
    raise AssertionError(f"{where}: unknown command form {raw!r}: add a rule to HANDLERS")


def documented() -> tuple[list[Command], list[tuple[str, str]]]:
    """Every shell command and every python block of the README and docs/."""
    commands, snippets = [], []
    for doc in DOCS:
        for lang, line, body in fenced_blocks(doc):
            if lang in SHELL:
                commands += [parse(where, raw) for where, raw in shell_commands(doc, line, body)]
            elif lang == "python":
                snippets.append((f"{doc.name}:{line}", body))
            elif lang not in NOT_COMMANDS:
                raise AssertionError(f"{doc.name}:{line}: fence language {lang!r} is neither shell nor data")
    return commands, snippets


def handler(cmd: Command) -> str:
    """The rule for ``cmd``'s target (see the module docstring)."""
    for pattern, kind in HANDLERS:
        if re.fullmatch(pattern, cmd.target):
            return kind
    raise AssertionError(f"{cmd.where}: no rule for {cmd.target!r} ({cmd.text}): add one to HANDLERS")


HANDLERS = [
    (r"launch/(sft|pretrain|compare_pe|mechanism_study)\.py", "plan"),
    (r"launch/(export|generate|evaluate|analyze|convert_checkpoint)\.py", "tool"),
    (r"launch/lm_eval_harness\.py", "lm_eval"),
    (
        r"launch/(runlength_study|gpu_check|benchmark|prepare_data)\.py|benchmarks/\w+\.py",
        "parse",
    ),
    (r"tests/unit/benchmark_fixtures\.py", "run"),
    (r"make", "make"),
    (r"pip", "pip"),
]


def substituted(cmd: Command) -> list[str]:
    out = []
    for arg in cmd.args:
        if re.fullmatch(r"[A-Z][A-Z0-9_]+", arg):
            assert arg in PLACEHOLDERS, f"{cmd.where}: unknown placeholder {arg} (add it to PLACEHOLDERS)"
            arg = PLACEHOLDERS[arg]
        out.append(arg)
    return out


def inputs(cmd: Command) -> list[str]:
    """The models and runs a tool reads: positional paths, --checkpoint/--model values, pretrained=."""
    args, out = substituted(cmd), []
    for i, arg in enumerate(args):
        prev = args[i - 1] if i else ""
        if prev in ("--checkpoint", "--model") or (i == 0 and not arg.startswith("-") and "/" in arg):
            out.append(arg)
        out += re.findall(r"pretrained=([^,]+)", arg)
    if cmd.target == "launch/convert_checkpoint.py":  # to-universal STEP_DIR
        out = args[1:2]
    return out


# ------------------------------------------------------------------------------------ unit checks
def test_every_documented_command_has_a_rule():
    commands, snippets = documented()
    assert len(commands) >= 20 and snippets, (len(commands), len(snippets))
    kinds = {c.where: handler(c) for c in commands}
    texts = {c.text for c in commands}
    # the demos the fixture trains are the documented ones
    assert DEMO_PRETRAIN in texts
    assert any(c.target == "make" and c.args == ["demo"] for c in commands)
    makefile = (REPO / "Makefile").read_text()
    assert f"{DEMO_SFT} $(DEMO_ARGS)" in makefile and f"{DEMO_PRETRAIN} $(DEMO_ARGS)" in makefile
    assert set(kinds.values()) >= {"plan", "tool", "lm_eval", "make"}


def test_unknown_forms_fail():
    with pytest.raises(AssertionError, match="unknown command form"):
        parse("x.md:1", "curl https://example.com | sh")
    with pytest.raises(AssertionError, match="no rule"):
        handler(parse("x.md:1", "python launch/new_tool.py --flag"))
    with pytest.raises(AssertionError, match="unknown placeholder"):
        substituted(parse("x.md:1", "python launch/export.py SOME_DIR out"))


def test_readme_layout_names_every_module():
    readme = (REPO / "README.md").read_text()
    tree = readme[readme.index("```text\nmdlmpe_ds/") :]
    tree = tree[: tree.index("\n```")]
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", tree))
    skip = {"__init__", "__main__"}
    missing = sorted(
        str(p.relative_to(REPO))
        for folder in ("mdlmpe_ds", "launch", "benchmarks")
        for p in (REPO / folder).rglob("*.py")
        if p.stem not in skip and p.stem not in words
    )
    assert not missing, f"modules missing from the README's layout: {missing}"


def test_make_and_pip_commands_name_what_exists():
    import tomllib

    commands, _ = documented()
    makefile = (REPO / "Makefile").read_text()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for cmd in commands:
        if cmd.target == "make":
            for target in cmd.args:
                assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"{cmd.where}: no make {target}"
        elif cmd.target == "pip":
            for extra in re.findall(r"\.\[(\w+)\]", cmd.text):
                assert extra in extras, f"{cmd.where}: no extra [{extra}] in pyproject.toml"


class _Parsed(Exception):
    pass


def _parse_only(cmd: Command, args: list[str], monkeypatch) -> None:
    """Run the command's entry point until its argument parser has accepted ``args``."""
    original, original_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    inside = []

    def parse_args(self, argv=None, namespace=None):
        inside.append(self)
        original(self, argv, namespace)  # exits (SystemExit 2) on an unknown or bad argument
        raise _Parsed

    def parse_known_args(self, argv=None, namespace=None):
        result = original_known(self, argv, namespace)
        if inside:  # within parse_args (or a subcommand's parser): let parse_args finish its checks
            return result
        raise _Parsed  # a script that forwards unknown flags: the parser accepted its own

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    monkeypatch.setattr(sys, "argv", [cmd.target.split()[-1], *args])
    monkeypatch.chdir(REPO)
    with pytest.raises(_Parsed):
        if cmd.target.startswith("-m "):
            runpy.run_module(cmd.target[3:], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(REPO / cmd.target), run_name="__main__")


def _needs_elsewhere(cmd: Command) -> bool:
    """A tool whose model or run is a hub id or another machine's path: parsed, not run. A path
    under outputs/ (other than ELSEWHERE's) is the workspace's, and must exist there."""
    from mdlmpe_ds.hub.resolve import looks_like_hub_id

    def elsewhere(path: str) -> bool:
        if ELSEWHERE.match(path):
            return True
        return not path.startswith("outputs/") and looks_like_hub_id(path)

    return any(elsewhere(p) for p in inputs(cmd))


def test_commands_for_other_machines_parse(monkeypatch):
    commands, _ = documented()
    checked = 0
    for cmd in commands:
        kind = handler(cmd)
        if kind == "parse" or (kind == "tool" and _needs_elsewhere(cmd)):
            with monkeypatch.context() as patch:
                _parse_only(cmd, substituted(cmd), patch)
            checked += 1
    assert checked >= 5


@pytest.fixture
def config_only_hub(tmp_path, monkeypatch):
    """An offline hub cache holding nothing but config.json for each model the docs name."""
    from huggingface_hub import constants

    from mdlmpe_ds.models import preset
    from mdlmpe_ds.models.hf_config import hf_config_dict

    cache = tmp_path / "hf_cache"
    for repo_id, name in HUB_MODELS.items():
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(hf_config_dict(preset(name))))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _launch_main(script: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"docs_{Path(script).stem}", REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_training_commands_dry_run_from_configs_alone(config_only_hub, tmp_path, monkeypatch, capsys):
    """Every training command, as a dry run on this CPU machine: every flag known, the plan built
    from config.json alone (the cache holds nothing else), the output folders untouched."""
    commands, _ = documented()
    planned = 0
    for cmd in commands:
        if handler(cmd) != "plan":
            continue
        args = substituted(cmd)
        if "--dry-run" not in args and "--dry_run" not in args:
            args.append("--dry-run")
        with monkeypatch.context() as patch:
            for key, value in cmd.env.items():
                patch.setenv(key, value)
            patch.chdir(tmp_path)
            (tmp_path / "ds_configs").exists() or (tmp_path / "ds_configs").symlink_to(REPO / "ds_configs")
            code = _launch_main(cmd.target)(args)
        out = capsys.readouterr()
        assert code == 0, f"{cmd.where}: {cmd.text}\n{out.out[-2000:]}\n{out.err[-2000:]}"
        planned += 1
    assert planned >= 6
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("checkpoints"))


# ------------------------------------------------------------------------ running the CPU commands
def _env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "MDLMPE_DS_CPU_RANKS": "2",
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        }
    )
    return env


#: Lines of library chatter (DeepSpeed's zero_to_fp32 reader and logger) that must not reach the
#: stdout of a tool whose stdout is its answer.
CHATTER = ("Processing zero checkpoint", "Reconstructed", "[WARNING]", "[INFO]", "Setting accelerator")


def _writes_answers(words: list[str]) -> bool:
    """generate.py and evaluate.py keep stdout for completions and tables (logs go to stderr)."""
    return any(w.endswith(("launch/generate.py", "launch/evaluate.py")) for w in words)


def _run(words: list[str], cwd: Path, what: str, timeout: int = 600, env=None, clean_stdout=False) -> str:
    """Run ``words`` with no terminal input (a command that asks a question fails the check below);
    ``clean_stdout``: no library chatter on stdout (``CHATTER``)."""
    proc = subprocess.run(
        words, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout, input=""
    )
    assert proc.returncode == 0, (
        f"{what}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    if clean_stdout:
        noise = [line for line in proc.stdout.splitlines() if any(c in line for c in CHATTER)]
        assert not noise, f"{what}: library chatter on stdout (keep it for the answers):\n" + "\n".join(noise[:5])
    return proc.stdout + proc.stderr


def _deepspeed() -> str:
    return str(Path(sys.executable).parent / "deepspeed")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A user's working folder: the demo SFT run (stopped at update 2 of 4 through a --config file,
    then resumed with the same --stop_at, which trains nothing), the demo pretraining run, and
    outputs/llada-sft standing for the GPU run the README exports."""
    root = tmp_path_factory.mktemp("user")
    for name in ("launch", "ds_configs", "benchmarks"):
        (root / name).symlink_to(REPO / name)
    (root / "run.yaml").write_text("train:\n  log_every: 1\n")
    sft = [*shlex.split(DEMO_SFT), "--config", "run.yaml", "--max_steps", "4", "--stop_at", "2"]
    sft[0] = _deepspeed()
    first = _run(sft, root, "the demo SFT, first half")
    again = _run([*sft, "--resume", "auto"], root, "the demo SFT resumed at its stop_at")
    pretrain = [*shlex.split(DEMO_PRETRAIN), "--max_steps", "2", "--eval_every", "2"]
    pretrain[0] = _deepspeed()
    _run(pretrain, root, "the demo pretraining")
    (root / "outputs" / "llada-sft").symlink_to(root / "outputs" / "sft-demo")
    return {"root": root, "first": first, "again": again}


@pytest.mark.dist
def test_stop_at_summary_and_resume_command(workspace):
    first, again = workspace["first"], workspace["again"]
    assert "stopped at update 2 of 4 (--stop_at 2)" in first
    resume = next(line for line in first.splitlines() if line.startswith("resume with:"))
    assert "--config run.yaml" in resume and "--stop_at" not in resume and "--resume auto" in resume
    assert "nothing trained: the run is at update 2 of 4 and --stop_at is 2" in again
    rows = (workspace["root"] / "outputs" / "sft-demo" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2]


def _lm_eval_tasks(root: Path) -> Path:
    """One local multiple-choice and one generation task (lm-eval's YAML format)."""
    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    rows = [{"question": "what is the color of the sky ?", "choices": ["blue", "green"], "answer": 0}] * 2
    (tasks / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "gen.jsonl").write_text(json.dumps({"question": "hello", "answer": "hi"}) + "\n")
    common = "dataset_path: json\ntest_split: train\n"
    (tasks / "docs_mc.yaml").write_text(
        f"task: docs_mc\n{common}dataset_kwargs:\n  data_files:\n    train: {tasks / 'mc.jsonl'}\n"
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    )
    (tasks / "docs_gen.yaml").write_text(
        f"task: docs_gen\n{common}dataset_kwargs:\n  data_files:\n    train: {tasks / 'gen.jsonl'}\n"
        'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 4\nmetric_list:\n  - metric: exact_match\n'
    )
    return tasks


def _lm_eval_on_cpu(cmd: Command, root: Path) -> list[str]:
    """The documented lm-eval command with CPU sizes: lm-eval's --device cpu, local tasks, one
    process, small Monte-Carlo and generation lengths; every model_args key kept."""
    args = substituted(cmd)
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--device":
            out += ["--device", "cpu"]
            i += 2
            continue
        if arg == "--tasks":
            out += ["--tasks", "docs_mc,docs_gen", "--include_path", str(_lm_eval_tasks(root))]
            i += 2
            continue
        if arg == "--model_args":
            small = {"dtype": "fp32", "mc_num": "4", "gen_length": "4", "block_length": "4", "steps": "4"}
            pairs = [p.split("=", 1) for p in args[i + 1].split(",")]
            out += ["--model_args", ",".join(f"{k}={small.get(k, v)}" for k, v in pairs)]
            i += 2
            continue
        out.append(arg)
        i += 1
    assert "--device" in out, f"{cmd.where}: lm-eval needs its own --device flag (cpu or cuda)"
    return [sys.executable, str(REPO / cmd.target), *out]


# CPU sizes appended to a tool's documented arguments when it runs here (the last value wins).
SMALL = {"launch/evaluate.py": ["--max_sequences", "4", "--num_samples", "4"]}

_NO_MDLMPE_DS = 'import sys\nsys.modules["mdlmpe_ds"] = None  # the project cannot be imported here\n'


def _run_key(root: Path, path: str) -> str:
    """The workspace run (or other top folder) a tool's input belongs to: ``outputs/llada-sft/export``
    -> the SFT demo's folder (outputs/llada-sft is a link to it)."""
    parts = Path(path).parts
    top = Path(*parts[:2]) if parts and parts[0] == "outputs" and len(parts) > 1 else Path(*parts[:1])
    return str((root / top).resolve())


def _lanes(jobs: list[tuple[str, list[str], list[str]]], root: Path) -> list[list[tuple[str, list[str]]]]:
    """``jobs`` (where, words, inputs) in the docs' order, grouped so that every command reading the
    same run (or writing the folder another one reads) stays in one lane, in order; commands with
    no input in the workspace each form a lane of their own. Lanes share nothing, so two can run at
    once (each command is one single-threaded process: the 2 cores are both used)."""
    groups: list[tuple[set[str], list[tuple[str, list[str]]]]] = []
    for where, words, paths in jobs:
        keys = {_run_key(root, p) for p in paths} or {f"alone:{where}"}
        touching = [g for g in groups if g[0] & keys]
        merged_keys, merged_jobs = set(keys), []
        for g in touching:  # a command reading two runs joins their lanes (order kept by position)
            merged_keys |= g[0]
            merged_jobs += g[1]
            groups.remove(g)
        order = {w: i for i, (w, _, _) in enumerate(jobs)}
        merged_jobs = sorted([*merged_jobs, (where, words)], key=lambda job: order[job[0]])
        groups.append((merged_keys, merged_jobs))
    return sorted((lane for _, lane in groups), key=len, reverse=True)  # the longest lane starts first


@pytest.mark.dist
def test_cpu_commands_run_as_written(workspace):
    """The tools run on the demo run and its export, each command in the order the docs show it
    relative to every other command on the same run (two runs' commands at once, one process each);
    a command written twice in the docs runs once; the python snippet runs where mdlmpe_ds cannot be
    imported."""
    from concurrent.futures import ThreadPoolExecutor

    root = workspace["root"]
    commands, snippets = documented()
    jobs, ran, seen, checked, lm_evals = [], [], {}, {}, set()
    for cmd in commands:
        kind = handler(cmd)
        if kind == "tool" and not _needs_elsewhere(cmd):
            small = SMALL.get(cmd.target, [])
            words = [sys.executable, *cmd.launcher[1:], *cmd.target.split(), *substituted(cmd), *small]
            paths = inputs(cmd)
            checked[cmd.where] = paths  # a tool's inputs must be in the workspace when it runs
        elif kind == "run":  # a small script that builds its own inputs (seconds): run as written
            words = [sys.executable, str(REPO / cmd.target), *substituted(cmd)]
            paths = inputs(cmd)
        elif kind == "lm_eval":
            words = _lm_eval_on_cpu(cmd, root)
            paths = inputs(cmd)
            lm_evals.add(cmd.where)
        else:
            continue
        ran.append(cmd.where)
        if tuple(words) in seen:  # the same command on another page: it ran already (same workspace)
            continue
        seen[tuple(words)] = cmd.where
        jobs.append((cmd.where, words, paths))

    def run_lane(lane: list[tuple[str, list[str]]]) -> None:
        for where, words in lane:
            for path in checked.get(where, []):  # what an earlier command of the lane was to make is there
                assert (root / path).exists(), (
                    f"{where}: {path} is not in the workspace ({shlex.join(words)})"
                )
            out = _run(words, root, where, clean_stdout=_writes_answers(words))
            if where in lm_evals:
                assert list((root / "results").rglob("*.json")), f"{where}: no results written\n{out[-2000:]}"

    with ThreadPoolExecutor(max_workers=2) as pool:
        for future in [pool.submit(run_lane, lane) for lane in _lanes(jobs, root)]:
            future.result()  # the first failing lane's assertion, naming its command
    assert (root / "outputs" / "llada-sft" / "export" / "config.json").is_file()
    for where, body in snippets:
        script = root / "snippet.py"
        script.write_text(_NO_MDLMPE_DS + body)
        out = _run([sys.executable, str(script)], root, where, env={**_env(), "PYTHONPATH": ""})
        assert out.strip(), f"{where}: printed nothing"
        assert "[y/N]" not in out, f"{where}: asks whether to run the export's code:\n{out[-2000:]}"
        ran.append(where)
    assert len(ran) >= 7, ran
