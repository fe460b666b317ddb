"""Every ```python block of README and the docs runs as written, or says why it cannot.

A block whose first line is ``# fragment: why`` cannot run alone (it needs the reader's model, a GPU, a
launcher); every other block runs here on the CPU, in a fresh namespace (after the blocks above it
when it starts with ``# continues the block above``), from a temporary directory. What a block says it
prints (``print(x)  # a=1, b=2``, or a comment line under the print) must be in what it printed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.doc_blocks import ROOT, Block, python_blocks

# README and every page under docs/: a new page's blocks are run without being listed here.
PAGES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")))
BLOCKS = [block for page in PAGES for block in python_blocks(page)]


def _name(block: Block) -> str:
    return f"{Path(block.page).name}-{block.index}"


def _fabric_recipe(scope, code):
    # Before, the page's only recipe planned on the first batch: under dynamic padding a later, longer
    # batch ran unplanned (1.47x the budget on this loop). Now a plan per shape bucket met.
    assert 'accelerator="cpu"' in code and "plans.use(batch)" in code
    assert scope["plans"].counts.steps == 6 and len(scope["plans"].plans) > 1
    assert torch.isfinite(scope["loss"])


def _ten_lines(scope, code):
    from lightning_remat.runtime.installing.apply import checkpointed_modules

    plan = scope["plan"]
    assert plan.checkpointed and plan.predicted_peak_bytes <= plan.budget_bytes
    assert checkpointed_modules(scope["case"].model) == []  # remove_remat put every forward back


def _shape_loop(scope, code):
    assert scope["plans"].counts.steps == 12 and len(scope["plans"].plans) > 1


def _tutorial(scope, code):
    # The page says the measured peak is the predicted one, under the budget.
    plan, measured = scope["plan"], scope["measured"]
    assert plan.checkpointed and measured.peak_bytes == plan.predicted_peak_bytes <= plan.budget_bytes


# What a block's names must hold after it ran, beyond running and printing what it says.
CHECKS = {"fabric.md-0": _fabric_recipe, "README.md-0": _ten_lines, "shapes.md-1": _shape_loop,
          "tutorial.md-3": _tutorial}


def expected_output(code: str) -> list[str]:
    """What a block says it prints: the ``k=v`` of a print's comment, a comment line right under a print.

    Example:
        >>> expected_output("print(c)   # a=1, b=2\\nprint(s)\\n# 4x76 {x: b}\\nprint(p)  # what binds\\n")
        ['a=1', 'b=2', '4x76 {x: b}']
    """
    expected, lines = [], code.splitlines()
    for above, line in zip([""] + lines, lines):
        if line.startswith("print(") and "#" in line:
            expected += [pair.rstrip(",") for pair in re.findall(r"\w+=\S+", line.split("#", 1)[1])]
        elif line.startswith("# ") and above.startswith("print("):
            expected.append(line[2:].strip())
    return expected


def _chain(block: Block) -> list[Block]:
    """The block, after the blocks above it that it continues."""
    if not block.continues:
        return [block]
    assert block.index > 0, f"{block.page}:{block.line} continues no block"
    return _chain(python_blocks(block.page)[block.index - 1]) + [block]


@pytest.fixture
def fresh_process_state(tmp_path, monkeypatch):
    """A temporary working directory, no ACCELERATE_REMAT_* from the environment, Accelerate's
    process-wide state reset before and after (a block that makes an accelerator leaves it behind)."""
    import os

    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("ACCELERATE_REMAT_")]:
        monkeypatch.delenv(name)

    def reset():
        if "accelerate" in sys.modules:
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(True)

    reset()
    yield
    reset()


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.fragment], ids=_name)
def test_block_runs(block, capsys, fresh_process_state):
    scope: dict = {}
    for part in _chain(block):
        exec(part.compiled(), scope)
    printed = capsys.readouterr().out
    missing = [text for text in expected_output(block.code) if text not in printed]
    assert not missing, f"{block.page}:{block.line} says it prints {missing}; it printed:\n{printed}"
    if _name(block) in CHECKS:
        CHECKS[_name(block)](scope, block.code)


def test_every_block_runs_or_says_why_not():
    """A fragment names what it needs; the blocks that run include README's ten lines and each page's
    main recipe where it can run on a CPU."""
    for block in BLOCKS:
        if block.fragment:
            reason = block.code.splitlines()[0].partition("# fragment")[2].lstrip(":").strip()
            assert len(reason.split()) >= 3, f"{block.page}:{block.line}: say why the block cannot run alone"
    running = {_name(b) for b in BLOCKS if not b.fragment}
    assert {"README.md-0", "fabric.md-0", "shapes.md-0", "shapes.md-1", "accelerate.md-2"} <= running
    assert set(CHECKS) <= running
    assert len(BLOCKS) >= 15  # a page whose fences stop matching would drop its blocks silently
