"""Measure a real training step: its peak with the one peak meter (``meter.PeakMeter``), FLOPs counted."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .exclusive import exclusive
from .optimizers import optimizer_list
from .meter import PeakMeter, PeakWindow
from .runner import Step, model_device, run_step, synchronize
from .tracking import Tracker, eager_stance
from .user_hooks import user_hooks_suspended
from ..installing import sac  # noqa: F401 - its import registers attention FLOPs on every SDPA backend

__all__ = ["PeakWindow", "RandomState", "Step", "StepMeasurement", "count_step_flops", "is_out_of_memory",
           "measure_step", "model_device", "preserved_training_state", "release_device_memory", "synchronize"]


@dataclass(frozen=True)
class StepMeasurement:
    """Peak bytes of one training step and its split by category at the peak (``reserved_bytes`` on CUDA)."""

    peak_bytes: int
    parameter_bytes: int
    buffer_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    temporary_bytes: int
    loss: float
    reserved_bytes: int | None = None


@exclusive()
def measure_step(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None = None,
                 zero_grad: bool = True) -> StepMeasurement:
    """Run one real training step (zero_grad, forward, backward, optimizer step) under the peak meter.

    >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    >>> opt = torch.optim.Adam(net.parameters())
    >>> m = measure_step(net, lambda model: model(torch.randn(4, 8)).sum(), opt)
    >>> m.optimizer_bytes > 0
    True
    """
    meter = PeakMeter(model, optimizer, tracker=Tracker())
    loss = run_step(model, step, optimizer, watch=meter, zero_grad="before" if zero_grad else None, read_loss=True)
    by_name = meter.by_category()
    return StepMeasurement(
        peak_bytes=meter.peak_bytes,
        parameter_bytes=int(by_name.get("Parameter", 0)),
        buffer_bytes=int(by_name.get("Buffer", 0)),
        gradient_bytes=int(by_name.get("Gradient", 0)),
        optimizer_bytes=int(by_name.get("Optstate", 0)),
        activation_bytes=int(by_name.get("Activation", 0)),
        temporary_bytes=int(by_name.get("Temp", 0) + by_name.get("Other", 0)),
        loss=float(loss if loss is not None else 0.0),
        reserved_bytes=meter.reserved_bytes,
    )


def is_out_of_memory(exception: BaseException) -> bool:
    """Whether ``exception`` is a real out-of-memory error of some backend (as Accelerate recognises them)."""
    from accelerate.utils.memory import should_reduce_batch_size

    if isinstance(exception, (MemoryError, torch.OutOfMemoryError)) or should_reduce_batch_size(exception):
        return True
    return isinstance(exception, RuntimeError) and bool(exception.args) and "out of memory" in str(exception.args[0])


def release_device_memory() -> None:
    """Collect garbage and return cached device memory (after a failed step's ``except`` block has ended)."""
    from accelerate.utils.memory import clear_device_cache

    clear_device_cache(garbage_collection=True)


def count_step_flops(model: nn.Module, step: Step) -> int:
    """FLOPs of one forward and backward pass (recomputation included), counted exactly; eagerly, as dynamo never
    compiles code first met under FlopCounterMode."""
    with user_hooks_suspended(model), eager_stance(), FlopCounterMode(display=False) as counter:
        run_step(model, step)
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


@dataclass
class RandomState:
    """The random generators a step may draw from, restored before each profile pass so dropout replays."""

    device: torch.device
    cpu: torch.Tensor
    accelerator: torch.Tensor | None
    python: Any

    @classmethod
    def capture(cls, device: torch.device) -> "RandomState":
        backend = getattr(torch, device.type, None) if device.type != "cpu" else None
        # The device's own generator (a device without index: the current one's).
        accelerator = backend.get_rng_state(device) if hasattr(backend, "get_rng_state") else None
        return cls(device, torch.get_rng_state(), accelerator, random.getstate())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.accelerator is not None:
            getattr(torch, self.device.type).set_rng_state(self.accelerator, self.device)
        random.setstate(self.python)


@contextlib.contextmanager
def preserved_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Put back gradients, buffers and RNG states after trial steps (profiling, measurement)."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    random_state = RandomState.capture(model_device(model))
    optimizers = optimizer_list(optimizer)  # one, several, or none
    state_keys = [set(o.state.keys()) for o in optimizers]
    try:
        yield
    finally:
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            current = dict(model.named_buffers())
            for name, value in buffers.items():
                if name in current:
                    current[name].copy_(value)
        random_state.restore()
        for o, keys in zip(optimizers, state_keys):
            for key in set(o.state.keys()) - keys:
                del o.state[key]
