"""The fenced ```python blocks of a Markdown page, in order, with the line each starts on.

Used by the tests that run the docs' code as written (tests/test_doc_blocks.py, tests/test_accelerate.py,
tests/test_fabric.py), so a page's blocks are found one way everywhere.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", flags=re.S | re.M)


class Block(NamedTuple):
    """One ```python block: its page, its index on the page, the line of its first code line, its code."""

    page: str
    index: int
    line: int
    code: str

    @property
    def fragment(self) -> bool:
        """True when the block says it cannot run alone (first line ``# fragment: why``)."""
        return self.code.lstrip().startswith("# fragment")

    @property
    def continues(self) -> bool:
        """True when the block runs after the one above, in its namespace (``# continues the block above``)."""
        return "# continues the block above" in self.code.splitlines()[0] if self.code else False

    def compiled(self):
        """The block compiled with its page's line numbers, so a traceback points into the page."""
        return compile("\n" * (self.line - 1) + self.code, str(ROOT / self.page), "exec")


def python_blocks(page: str, text: str | None = None) -> list[Block]:
    """The ```python blocks of ``page`` (a path under the repository root), in order.

    Example:
        >>> [(b.index, b.line, b.code) for b in python_blocks("x.md", "a\\n```python\\nx = 1\\n```\\n```python\\ny = 2\\n```\\n")]
        [(0, 3, 'x = 1\\n'), (1, 6, 'y = 2\\n')]
    """
    text = (ROOT / page).read_text() if text is None else text
    return [Block(page, i, text.count("\n", 0, m.start(1)) + 1, m.group(1)) for i, m in enumerate(FENCE.finditer(text))]


def doc_block(page: str, containing: str) -> str:
    """The code of the one ```python block of ``page`` that contains ``containing``, as written."""
    return next(b.code for b in python_blocks(page) if containing in b.code)
