"""A step's peak memory measured independently of the package's own meter, planning work included.

``torch.profiler`` (``profile_memory=True``) records every allocation and free of the process as
an event. A step's peak is the memory alive at its start (the model's parameters, buffers and
gradients, the optimizer's state: what MemTracker counts as alive) plus the largest running sum of
the allocation events inside it (positive and negative bytes, in time order). It sees whatever runs
inside the window, a real profiling pass of the package included, and it does not conflict with a
MemTracker the package opens (the profiler is not a dispatch mode).

Example (tests only):
    meter = StepPeak(model, optimizer)
    meter.start(); loss = step(model); loss.backward(); optimizer.step(); peak = meter.stop()
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def alive_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of the distinct storages of the model's parameters, buffers and gradients and of the
    optimizer's state tensors."""
    storages: dict[int, int] = {}

    def add(tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                add(value)
    return sum(storages.values())


def _allocations(node: Any, found: list) -> None:
    from torch._C._profiler import _EventType

    if node.tag == _EventType.Allocation:
        found.append(node)
    for child in node.children:
        _allocations(child, found)


def allocation_peak(prof: profile) -> int:
    """The largest running sum of the CPU allocation events a stopped profiler recorded (>= 0)."""
    found: list = []
    for root in prof.profiler.kineto_results.experimental_event_tree():
        _allocations(root, found)
    found.sort(key=lambda node: node.start_time_ns)
    running = peak = 0
    for node in found:
        if node.extra_fields.device.type == "cpu":
            running += node.extra_fields.alloc_size
            peak = max(peak, running)
    return peak


class StepPeak:
    """One window's peak: ``start()`` before the step, ``stop()`` after it (returns the peak)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = model, optimizer
        self.prof: profile | None = None
        self.alive = 0

    def start(self) -> None:
        self.alive = alive_bytes(self.model, self.optimizer)
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.start()

    def stop(self) -> int:
        assert self.prof is not None
        self.prof.stop()
        peak = self.alive + allocation_peak(self.prof)
        self.prof = None
        return peak


def lightning_step_peaks():
    """A Lightning callback recording ``StepPeak`` of every training batch (``peaks``), every loss
    (``losses``) and the gradients every optimizer step applies (``grads``); put it FIRST in the trainer's callbacks, so that its window opens before any
    other callback's ``on_train_batch_start`` (where planning runs) and closes after theirs."""
    import lightning.pytorch as L

    class StepPeaks(L.Callback):
        def __init__(self):
            self.peaks, self.losses, self.grads, self.meter = [], [], [], None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.meter = StepPeak(pl_module, trainer.optimizers[0] if trainer.optimizers else None)
            self.meter.start()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads.append([p.grad.clone() for p in pl_module.parameters()])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # Lightning calls this after the optimizer step (and its zero_grad).
            self.peaks.append(self.meter.stop())
            self.meter = None
            self.losses.append(float(outputs["loss"]))

    return StepPeaks()
