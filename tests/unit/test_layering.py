"""The package's layers, read from its imports (ast): every import between two units goes down.

Top to bottom: launch scripts -> run assembly (runs/, compare) -> launching -> trainer -> tasks ->
engine/checkpoint -> config -> models -> data, diffusion, attention -> pe, with small utilities
(seeding, collectives, recipes, hub.resolve) at the bottom. Units on the same level never import
each other, so the unit graph has no cycles. Imports inside functions count: a lazy import is a
dependency all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# unit -> level; an import from unit A to another unit B needs LEVELS[A] > LEVELS[B].
LEVELS: dict[str, int] = {
    "launch": 100,  # launch/*.py: argument parsing and the user-facing summary only
    "runs": 90,  # run assembly: config, tokenizer, data, engine, tracker, resume
    "compare": 90,  # the encoding comparison: trains through launch/pretrain.py, then evaluates
    "evaluation": 80,
    "experiments": 84,  # the studies: build models, train in-process, evaluate, report
    "analysis": 82,  # diagnostics of any model evaluation's loader reads (exports, runs, hub ids)
    "hub": 80,  # export (the hub's name resolution is a bottom utility: hub.resolve)
    "launching": 85,  # the launchers' run flags, CPU re-launch, resume command, exit codes
    "trainer": 72,  # the loop
    "tasks": 70,  # SFT / pretraining: batches, corruption, loss
    "lora": 65,  # LoRA injection, checkpoints and export (over engine/checkpoint)
    "lora_base": 63,  # where a LoRA run's frozen base is found again and whether it is the same one
    "tracking": 62,
    "lifecycle": 62,
    "log_setup": 62,
    "faults": 62,
    "engine": 60,
    "checkpoint": 60,
    "memory_plan": 58,
    "weights_only": 58,  # the model-only save of a stopped run (trainer writes, export reads)
    "resume_changes": 57,  # what a resume may change (over config's key names)
    "recipes": 57,  # the launchers' complete configs (over cli's typed mappings)
    "cli": 56,  # the one parser: command line and config files from config's types
    "config": 55,
    "lora_spec": 54,  # the --lora spec the run config validates
    "models": 50,
    "data": 45,
    "diffusion": 45,
    "attention": 40,
    "pe": 30,
    "hub.resolve": 8,
    "seeding": 5,
    "collectives": 5,
    "stop_request": 5,  # the stop flag, polled by data setup
    "run_lock": 5,
}

# Edges that break the order today and are being removed on another branch. Each is allowed
# explicitly, with the reason; delete the entry once the edge is gone.
PENDING: dict[tuple[str, str], str] = {}


def unit_of(module: str) -> str:
    """``mdlmpe_ds.a.b`` -> ``a`` (``hub.resolve`` is its own unit); launch scripts -> ``launch``."""
    if module.startswith("launch."):
        return "launch"
    parts = module.split(".")[1:]
    if parts[:2] == ["hub", "resolve"]:
        return "hub.resolve"
    return parts[0] if parts else "mdlmpe_ds"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Every ``mdlmpe_ds`` module ``path`` imports, at any depth of the file (``from pkg import
    name`` counts as ``pkg.name`` when that is a module)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "mdlmpe_ds"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "mdlmpe_ds":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                as_path = REPO / sub.replace(".", "/")
                is_module = as_path.with_suffix(".py").is_file() or (as_path / "__init__.py").is_file()
                out.add(sub if is_module else target)
    return out


def unit_edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the ``file: module`` lines that make the edge."""
    files = sorted((REPO / "mdlmpe_ds").rglob("*.py")) + sorted((REPO / "launch").glob("*.py"))
    edges: dict[tuple[str, str], list[str]] = {}
    for path in files:
        src = unit_of(module_name(path))
        for target in imported_modules(path):
            dst = unit_of(target)
            if dst != src and dst != "mdlmpe_ds":
                edges.setdefault((src, dst), []).append(f"{path.relative_to(REPO)}: {target}")
    return edges


