"""Keep ``torch.compile`` from compiling while we measure: a counted ``force_eager`` stance.

Dynamo marks a frame first met under a dispatch mode as skipped for good; under ``force_eager`` it looks
at none. Counted, not nested: trackers may open and close in any order."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

_lock = threading.Lock()
_holders = 0
_stance: Any = None  # torch's set_stance object of the first holder: its exit restores the prior stance


@contextlib.contextmanager
def eager_stance() -> Iterator[None]:
    """``torch.compile``'d code runs eagerly (and compiles nothing) inside the block."""
    global _holders, _stance
    with _lock:
        if _holders == 0:
            _stance = torch.compiler.set_stance("force_eager")  # takes effect when made
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:  # the last holder puts back the stance that was in force before
                stance, _stance = _stance, None
                stance.__exit__(None, None, None)
