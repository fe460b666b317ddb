"""The one step runner, ``run_step``; what watches a step (the profile's observer, the peak meter): a ``StepWatch``."""

from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from ...core.errors import UnsupportedSetupError
from .optimizers import optimizer_list

Step = Callable[[nn.Module], torch.Tensor]


class StepWatch:
    """What watches a step that ``run_step`` runs (this one: nothing); ``backward_done()`` runs after backward."""

    def watching(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def forward(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def backward(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def backward_done(self) -> None:
        pass


def run_step(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None = None, *,
             watch: StepWatch | None = None, zero_grad: str | None = None, check: bool = False,
             read_loss: bool = False) -> float | None:
    """Run one training step of ``model`` under ``watch``; the loss as a float with ``read_loss``, else None.

    ``zero_grad``: ``"before"``, ``"after"`` or None; ``check``: ``TypeError`` unless the loss is a scalar tensor.
    """
    watch = watch if watch is not None else StepWatch()
    if zero_grad == "before":
        model.zero_grad(set_to_none=True)
    value = None
    with watch.watching():
        with watch.forward(), _explained():
            loss = step(model)
        # A number (loss.item()) has no graph: say so rather than fail on .backward.
        if not isinstance(loss, torch.Tensor) or (check and loss.dim() != 0):
            raise TypeError(f"step(model) must return the scalar loss tensor, got {type(loss).__name__}"
                            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                            + (" (a number has no graph to run backward on: return the tensor, not loss.item())"
                               if isinstance(loss, (int, float)) else ""))
        with watch.backward():
            loss.backward()
        watch.backward_done()
        for each in optimizer_list(optimizer):
            each.step()
        if read_loss:
            value = float(loss.detach())
        del loss
    if zero_grad == "after":
        model.zero_grad(set_to_none=True)
    return value


@contextlib.contextmanager
def _explained() -> Iterator[None]:
    """Explain torch's module trackers failing on ``torch.autograd.grad`` of a leaf module input."""
    try:
        yield
    except RuntimeError as error:
        if "_will_engine_execute_node" not in str(error):
            raise
        raise UnsupportedSetupError(
            "lightning-remat: the step calls torch.autograd.grad (a gradient penalty, double backward) while a "
            "module's input is a leaf tensor that requires grad, which torch's module trackers used to profile "
            "the step (FlopCounterMode, MemTracker) do not support (torch: 'A leaf node was passed to "
            "_will_engine_execute_node ...'). Differentiate with respect to a tensor made inside the step, e.g. "
            "x = batch.requires_grad_() * 1 (docs/limitations.md)") from error


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU for an empty model."""
    return next((t.device for t in itertools.chain(model.parameters(), model.buffers())), torch.device("cpu"))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that wall-clock timings mean something."""
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    if hasattr(backend, "synchronize"):
        # The model's device, not the current one: they differ when a process drives several.
        backend.synchronize(device)


class Tracking(StepWatch):
    """A ``MemTracker`` around the whole step, counting the model's state and the optimizer's besides the step's."""

    def __init__(self, tracker: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.tracker = tracker
        self.model = model
        self.optimizer = optimizer

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        self.tracker.track_external(self.model, *optimizer_list(self.optimizer))
        with self.tracker, warnings.catch_warnings():
            # MemTracker warns when a module's backward hook outlives the module's outputs.
            warnings.filterwarnings("ignore", message="Module is None")
            yield
