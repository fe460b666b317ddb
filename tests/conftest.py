"""Shared test settings: deterministic, quiet, and sized for a 2-core CPU machine."""

import os
import warnings

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
