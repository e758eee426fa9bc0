import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_env(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.delenv("AOTFUSE_DISABLE", raising=False)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
