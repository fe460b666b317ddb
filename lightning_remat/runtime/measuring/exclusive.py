"""One planning at a time in a process, and the process-wide settings it found put back (docs/process.md)."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator

import torch

# Re-entrant: profile_step calls measure_step, Planner.decide profile_step, a tracker's window opens in a plan.
PLANNING_LOCK = threading.RLock()


@dataclass(frozen=True)
class ProcessSettings:
    """The settings a measured step may leave changed: process-wide ones and the thread's grad mode."""

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
    """Whether code running now may belong to the planning in progress: its thread, autograd's worker, or none runs."""
    if PLANNING_LOCK._is_owned() or torch._C._current_graph_task_id() != -1:  # type: ignore[attr-defined]
        return True
    if PLANNING_LOCK.acquire(blocking=False):  # nobody plans: hooks used on their own (tests, examples)
        PLANNING_LOCK.release()
        return True
    return False


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """Hold the planning lock for the block (or decorated call) and put back the ``ProcessSettings`` found."""
    with PLANNING_LOCK:
        settings = ProcessSettings.capture()
        try:
            yield
        finally:
            settings.restore()
