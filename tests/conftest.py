"""Shared test settings: deterministic, quiet, and sized for a 2-core CPU machine."""

import os
import warnings

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # With one test process per core, a second torch thread per process only oversubscribes.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    # Tests that share a profiled model (a module-scoped fixture per model) run on one worker, so
    # each model is profiled once under `pytest -n 2 --dist loadgroup`.
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "profiled" in callspec.params:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}-{callspec.params['profiled']}"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
