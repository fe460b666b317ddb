"""Keep ``torch.compile`` from compiling while we measure: a counted ``force_eager`` stance.

Dynamo refuses to trace a frame while a torch dispatch mode is active (MemTracker is one) and
marks that frame's code as skipped for good: a compiled model whose *first* call happens under a
tracker never compiles afterwards and silently runs eagerly. Under the ``force_eager`` stance
dynamo does not look at frames at all, so nothing is marked, and the real compile happens at the
first step after profiling. A compiled model already runs eagerly under a tracker, so measurements
do not change.

The stance is counted, not nested: trackers may open in one hook and close in another, in any
order; the stance in force before the first one opened comes back when the last one closes.

Example:
    >>> import torch
    >>> with eager_stance():
    ...     with eager_stance():
    ...         pass
    ...     torch._dynamo.eval_frame._stance.stance
    'force_eager'
    >>> torch._dynamo.eval_frame._stance.stance
    'default'
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

_lock = threading.Lock()
_holders = 0
_stance: Any = None  # torch's set_stance object of the first holder: its exit restores the prior stance


def hold_eager() -> None:
    """Count one more holder of the ``force_eager`` stance; the first one sets it."""
    global _holders, _stance
    with _lock:
        if _holders == 0:
            _stance = torch.compiler.set_stance("force_eager")  # takes effect when made
        _holders += 1


def release_eager() -> None:
    """Count one holder less; the last one puts back the stance that was in force before."""
    global _holders, _stance
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            stance, _stance = _stance, None
            stance.__exit__(None, None, None)


@contextlib.contextmanager
def eager_stance() -> Iterator[None]:
    """``torch.compile``'d code runs eagerly (and compiles nothing) inside the block."""
    hold_eager()
    try:
        yield
    finally:
        release_eager()
