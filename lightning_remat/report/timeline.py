"""How the memory of a training step moves: the total after every operator of one forward and backward."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from ..core.plan import Plan, StageAction
from ..runtime.installing.apply import applied, recomputation_of
from ..runtime.measuring.measure import model_device, preserved_training_state
from ..runtime.measuring.runner import Step, Tracking, run_step
from ..runtime.profiling.optimizer_step import optimizer_step_cost
from ..runtime.measuring.tracking import TimelineTracker
from ..runtime.measuring.user_hooks import user_hooks_suspended


@dataclass
class MemoryTimeline:
    """Total memory after each operator of one forward and backward pass (optimizer state included)."""

    label: str
    bytes_after_op: list[int]
    backward_start: int | None = None

    @property
    def peak_bytes(self) -> int:
        return max(self.bytes_after_op, default=0)

    def to_dict(self) -> dict[str, Any]:
        """A short JSON-safe summary (the per-operator series is left out)."""
        return {"label": self.label, "ops": len(self.bytes_after_op), "backward_start": self.backward_start,
                "peak_bytes": self.peak_bytes}


def tracked_step(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None,
                  plan: Plan) -> TimelineTracker:
    """One forward and backward pass under the timeline tracker with ``plan`` applied; the model left as it was."""
    device = model_device(model)
    tracker = TimelineTracker(device)
    with preserved_training_state(model, optimizer), applied(model, plan), \
            user_hooks_suspended(model), warnings.catch_warnings():
        # MemTracker warns when a module's backward hook outlives the module's outputs.
        warnings.simplefilter("ignore")
        # The optimizer is tracked (its state is part of the step's memory), not stepped.
        run_step(model, step, watch=Tracking(tracker, model, optimizer), zero_grad="before")
    return tracker


def memory_timeline(model: nn.Module, step: Step, plan: Plan | Iterable[str] | None = None, *,
                    optimizer: torch.optim.Optimizer | None = None, label: str | None = None) -> MemoryTimeline:
    """Record the total memory after every operator of one forward and backward pass, the model left as it was.

    ``plan``: a ``Plan`` or module names to recompute (None: nothing).
    """
    plan = recomputation_of(plan) if isinstance(plan, Plan) else Plan([StageAction.recompute(n) for n in plan or []])
    names = plan.checkpointed
    tracker = tracked_step(model, step, optimizer, plan)
    # The state the optimizer will create at its first step (none once it stepped).
    offset = optimizer_step_cost(optimizer).state_bytes if optimizer is not None and not optimizer.state else 0
    backward_start = next((i for i, bw in enumerate(tracker.in_backward) if bw), None)
    if label is None:
        label = f"recompute {len(names)} module(s)" if names else "no recomputation"
    return MemoryTimeline(label, [t + offset for t in tracker.totals], backward_start)
