"""Measure a real training step: peak memory with torch's MemTracker, FLOPs with FlopCounterMode.

This is how tests, benchmarks and the callback check a plan against reality, and the convention
the budget is stated in on a CPU: tensors the step creates, plus the model's parameters, buffers,
gradients and the optimizer's state. Inputs created outside ``step`` are not counted.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .optimizers import optimizer_list
from .stance import eager_stance
from .tracking import PeakOnlyTracker, Tracker, snapshot_by_category
from ..installing.sac import register_attention_flops

# Attention FLOPs count on every SDPA backend (FlopCounterMode lacks the CPU kernel's formula).
register_attention_flops()

Step = Callable[[nn.Module], torch.Tensor]


@dataclass(frozen=True)
class StepMeasurement:
    """Peak bytes of one training step and its split at the moment of the peak.

    Example:
        >>> net = nn.Linear(8, 8)
        >>> m = measure_step(net, lambda model: model(torch.randn(4, 8)).sum())
        >>> m.peak_bytes >= m.parameter_bytes > 0
        True
    """

    peak_bytes: int
    parameter_bytes: int
    buffer_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    temporary_bytes: int
    loss: float


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU for an empty model."""
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that wall-clock timings mean something."""
    if device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            # The model's device, not the current one: they differ when a process drives several.
            backend.synchronize(device)


def measure_step(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None = None,
                 zero_grad: bool = True) -> StepMeasurement:
    """Run one real training step (zero_grad, forward, backward, optimizer step) under MemTracker.

    Args:
        model: the model, wrapped or not.
        step: ``step(model)`` runs the forward pass and returns the loss.
        optimizer: stepped after backward when given (its state counts in the peak).
        zero_grad: set gradients to None first, as Lightning and ``optimizer.zero_grad()`` do.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        >>> opt = torch.optim.Adam(net.parameters())
        >>> m = measure_step(net, lambda model: model(torch.randn(4, 8)).sum(), opt)
        >>> m.optimizer_bytes > 0
        True
    """
    device = model_device(model)
    if zero_grad:
        model.zero_grad(set_to_none=True)
    tracker = Tracker()
    tracker.track_external(model, *([optimizer] if optimizer is not None else []))
    with tracker, warnings.catch_warnings():
        # MemTracker warns when a module's backward hook outlives the module's outputs.
        warnings.filterwarnings("ignore", message="Module is None")
        loss = step(model)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        loss_value = float(loss.detach())
        del loss
    by_name = snapshot_by_category(tracker.get_tracker_snapshot("peak"), device)
    return StepMeasurement(
        peak_bytes=int(by_name.get("Total", 0)),
        parameter_bytes=int(by_name.get("Parameter", 0)),
        buffer_bytes=int(by_name.get("Buffer", 0)),
        gradient_bytes=int(by_name.get("Gradient", 0)),
        optimizer_bytes=int(by_name.get("Optstate", 0)),
        activation_bytes=int(by_name.get("Activation", 0)),
        temporary_bytes=int(by_name.get("Temp", 0) + by_name.get("Other", 0)),
        loss=loss_value,
    )


class PeakWindow:
    """Peak memory over a window opened in one hook and closed in a later one (a training step
    measured from inside Lightning or Accelerate), possibly across several forwards.

    On CUDA: ``torch.cuda.max_memory_allocated``. Elsewhere: torch's MemTracker counting the
    model's parameters, buffers and gradients, the optimizer's state and every tensor the window
    allocates (inputs made before the window are not counted), as ``measure_step`` does.

    Example:
        >>> net = nn.Linear(8, 8)
        >>> window = PeakWindow(net, None)
        >>> net(torch.randn(4, 8)).sum().backward()
        >>> window.close() >= 2 * (8 * 8 + 8) * 4
        True
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.device = model_device(model)
        self.tracker: Tracker | None = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.tracker = PeakOnlyTracker()
            self.tracker.track_external(model, *([optimizer] if optimizer is not None else []))
            self.tracker.__enter__()

    def peak(self) -> int:
        """The peak so far."""
        if self.tracker is None:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return snapshot_by_category(self.tracker.get_tracker_snapshot("peak"), self.device).get("Total", 0)

    def close(self) -> int:
        """Stop measuring; the peak of the window."""
        peak = self.peak()
        self.abandon()
        return peak

    def abandon(self) -> None:
        """Stop measuring without a result (the step failed)."""
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.__exit__(None, None, None)


