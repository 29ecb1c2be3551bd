"""The package's layers, read from its imports (ast): every import between two units goes down.

Top to bottom: launch scripts -> experiments -> run assembly (runs/) -> evaluation, analysis, hub ->
training/ (callbacks, trainer, checkpointer, checkpoint) -> tasks -> lora/ -> distributed/engine ->
config/ -> models -> data, diffusion, attention -> pe, with small utilities (seeding, stop_request,
run_lock, distributed/collectives and process_group, hub.resolve) at the bottom. The packages that
group modules of different layers (training/, distributed/, lora/, config/) are checked module by
module. Units on the same level never import
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
    "experiments": 92,  # the comparison and the studies: train, evaluate, report
    "runs": 90,  # run assembly (config, tokenizer, data, engine, tracker, resume); the launchers' helpers
    "evaluation": 80,
    "analysis": 82,  # diagnostics of any model evaluation's loader reads (exports, runs, hub ids)
    "hub": 80,  # export (the hub's name resolution is a bottom utility: hub.resolve)
    "training.callbacks": 76,  # head schedule, statistics, LoRA, stops, faults
    "training.trainer": 72,  # the loop
    "tasks": 70,  # SFT / pretraining: batches, corruption, loss
    "training.checkpointer": 68,  # the save and resume protocol
    "training.callback": 66,  # the hook points of the loop (the base class the callbacks implement)
    "training.consolidate": 66,  # a checkpoint's weights as the plain model's (export and evaluation read it)
    "lora.attach": 65,  # a LoRA run's model made ready: base kept, adapters injected (over the engine)
    "lora.export": 64,  # merge and peft adapter directories (reads the base)
    "lora.checkpoints": 64,  # lora.json and the resume check (the checkpoint callback's LoRA part)
    "lora.base": 63,  # where a LoRA run's frozen base is found again and whether it is the same one
    "training.tracking": 62,
    "training.lifecycle": 62,
    "training.log_setup": 62,
    "training.faults": 62,
    "distributed.engine": 60,  # the only module importing DeepSpeed
    "training.checkpoint": 60,  # the checkpoint format: layout, manifest, verification, metadata
    "training.memory_plan": 58,
    "training.activation_bytes": 57,  # the plan's per-layer activation terms, read off the code
    "training.memory_measure": 57,  # one real layer measured on the CPU (the terms' ground truth)
    "lora.adapters": 59,  # LoRA injection through peft, names, counts, the initial draw (over models)
    "training.weights_only": 58,  # the model-only save of a stopped run (trainer writes, export reads)
    "training.resume_changes": 57,  # what a resume may change (over config's key names)
    "config.recipes": 57,  # the launchers' complete configs (over cli's typed mappings)
    "config.cli": 56,  # the one parser: command line and config files from config's types
    "training.head_chunks": 56,  # the LM head's chunking of a run
    "config.run": 55,  # the typed run config: sections, help per key, validation
    "lora.spec": 54,  # the --lora spec the run config validates
    "models": 50,
    "data": 45,
    "diffusion": 45,
    "attention": 40,
    "pe": 30,
    "compat": 20,  # readers of older checkpoint and export layouts: pure functions of dicts
    "hub.resolve": 8,
    "seeding": 5,
    "distributed.collectives": 5,  # host-tensor collectives on gloo groups beside NCCL
    "distributed.process_group": 5,  # rank, world size, barrier: torch.distributed only
    "stop_request": 5,  # the stop flag, polled by data setup
    "run_lock": 5,
}

# Packages that group modules of different layers: each of their modules is a unit of its own.
GROUPED = ("training", "distributed", "lora", "config")

# Edges that break the order today and are being removed on another branch. Each is allowed
# explicitly, with the reason; delete the entry once the edge is gone.
PENDING: dict[tuple[str, str], str] = {}


def unit_of(module: str) -> str:
    """``mdlmpe_ds.a.b`` -> ``a``, or ``a.b`` in a GROUPED package (``hub.resolve`` is its own unit);
    launch scripts -> ``launch``."""
    if module.startswith("launch."):
        return "launch"
    parts = module.split(".")[1:]
    if parts[:2] == ["hub", "resolve"]:
        return "hub.resolve"
    if parts and parts[0] in GROUPED:
        return ".".join(parts[:2])
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
PARSER_MODULE = "mdlmpe_ds/config/cli.py"
# Library modules whose ``python -m`` command line moved to launch/ (their spellings were documented
# before): each keeps only a guard that exits with the new command, so an old script fails loudly
# instead of importing the module and exiting 0 having done nothing.
MOVED_COMMANDS = {
    "mdlmpe_ds/analysis/__main__.py": "launch/analyze.py",
    "mdlmpe_ds/data/assets.py": "launch/prepare_data.py",
    "mdlmpe_ds/data/corpora.py": "launch/prepare_data.py",
    "mdlmpe_ds/evaluation/lm_eval_adapter.py": "launch/lm_eval_harness.py",
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
    parser, except mdlmpe_ds/config/cli.py (which builds the training parser but never reads
    sys.argv)."""
    offenders = {}
    for path in sorted((REPO / "mdlmpe_ds").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        found = argv_parsing(path)
        if rel == PARSER_MODULE:
            found = [f for f in found if "sys.argv" in f]
        if found:
            offenders[rel] = found
    assert offenders == {}
    assert [f for f in argv_parsing(REPO / PARSER_MODULE) if "ArgumentParser" in f]  # the rule sees it


def _main_guards(path: Path) -> list[list[ast.stmt]]:
    """The bodies of ``if __name__ == "__main__":`` blocks in ``path`` (the whole module for a
    ``__main__.py``, its docstring left out)."""
    tree = ast.parse(path.read_text(), str(path))
    if path.name == "__main__.py":
        body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
        return [body]
    return [
        node.body
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)
    ]


