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
               candidates: CandidateSpec = None, warmup: int = 1, fake: bool = False,
               dtype: torch.dtype | None = None, device: str | torch.device | None = None, gpu: str | None = None,
               device_memory: int | str | None = None) -> Plan:
    """Profile one training step and return the least-cost recompute plan within ``budget``.

    Args:
        model: the model, in training mode.
        step: ``step(model)`` returns the loss of a forward pass on a representative batch.
        budget: as ``parse_budget``: "10GB", "10 GiB", bytes, "80%" of the device, or "min".
        optimizer: counted in the budget (its state and its step).
        cost: ``"time"`` (measured seconds) or ``"flops"`` (counted FLOPs: deterministic plans).
        candidates: None for automatic stages, or module classes / name patterns.
        warmup: unmeasured steps first.
        fake, dtype, device, gpu: plan without the hardware, as ``profile_step``: profile on fake
            tensors in ``dtype`` for ``device`` (e.g. ``"cuda"``), pricing FLOPs with ``gpu``'s speed.
        device_memory: the target device's total memory ("80GB") when it is not this machine's;
            percentages refer to it and a budget above it is an error.

    The budget is checked before any profiling, so a malformed budget fails at once.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)])
        >>> x = torch.randn(256, 64)
        >>> plan = plan_remat(net, lambda m: m(x).square().mean(), "min", cost="flops")
        >>> plan.predicted_peak_bytes < plan.baseline_peak_bytes
        True
        >>> from lightning_remat import apply_plan
        >>> apply_plan(net, plan) is net
        True
    """
    parsed = parse_budget(budget, device=device or model_device(model), total_memory=device_memory)
    check_cost_kind(cost)
    if fake and cost == "time" and gpu is None:
        raise ValueError("a fake profile has no timings: pass cost='flops', or gpu= to price FLOPs in seconds")
    profile = profile_step(model, step, optimizer=optimizer, warmup=warmup, candidates=candidates,
                           fake=fake, dtype=dtype, device=device, gpu=gpu)
    plan = solve(profile, parsed, cost=cost)
    plan.requested_budget = str(budget)
    return plan
