"""One planning at a time in a process, and the process-wide settings it found put back after it.

Planning measures a step with machinery that is process-wide, not per thread: MemTracker and
FlopCounterMode register *global* module and optimizer hooks and MemTracker patches
``torch.UntypedStorage.resize_``; profiling replays the *global* random generators before each
pass; the ``force_eager`` dynamo stance is global. Two plannings at once in two threads would see
each other's modules and storages (a ``KeyError`` in MemTracker, or a wrong plan), so every entry
point that runs a measured step holds ``exclusive()``: a process-wide re-entrant lock (one thread
plans, the others wait; nesting in one thread is free), and on the way out the settings a step may
change for the whole process (default dtype, deterministic algorithms) or for its thread (grad
mode) are put back as they were found. What stays shared is in docs/process.md.

Example:
    >>> import torch
    >>> @exclusive()
    ... def careless_step():
    ...     torch.set_default_dtype(torch.float64)
    ...     torch.set_grad_enabled(False)
    >>> careless_step()
    >>> torch.get_default_dtype(), torch.is_grad_enabled()
    (torch.float32, True)
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator

import torch

# Re-entrant: profile_step calls measure_step, Planner.decide calls profile_step, and a tracker's
# window may open inside a planning call of the same thread.
PLANNING_LOCK = threading.RLock()


@dataclass(frozen=True)
class ProcessSettings:
    """The settings a measured step may leave changed: process-wide ones and the thread's grad mode.

    Example:
        >>> ProcessSettings.capture() == ProcessSettings.capture()
        True
    """

    default_dtype: torch.dtype
    deterministic: bool
    deterministic_warn_only: bool
    grad_enabled: bool

    @classmethod
    def capture(cls) -> "ProcessSettings":
        return cls(torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                   torch.is_deterministic_algorithms_warn_only_enabled(), torch.is_grad_enabled())

    def restore(self) -> None:
        if self != ProcessSettings.capture():
            torch.set_default_dtype(self.default_dtype)
            torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
            torch.set_grad_enabled(self.grad_enabled)


def planning_runs_here() -> bool:
    """Whether code running now may belong to the planning in progress: its own thread (the one
    holding the lock), autograd's worker running a backward (a recompute of the planning's step on
    an accelerator), or no planning runs at all. The module hooks planning puts on a model act only
    then: another thread running the same model meanwhile (inference under ``torch.no_grad``) is
    neither counted in the profile nor disturbed by it (docs/process.md).

    Example:
        >>> planning_runs_here()  # nothing plans
        True
    """
    if PLANNING_LOCK._is_owned() or torch._C._current_graph_task_id() != -1:  # type: ignore[attr-defined]
        return True
    if PLANNING_LOCK.acquire(blocking=False):  # nobody plans: hooks used on their own (tests, examples)
        PLANNING_LOCK.release()
        return True
    return False


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """Hold the process's planning lock for the block (or the decorated call) and put back the
    ``ProcessSettings`` found on entry when it ends, however it ends."""
    with PLANNING_LOCK:
        settings = ProcessSettings.capture()
        try:
            yield
        finally:
            settings.restore()
