"""One planning at a time in a process, and the process-wide settings it found put back (docs/process.md)."""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

import torch

# Re-entrant: profile_step calls measure_step, Planner.decide profile_step, a tracker's window opens in a plan.
PLANNING_LOCK = threading.RLock()


def planning_runs_here() -> bool:
    """Whether code running now may belong to the planning in progress: its thread, autograd's worker, or none runs."""
    if PLANNING_LOCK._is_owned() or torch._C._current_graph_task_id() != -1:  # type: ignore[attr-defined]
        return True
    if PLANNING_LOCK.acquire(blocking=False):  # nobody plans: hooks used on their own (tests, examples)
        PLANNING_LOCK.release()
        return True
    return False


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """Hold the planning lock for the block (or decorated call) and put back the settings a measured step may leave
    changed: process-wide ones and the thread's grad mode."""
    with PLANNING_LOCK:
        dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
        deterministic = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        try:
            yield
        finally:
            torch.set_default_dtype(dtype)
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
            torch.set_grad_enabled(grad)


@contextlib.contextmanager
def long_lived_frozen() -> Iterator[None]:
    """Within the block the collector's full passes skip the objects alive before it (``gc.freeze``): a fake
    profile's allocate thousands of tensors each, and every full pass walked the whole process (torch, transformers).

    Example:
        >>> with long_lived_frozen():
        ...     frozen = gc.get_freeze_count() > 0
        >>> frozen, gc.get_freeze_count()
        (True, 0)
    """
    if gc.get_freeze_count():  # the process froze its own (or an outer block did): left as it is
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
