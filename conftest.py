"""Loaded by every pytest run in this repository (the doctests of ``lightning_remat`` included, which
``tests/conftest.py`` does not reach)."""

import os

# With DeepSpeed installed, Accelerate's ``prepare`` imports it, and DeepSpeed's accelerator detection
# prints "Setting accelerator to CPU ..." to stdout on a machine without a GPU, inside any doctest that
# prepares a model. Naming the accelerator keeps it quiet; the tests run on the CPU anyway.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
