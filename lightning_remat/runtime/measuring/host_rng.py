"""The RNG states a checkpoint keeps until backward (made in C++, unseen by MemTracker), counted on the CPU.

On a GPU they are host memory, which the budget does not count."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch

_ORIGINAL = torch.get_rng_state
# Whether the states count: the CPU is the planned device (the default: a real step on the CPU).
_COUNT = contextvars.ContextVar("lightning_remat_rng_states_count", default=True)


@contextlib.contextmanager
def rng_states_count(device: str | torch.device | None) -> Iterator[None]:
    """Within the block, trackers count the CPU generator's states only if ``device`` is the CPU."""
    token = _COUNT.set(device is None or torch.device(device).type == "cpu")
    try:
        yield
    finally:
        _COUNT.reset(token)


@contextlib.contextmanager
def counting_rng_states(track: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """``track(state)`` for every ``torch.get_rng_state()`` made within the block (under the planning lock)."""
    if not _COUNT.get() or torch.get_rng_state is not _ORIGINAL:
        yield
        return

    def get_rng_state() -> torch.Tensor:
        state = _ORIGINAL()
        track(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = _ORIGINAL