def violations(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    out = []
    for (src, dst), where in sorted(edges.items()):
        for unit in (src, dst):
            if unit not in LEVELS:
                out.append(
                    f"unit {unit!r} has no layer: add it to LEVELS in {Path(__file__).name} ({where[0]})"
                )
        if src in LEVELS and dst in LEVELS and LEVELS[src] <= LEVELS[dst] and (src, dst) not in PENDING:
            out.append(f"{src} (level {LEVELS[src]}) imports {dst} (level {LEVELS[dst]}): {'; '.join(where)}")
    return out


def cycles(edges) -> list[list[str]]:
    """Cycles of the unit graph (depth-first search; each reported once from its first unit)."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_imports_go_down_the_layers():
    assert violations(unit_edges()) == []


def test_no_cycles_between_units_but_the_pending_ones():
    edges = {e: w for e, w in unit_edges().items() if e not in PENDING}
    assert cycles(edges) == []


def test_library_code_never_runs_a_launch_script_by_path():
    """Library code never imports from launch/ by path (compare.py runs launch/pretrain.py as a
    subprocess, the user's own pretraining command)."""
    for path in (REPO / "mdlmpe_ds").rglob("*.py"):
        text = path.read_text()
        assert '"launch" /' not in text and 'REPO / "launch"' not in text, path


# The one library module that builds a parser: the training command line and config files from the
# config's types (jsonargparse); it never reads sys.argv, the launch/ scripts pass argv in.
PARSER_MODULE = "mdlmpe_ds/cli.py"
# Library modules that still parse their own `python -m` command line (each is a module entry of
# its own, outside the training command line); delete an entry once its parser moves to launch/.
PARSING_PENDING = {
    "mdlmpe_ds/analysis/cli.py": "python -m mdlmpe_ds.analysis",
    "mdlmpe_ds/data/assets.py": "python -m mdlmpe_ds.data.assets prepare",
    "mdlmpe_ds/data/corpora.py": "python -m mdlmpe_ds.data.corpora prepare",
    "mdlmpe_ds/engine.py": "python -m mdlmpe_ds.engine to-universal (ds_to_universal reads sys.argv)",
    "mdlmpe_ds/evaluation/lm_eval_adapter.py": "lm-eval's own CLI entry reads sys.argv",
}


def argv_parsing(path: Path) -> list[str]:
    """Where ``path`` reads ``sys.argv`` or builds an argparse / jsonargparse parser (ast)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "argv":
            if isinstance(node.value, ast.Name) and node.value.id == "sys":
                found.append(f"{path.name}:{node.lineno}: sys.argv")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "ArgumentParser":
                found.append(f"{path.name}:{node.lineno}: ArgumentParser(...)")
    return found


def test_nothing_in_the_library_parses_argv():
    """Argument parsing lives in launch/: no module under mdlmpe_ds/ reads sys.argv or builds a
    parser, except mdlmpe_ds/cli.py (which builds the training parser but never reads sys.argv)
    and the pending `python -m` entries above."""
    offenders = {}
    for path in sorted((REPO / "mdlmpe_ds").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel in PARSING_PENDING:
            continue
        found = argv_parsing(path)
        if rel == PARSER_MODULE:
            found = [f for f in found if "sys.argv" in f]
        if found:
            offenders[rel] = found
    assert offenders == {}
    assert [f for f in argv_parsing(REPO / PARSER_MODULE) if "ArgumentParser" in f]  # the rule sees it
    assert all(argv_parsing(REPO / rel) for rel in PARSING_PENDING), "a pending entry is clean: delete it"


def test_the_checks_catch_a_back_edge_and_a_cycle():
    """The checker itself: a models -> trainer edge and a two-unit cycle are reported."""
    edges = {
        ("models", "trainer"): ["mdlmpe_ds/models/x.py: mdlmpe_ds.trainer"],
        ("trainer", "models"): ["y"],
    }
    assert any("models (level 50) imports trainer" in v for v in violations(edges))
    assert cycles(edges) == [["models", "trainer", "models"]]
    assert any("has no layer" in v for v in violations({("newpkg", "pe"): ["z"]}))


def test_production_code_reads_no_test_hooks_from_the_environment():
    """Fault hooks are injected (mdlmpe_ds/faults.py), never read from environment variables."""
    for path in (REPO / "mdlmpe_ds").rglob("*.py"):
        text = path.read_text()
        assert "MDLMPE_DS_FAULT" not in text and "MDLMPE_DS_PROBE" not in text, path
