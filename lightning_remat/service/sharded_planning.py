"""``Planner.shared_plan`` for an FSDP2 model: every rank profiles, rank 0 solves on the largest terms."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.errors import UnsupportedShardingError
from ..core.plan import Plan
from ..runtime.measuring.measure import Step
from .channel import Channel, failed_out_of_memory, first_error
from .sharded import merge_profiles


def lockstep_plan(planner: Any, model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None, *,
                  channel: Channel, hint: str = "", fallback: bool = True, **kwargs: Any) -> Plan:
    """Profile on every rank, solve on rank 0 over the termwise maximum, return rank 0's plan (or error) on all
    (``planner``: a ``planning.Planner``, its ``profile``, ``solve_profile`` and ``fallback_plan``).

    With ``fallback``, an out-of-memory error on some rank gives every rank the recompute-everything plan.

    Example:
        >>> from lightning_remat.service.planning import Planner, RematConfig, ProfileOptions
        >>> planner = Planner(RematConfig("min", profile=ProfileOptions(fake=True)))
        >>> lockstep_plan(planner, nn.Linear(2, 2), lambda m: m(torch.ones(1, 2)).sum(), None, channel=Channel())
        Traceback (most recent call last):
        ...
        lightning_remat.core.errors.UnsupportedShardingError: fake profiling of a model already sharded across processes is not supported: ...
    """
    if planner.config.profile.fake:
        # Decided alike on every rank, before any collective.
        raise UnsupportedShardingError(
            "fake profiling of a model already sharded across processes is not supported: profile it for real "
            "(fake=False), or plan the unsharded model in one process with fake=True and world_size=N "
            "(docs/sharded.md)")
    results = channel.outcomes(lambda: planner.profile(model, step, optimizer, **kwargs), action="profiling")

    def decide() -> dict:
        failed = first_error(results)
        if failed is not None and fallback and any(failed_out_of_memory(error) for _, error in results):
            return planner.fallback_plan(model, str(failed)).to_dict()
        if failed is not None:
            raise failed
        return planner.solve_profile(model, merge_profiles([profile for profile, _ in results])).to_dict()

    return Plan.from_dict(channel.from_main(decide, action="planning", hint=hint))
