"""The optimizer's step, measured without running it: the state it creates and the temporaries it needs.

The step runs under ``FakeTensorMode`` on fake copies of the parameters, gradients and state, so
nothing real is allocated or changed, and whatever the optimizer's implementation (for-loop,
foreach, fused) allocates is counted.

Example:
    >>> import torch
    >>> net = torch.nn.Linear(64, 64)
    >>> cost = optimizer_step_cost(torch.optim.Adam(net.parameters()))
    >>> cost.state_bytes >= 2 * (64 * 64 + 64) * 4, cost.step_peak_bytes >= cost.state_bytes  # exp_avg, exp_avg_sq, step
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from .fake import clone_optimizer, fake_like, new_fake_mode


@dataclass(frozen=True)
class OptimizerStepCost:
    """State bytes the optimizer holds after a step; peak bytes of its step beyond parameters and gradients."""

    state_bytes: int = 0
    step_peak_bytes: int = 0


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and id(v) not in seen:
                seen.add(id(v))
                total += v.untyped_storage().nbytes()
    return total


def optimizer_step_cost(optimizer: torch.optim.Optimizer | None) -> OptimizerStepCost:
    """Run ``optimizer``'s step on fake copies and count what it allocates."""
    if optimizer is None:
        return OptimizerStepCost()
    mode = new_fake_mode()
    fakes: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in fakes:
                copy = nn.Parameter(fake_like(mode, p), requires_grad=p.requires_grad)
                if p.requires_grad:
                    copy.grad = fake_like(mode, p)
                fakes[id(p)] = copy
    clone = clone_optimizer(optimizer, fakes, mode)
    tracker = MemTracker()
    # Parameters and gradients are tracked up front so that only the state and the step's own
    # temporaries land in the optimizer category.
    tracker.track_external(*fakes.values(), *[f.grad for f in fakes.values() if f.grad is not None], clone)
    with mode, tracker:
        clone.step()
    step_peak = 0
    for snapshot in tracker.get_tracker_snapshot("peak").values():
        step_peak += sum(v for k, v in snapshot.items() if getattr(k, "value", k) == "Optstate")
    state = _state_bytes(clone)
    return OptimizerStepCost(state, max(step_peak, state))
