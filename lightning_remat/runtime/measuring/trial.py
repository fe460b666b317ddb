"""Real trial steps at a batch size with a plan applied; everything is put back, and an OOM fails the trial."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from ...core.plan import Plan
from ..installing.apply import applied
from .exclusive import exclusive
from .measure import Step, is_out_of_memory, measure_step, preserved_training_state, release_device_memory
from .user_hooks import user_hooks_suspended


@dataclass(frozen=True)
class Trial:
    """One real trial: ``steps`` training steps at ``batch_size`` with ``checkpointed`` modules recomputed."""

    batch_size: int
    checkpointed: tuple[str, ...]
    steps: int
    measured_peak_bytes: int | None
    out_of_memory: bool
    fits: bool
    predicted_peak_bytes: int = 0


@contextlib.contextmanager
def _restored_after_trial(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Put back everything after real trial steps; copies on the CPU so an accelerator holds no second copy."""
    parameters = [(p, p.detach().to("cpu", copy=True)) for p in model.parameters()]
    optimizer_state = None if optimizer is None else torch.utils._pytree.tree_map(
        lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else copy.deepcopy(t),
        optimizer.state_dict())
    with preserved_training_state(model, optimizer):
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in parameters:
                    p.copy_(saved)
            if optimizer is not None:
                optimizer.load_state_dict(optimizer_state)
                if not optimizer_state["state"]:
                    optimizer.state.clear()


def _create_optimizer_state(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer) -> int:
    """Make ``optimizer`` create its state; returns the real training steps that took (0 or 1)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        return 0
    except TypeError:  # an optimizer that needs a closure (LBFGS): one real step instead
        measure_step(model, step, optimizer)
        return 1
    finally:
        for p in params:
            p.grad = None


@exclusive()
def run_trial(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None, batch_size: int,
               plan: Plan, steps_per_trial: int, budget: int, predicted: int) -> Trial:
    """Real steps at ``batch_size`` under ``plan``, put back after; fits: no out-of-memory, peak within ``budget``."""
    steps = 0
    peaks: list[int] = []
    oom = False
    try:
        with _restored_after_trial(model, optimizer), applied(model, plan), user_hooks_suspended(model):
            if optimizer is not None and not optimizer.state:
                # Steady steps hold the optimizer's state: made by a step on zero gradients (put back afterwards).
                steps += _create_optimizer_state(model, step, optimizer)
            for _ in range(steps_per_trial):
                steps += 1
                peaks.append(measure_step(model, step, optimizer).peak_bytes)
    except Exception as exception:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
        if not is_out_of_memory(exception):
            raise
        oom = True
    # After the except block, so a traceback no longer pins a failed step's tensors.
    release_device_memory()
    peak = max(peaks) if peaks else None
    fits = not oom and peak is not None and peak <= budget
    return Trial(batch_size, tuple(plan.checkpointed), steps, peak, oom, fits, predicted)
