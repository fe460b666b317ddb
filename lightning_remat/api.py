"""``plan_remat``: profile and solve in one call."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .budget import parse_budget
from .candidates import CandidateSpec
from .measure import model_device
from .memory_model import check_cost_kind
from .plan import Plan
from .profile import profile_step
from .solve import solve


def plan_remat(model: nn.Module, step: Callable[[nn.Module], torch.Tensor], budget: int | str, *,
               optimizer: torch.optim.Optimizer | None = None, cost: str = "time",
               candidates: CandidateSpec = None, warmup: int = 1) -> Plan:
    """Profile one training step and return the least-cost recompute plan within ``budget``.

    Args:
        model: the model, in training mode.
        step: ``step(model)`` returns the loss of a forward pass on a representative batch.
        budget: as ``parse_budget``: "10GB", "10 GiB", bytes, "80%" of the device, or "min".
        optimizer: counted in the budget (its state and its step).
        cost: ``"time"`` (measured seconds) or ``"flops"`` (counted FLOPs: deterministic plans).
        candidates: None for automatic stages, or module classes / name patterns.
        warmup: unmeasured steps first.

    The budget is checked before any profiling, so a malformed budget fails at once.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
        >>> x = torch.randn(32, 64)
        >>> plan = plan_remat(net, lambda m: m(x).square().mean(), "min", cost="flops")
        >>> plan.predicted_peak_bytes < plan.baseline_peak_bytes
        True
        >>> _ = apply_plan(net, plan)  # doctest: +SKIP
    """
    parsed = parse_budget(budget, device=model_device(model))
    check_cost_kind(cost)
    profile = profile_step(model, step, optimizer=optimizer, warmup=warmup, candidates=candidates)
    plan = solve(profile, parsed, cost=cost)
    plan.requested_budget = str(budget)
    return plan
