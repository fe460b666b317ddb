"""The one peak meter, ``PeakMeter``: ``torch.cuda.max_memory_allocated`` on a GPU, ``MemTracker``'s peak on the CPU."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages

from .optimizers import optimizer_list
from .runner import Tracking, model_device
from .tracking import PeakOnlyTracker, snapshot_by_category


class PeakMeter(Tracking):
    """The peak memory of a window as the budget means it (off CUDA, inputs made before it not counted): a
    ``StepWatch``, or ``start()`` in one hook and ``close()`` in another. ``tracker``: a ``MemTracker`` to run too."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, tracker: Any = None):
        self.device = model_device(model)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        if tracker is None and not self.cuda:
            tracker = PeakOnlyTracker()
        super().__init__(tracker, model, optimizer)
        self._entered: contextlib.ExitStack | None = None
        self._final: tuple[int, int | None] | None = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        self.start()
        try:
            yield
        except BaseException:
            entered, self._entered = self._entered, None
            if entered is not None:
                entered.__exit__(*sys.exc_info())  # the tracker sees the error, as a `with` would show it
            raise
        self.close()

    def start(self) -> "PeakMeter":
        """Start measuring (the CUDA peak statistics are reset here)."""
        self._final = None
        stack = contextlib.ExitStack()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.tracker is not None:
            stack.enter_context(super().watching())
        self._entered = stack
        return self

    @property
    def peak_bytes(self) -> int:
        """The peak so far (the final one once closed)."""
        if self._final is not None:
            return self._final[0]
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.by_category().get("Total", 0)

    @property
    def reserved_bytes(self) -> int | None:
        """``torch.cuda.max_memory_reserved`` so far on CUDA (the final one once closed); None elsewhere."""
        if self._final is not None:
            return self._final[1]
        return int(torch.cuda.max_memory_reserved(self.device)) if self.cuda else None

    def close(self) -> int:
        """Stop measuring; the peak of the window (kept: ``peak_bytes``, ``reserved_bytes``)."""
        final = (self.peak_bytes, self.reserved_bytes)
        self.abandon()
        self._final = final
        return final[0]

    def abandon(self) -> None:
        """Stop measuring without a result (the step failed)."""
        if self._entered is not None:
            entered, self._entered = self._entered, None
            entered.close()

    def by_category(self) -> dict[str, int]:
        """The tracker's split of its peak by category ("Parameter", ..., "Total"); empty without a tracker."""
        if self.tracker is None:
            return {}
        return snapshot_by_category(self.tracker.get_tracker_snapshot("peak"), self.device)


def model_state_bytes(model: nn.Module, optimizers: Any = None) -> int:
    """Bytes of the distinct storages of the model's parameters, buffers, gradients and the optimizers' state."""
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    tensors += [v for o in optimizer_list(optimizers) for state in o.state.values() for v in state.values()]
    # Through tensor subclasses (FSDP2's DTensor parameters) to the storages they hold, as MemTracker does.
    storages = {storage.data_ptr(): storage.nbytes()
                for t in tensors if isinstance(t, torch.Tensor) for storage in get_untyped_storages(t)}
    return sum(storages.values())


class PeakWindow(PeakMeter):
    """A ``PeakMeter`` started at once, for a window opened in one hook and closed in a later one."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        super().__init__(model, optimizer)
        self.start()
