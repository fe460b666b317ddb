"""How many GPUs a sharded (FSDP2) plan's budget needs; its figures are per GPU (that rank's shards)."""

from __future__ import annotations

import math
from typing import Any

# The per-GPU split is part of how a plan is written (``core.plan_text``), which needs nothing above it.
from .plan_text import per_gpu_breakdown

__all__ = ["per_gpu_breakdown", "smallest_world_size", "solve_sharded"]


def smallest_world_size(least_peak: int, sharded_static: int, world_size: int, budget: int) -> int | None:
    """The least world size at which the least peak fits ``budget``, or None (only ``sharded_static`` shrinks)."""
    rest = least_peak - sharded_static
    room = budget - rest
    if room <= 0:
        return None
    return max(world_size, math.ceil(sharded_static * world_size / room))


def solve_sharded(profile: Any, budget: int | str, cost: str) -> Any:
    """``solve``, raising ``ShardedBudgetTooSmallError`` (naming a world size) on a sharded profile."""
    from .errors import BudgetTooSmallError, ShardedBudgetTooSmallError
    from .solve import solve

    try:
        return solve(profile, budget, cost=cost)
    except BudgetTooSmallError as error:
        world_size = int((profile.sharding or {}).get("world_size", 1))
        if world_size <= 1 or not isinstance(error.budget_bytes, int):
            raise
        sharded = profile.parameter_bytes + profile.gradient_bytes + profile.optimizer_state_bytes
        # Only parameters and optimizer state surely shrink (gradients may not exist yet): errs towards more GPUs.
        shrinking = profile.parameter_bytes + profile.optimizer_state_bytes
        raise ShardedBudgetTooSmallError(
            error.budget_bytes, error.smallest_peak_bytes, sharded, world_size,
            smallest_world_size(error.smallest_peak_bytes, shrinking, world_size, error.budget_bytes)) from None
