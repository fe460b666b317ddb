"""Validation and test batches' peaks predicted before they run, from two forwards without gradients on slices.

>>> batch = (torch.zeros(8, 16), torch.zeros(8))
>>> batch_size_of(batch), [t.shape[0] for t in slice_batch(batch, 8, 2)]
(8, [2, 2])
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ...core.budget import format_bytes
from ...core.batch_fit import ForwardFit
from ...runtime.measuring.measure import RandomState
from ...runtime.measuring.meter import PeakWindow, model_state_bytes
from ...runtime.measuring.runner import model_device
from ...runtime.measuring.user_hooks import user_hooks_suspended


def batch_size_of(batch: Any) -> int | None:
    """The batch size Lightning finds in ``batch``, or None."""
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - a batch Lightning cannot size is one we do not predict
        return None


def slice_batch(batch: Any, size: int, samples: int) -> Any:
    """``batch`` with every tensor whose first dimension is ``size`` cut to its first ``samples``."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    return apply_to_collection(batch, torch.Tensor,
                               lambda t: t[:samples] if t.dim() > 0 and t.shape[0] == size else t)


def sample_shape(batch: Any, size: int) -> tuple:
    """Each tensor's shape past the batch dimension, and dtype."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    found: list = []
    apply_to_collection(batch, torch.Tensor, lambda t: found.append(
        (tuple(t.shape[1:]) if t.dim() > 0 and t.shape[0] == size else ("whole", *t.shape), str(t.dtype))))
    return tuple(found)


def alive_bytes(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """Memory alive now as the budget counts it: on CUDA all allocated; elsewhere the model's and optimizers' state."""
    device = model_device(model)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return model_state_bytes(model, optimizers)


def forward_working_bytes(model: nn.Module, step: Callable[[nn.Module], Any],
                          optimizers: list[torch.optim.Optimizer]) -> int:
    """The peak of ``step(model)`` without gradients above what was alive before it."""
    before = alive_bytes(model, optimizers)
    random_state = RandomState.capture(model_device(model))
    grads = {p: p.grad for p in model.parameters()}
    window = PeakWindow(model, optimizers)
    try:
        with torch.no_grad(), user_hooks_suspended(model):
            step(model)
    finally:
        peak = window.close()
        random_state.restore()
        for p, grad in grads.items():
            p.grad = grad
    return max(0, peak - before)


class LoopPeaks:
    """Predict each evaluation batch's peak; warn once per loop and shape when one is over the budget."""

    def __init__(self, step_for: Callable[[Any], Callable[[nn.Module], Any]], warn: Callable[[str], None]):
        self.step_for = step_for
        self.warn = warn
        self.fits: dict[tuple, ForwardFit | None] = {}
        self.predicted: dict[tuple, int] = {}  # (loop, shape, batch size) -> predicted peak
        self._warned: dict[tuple, int] = {}  # (loop, shape, batch size) -> the largest fitting batch named

    def check(self, loop: str, model: nn.Module, batch: Any, optimizers: list[torch.optim.Optimizer],
              budget_bytes: int) -> int | None:
        """The predicted peak of ``batch`` in ``loop`` (None when it cannot be predicted); warns if over."""
        size = batch_size_of(batch)
        if size is None:
            return None
        key = (loop, sample_shape(batch, size))
        if key not in self.fits:
            self.fits[key] = self._fit(model, batch, size, optimizers)
        fit = self.fits[key]
        if fit is None:
            return None
        alive = alive_bytes(model, optimizers)
        peak = fit.peak_at(size, alive)
        self.predicted[(*key, size)] = peak
        largest = fit.largest_batch(budget_bytes, alive) if peak > budget_bytes else None
        # Again if more is alive than when it was named (the sanity check runs before the optimizer state exists).
        if largest is not None and largest < self._warned.get((*key, size), largest + 1):
            self._warned[(*key, size)] = largest
            self.warn(f"AutoRemat: a {loop} batch of {size} is predicted to peak at {format_bytes(peak)}, over the budget "
                      f"of {format_bytes(budget_bytes)}: it saves nothing for backward, but its batch and the "
                      f"{format_bytes(alive)} alive when it starts (parameters, gradients, optimizer state) exceed it. "
                      + (f"The largest {loop} batch that fits is {largest}." if largest else
                         f"No {loop} batch fits: the memory alive when it starts leaves no room."))
        return peak

    def _fit(self, model: nn.Module, batch: Any, size: int, optimizers: list) -> ForwardFit | None:
        sizes = sorted({max(1, size // 4), max(1, size // 2)}) if size > 1 else [1]
        try:
            points = [(n, forward_working_bytes(model, self.step_for(slice_batch(batch, size, n)), optimizers))
                      for n in sizes]
        except Exception as error:  # noqa: BLE001 - a prediction that fails must not stop the loop
            self.warn(f"AutoRemat: could not predict the peak of this loop's batches ({type(error).__name__}: "
                      f"{str(error)[:200]}); they run unchecked.")
            return None
        return ForwardFit.through(points)