def _is_moved_notice(body: list[ast.stmt], target: str) -> bool:
    """One ``raise SystemExit("... launch/x.py ...")`` and nothing else."""
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or not isinstance(body[0].exc, ast.Call):
        return False
    call = body[0].exc
    text = " ".join(
        n.value for n in ast.walk(call) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    )
    return getattr(call.func, "id", "") == "SystemExit" and target in text


def test_no_library_module_runs_as_a_command():
    """Entry points live in launch/: a library module has no ``__main__`` block and no package has a
    ``__main__.py``, except the moved commands' one-line notices (MOVED_COMMANDS), which name the
    launch/ script and run nothing else."""
    offenders = {}
    for path in sorted((REPO / "mdlmpe_ds").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        guards = _main_guards(path)
        if rel in MOVED_COMMANDS:
            assert guards and all(_is_moved_notice(b, MOVED_COMMANDS[rel]) for b in guards), rel
            assert (REPO / MOVED_COMMANDS[rel]).is_file(), MOVED_COMMANDS[rel]
        elif guards:
            offenders[rel] = [ast.unparse(stmt) for body in guards for stmt in body]
    assert offenders == {}


def test_the_checks_catch_a_back_edge_and_a_cycle():
    """The checker itself: a models -> trainer edge and a two-unit cycle are reported."""
    edges = {
        ("models", "training.trainer"): ["mdlmpe_ds/models/x.py: mdlmpe_ds.training.trainer"],
        ("training.trainer", "models"): ["y"],
    }
    assert any("models (level 50) imports training.trainer" in v for v in violations(edges))
    assert cycles(edges) == [["models", "training.trainer", "models"]]
    assert unit_of("mdlmpe_ds.training.checkpoint") == "training.checkpoint"
    assert unit_of("mdlmpe_ds.data.sft_rows") == "data"
    assert any("has no layer" in v for v in violations({("newpkg", "pe"): ["z"]}))


def test_production_code_reads_no_test_hooks_from_the_environment():
    """Fault hooks are injected (mdlmpe_ds/training/faults.py), never read from environment variables."""
    for path in (REPO / "mdlmpe_ds").rglob("*.py"):
        text = path.read_text()
        assert "MDLMPE_DS_FAULT" not in text and "MDLMPE_DS_PROBE" not in text, path


# ---------------------------------------------------------------------------- rules by name
def _imports_of(unit_path: str) -> dict[str, set[str]]:
    """file -> the ``mdlmpe_ds`` modules and the outside top-level modules it imports, for every
    file of a unit (a package folder or one module)."""
    root = REPO / "mdlmpe_ds" / unit_path
    files = sorted(root.rglob("*.py")) if root.is_dir() else [root.with_suffix(".py")]
    out = {}
    for path in files:
        names = set(imported_modules(path))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names |= {f"{node.module}.{a.name}" for a in node.names}
        out[str(path.relative_to(REPO))] = names
    return out


def _offending(unit_path: str, banned: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{file}: {name}"
        for file, names in _imports_of(unit_path).items()
        for name in names
        if any(name == b or name.startswith(b + ".") for b in banned)
    )


def test_the_engine_imports_no_position_encoding():
    """The engine registers ZeRO-3 external parameters from what the model declares
    (``zero3_external_parameters``), never by knowing MDLMPE's classes."""
    assert _offending("distributed/engine", ("mdlmpe_ds.pe",)) == []


def test_models_import_no_process_group_code():
    """Model code runs on one device: the chunk count the ranks agree on is computed above it
    (head_chunks.py) and passed in."""
    banned = (
        "torch.distributed",
        "mdlmpe_ds.distributed.collectives",
        "mdlmpe_ds.distributed.process_group",
        "mdlmpe_ds.distributed.engine",
    )
    assert _offending("models", banned) == []


def test_the_trainer_imports_neither_lora_nor_position_encodings():
    """LoRA's checkpoint policy and MDLMPE's head schedule and statistics are callbacks (callbacks.py),
    handed to the loop by the run."""
    banned = ("mdlmpe_ds.lora", "mdlmpe_ds.pe")
    assert _offending("training/trainer", banned) == []


def test_models_read_no_environment_variable():
    """A model's behaviour is its config and its arguments: settings from the environment are read
    by the run (e.g. head_chunks.configured_chunk) and passed in."""
    found = []
    for path in sorted((REPO / "mdlmpe_ds" / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
            if name in ("environ", "getenv", "putenv"):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                found += [f"{path.relative_to(REPO)}:{node.lineno}: os.{a.name}" for a in node.names]
    assert found == []


def test_diffusion_imports_no_position_encoding():
    """Corruption, losses and sampling are pure functions of masks and logits: they need no
    position-encoding code (the levels alone would allow diffusion -> pe)."""
    edges = unit_edges()
    assert ("diffusion", "pe") not in edges, edges.get(("diffusion", "pe"))


def test_old_layout_readers_live_in_compat():
    """What an older checkpoint or export holds is read in one module (compat.py), which imports
    nothing of the package (every layer may call it); the tables of old keys are defined there only."""
    assert imported_modules(REPO / "mdlmpe_ds" / "compat.py") == set()
    tables = ("MOVED_KEYS = ", "ADDED_KEYS = ", "RUNTIME_KEYS = ")
    for path in (REPO / "mdlmpe_ds").rglob("*.py"):
        if path.name != "compat.py":
            text = path.read_text()
            assert not any(f"\n{t}" in text for t in tables), path


def test_modules_that_locate_the_repository_find_it():
    """A module that finds the repository from its own path (``REPO = Path(__file__).parents[n]``)
    must count the folders it sits in: moving it into a package changes n."""
    import importlib
    import re

    found = []
    for path in sorted((REPO / "mdlmpe_ds").rglob("*.py")):
        if re.search(r"^REPO = Path\(__file__\)", path.read_text(), re.M):
            module = importlib.import_module(module_name(path))
            found.append(module.__name__)
            assert (module.REPO / "pyproject.toml").is_file() and (module.REPO / "launch").is_dir(), path
    assert len(found) >= 3, found
