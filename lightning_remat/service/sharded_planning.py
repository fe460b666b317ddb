"""Every rank profiles, rank 0 solves on the largest term over the ranks, every rank gets its plan:
``Planner.shared_plan`` with a ``gather``, for a model sharded with FSDP2 (see ``sharded``).

Example:
    >>> _first_error([(None, None), (None, ValueError("x"))]).args
    ('x',)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..core.errors import PlanningFailedError, RematError, UnsupportedShardingError
from ..core.plan import Plan
from ..runtime.measuring.measure import Step, is_out_of_memory
from .sharded import merge_profiles

if TYPE_CHECKING:  # pragma: no cover
    from .planning import Broadcast, Planner


def _first_error(results: list[tuple[Any, BaseException | None]]) -> BaseException | None:
    return next((error for _, error in results if error is not None), None)


def _travelling(error: BaseException, rank: int) -> BaseException:
    """An error as it can travel to the other ranks (ours as itself, any other as its type and message)."""
    if isinstance(error, RematError) or is_out_of_memory(error):
        return error if isinstance(error, RematError) else PlanningFailedError(f"out of memory on rank {rank}: {error}")
    return PlanningFailedError(f"profiling failed on rank {rank}: {type(error).__name__}: {error}")


def lockstep_plan(planner: "Planner", model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None, *,
                  is_main: bool, broadcast: "Broadcast", gather: Callable[[Any], list], hint: str = "",
                  fallback: bool = True, **kwargs: Any) -> Plan:
    """Profile on this rank (every rank calls it, in the same order), gather the profiles, solve
    on rank 0 over their termwise maximum, and return rank 0's plan (or raise its error) on every rank.

    An error on one rank while profiling reaches every rank once all have finished profiling (a
    rank that fails inside a collective leaves the others waiting in it: torch.distributed's timeout
    ends them). With ``fallback``, an out-of-memory error on some rank gives every rank the
    recompute-everything plan.
    """
    from .planning import PlanOutcome

    if planner.config.profile.fake:
        # Decided alike on every rank, before any collective.
        raise UnsupportedShardingError(
            "fake profiling of a model already sharded across processes is not supported: profile it for real "
            "(fake=False), or plan the unsharded model in one process with fake=True and world_size=N "
            "(docs/sharded.md)")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    profile, error, oom = None, None, False
    try:
        profile = planner.profile(model, step, optimizer, **kwargs)
    except Exception as caught:  # noqa: BLE001 - every rank raises rank 0's verdict, below
        oom = is_out_of_memory(caught)
        error = _travelling(caught, rank)
    results = gather((profile, error, oom))
    outcome = PlanOutcome()
    if is_main:
        try:
            failed = _first_error([(p, e) for p, e, _ in results])
            if failed is not None and fallback and any(o for _, _, o in results):
                outcome = PlanOutcome(plan=planner.fallback_plan(model, str(failed)).to_dict())
            elif failed is not None:
                raise failed
            else:
                outcome = PlanOutcome(plan=planner.solve_profile(model, merge_profiles([p for p, _, _ in results])).to_dict())
        except Exception as caught:  # noqa: BLE001 - every rank raises it, below
            if isinstance(caught, RematError) and hint:
                caught.add_hint(hint)
            outcome = PlanOutcome.failed(caught)
    return broadcast(outcome).result()