def is_out_of_memory(exception: BaseException) -> bool:
    """Whether ``exception`` is a real out-of-memory error of some backend.

    Uses ``accelerate.utils.memory.should_reduce_batch_size`` (CUDA/ROCm/XPU " out of memory.",
    MPS, CPU "DefaultCPUAllocator: can't allocate memory", HPU, cuDNN's not-supported error) and
    also accepts ``torch.OutOfMemoryError`` and Python's ``MemoryError``.

    Example:
        >>> is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
        True
        >>> is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")), is_out_of_memory(ValueError("x"))
        (True, False)
    """
    if isinstance(exception, MemoryError):
        return True
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exception, oom_type):
        return True
    try:
        from accelerate.utils.memory import should_reduce_batch_size
    except ImportError:  # pragma: no cover - accelerate is a dependency
        should_reduce_batch_size = None
    if should_reduce_batch_size is not None and should_reduce_batch_size(exception):
        return True
    return isinstance(exception, RuntimeError) and bool(exception.args) and "out of memory" in str(exception.args[0])


def release_device_memory() -> None:
    """Collect garbage and return cached device memory (Accelerate's ``clear_device_cache``).

    Call it after the frames of a failed step are gone (``except`` blocks keep the traceback, and
    with it the step's tensors, alive until they end).

    Example:
        >>> release_device_memory()
    """
    from accelerate.utils.memory import clear_device_cache

    clear_device_cache(garbage_collection=True)


def count_step_flops(model: nn.Module, step: Step) -> int:
    """FLOPs of one forward and backward pass (recomputation included), counted exactly.

    Example:
        >>> count_step_flops(nn.Linear(8, 8, bias=False), lambda m: m(torch.randn(4, 8)).sum())
        1024
    """
    # Eagerly: dynamo would never compile code it first met under FlopCounterMode (see stance.py).
    with eager_stance(), FlopCounterMode(display=False) as counter:
        loss = step(model)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


@dataclass
class RandomState:
    """The random generators a step may draw from: torch's CPU one, the model's device's, Python's.

    Restored before each pass of a profile, so every pass takes the same random decisions (the
    same dropout masks, the same layers dropped by a layer-drop model) as the first.

    Example:
        >>> state = RandomState.capture(torch.device("cpu"))
        >>> first = torch.rand(1)
        >>> state.restore()
        >>> torch.equal(torch.rand(1), first)
        True
    """

    device: torch.device
    cpu: torch.Tensor
    accelerator: torch.Tensor | None
    python: Any

    @classmethod
    def capture(cls, device: torch.device) -> "RandomState":
        import random

        backend = getattr(torch, device.type, None) if device.type != "cpu" else None
        accelerator = None
        if backend is not None and hasattr(backend, "get_rng_state"):
            accelerator = backend.get_rng_state(device) if device.index is not None else backend.get_rng_state()
        return cls(device, torch.get_rng_state(), accelerator, random.getstate())

    def restore(self) -> None:
        import random

        torch.set_rng_state(self.cpu)
        if self.accelerator is not None:
            backend = getattr(torch, self.device.type)
            if self.device.index is not None:
                backend.set_rng_state(self.accelerator, self.device)
            else:
                backend.set_rng_state(self.accelerator)
        random.setstate(self.python)


@contextlib.contextmanager
def preserved_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Put back gradients, buffers and RNG states after trial steps (profiling, measurement).

    Example:
        >>> bn = nn.BatchNorm1d(3)
        >>> with preserved_training_state(bn):
        ...     _ = bn(torch.randn(4, 3))
        >>> int(bn.num_batches_tracked)
        0
    """
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
