"""Planning an FSDP2 model: every rank profiles in lockstep, rank 0 solves on the largest term of each.

>>> fsdp2_sharded(nn.Linear(2, 2))
False
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..core.errors import UnsupportedShardingError
from ..core.memory_model import Profile
from ..core.plan import Plan
from ..core.profile_algebra import combine, largest
from ..runtime.measuring.measure import Step
from .channel import Channel

FSDP1_HINT = ("Use FSDP2 instead (torch.distributed.fsdp.fully_shard; in Lightning ModelParallelStrategy with "
              "fully_shard in configure_model; in Accelerate FullyShardedDataParallelPlugin(fsdp_version=2)), "
              "or call plan_remat and apply_plan on the model before it is wrapped, on every rank.")


def fsdp2_sharded(model: nn.Module) -> bool:
    """Whether ``model`` or one of its modules is sharded with FSDP2's ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def refuse_fsdp1(model: nn.Module, where: str) -> None:
    """Raise ``UnsupportedShardingError`` if ``model`` is wrapped by FSDP1."""
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        raise UnsupportedShardingError(f"{where}: the model is wrapped by FSDP1 (FullyShardedDataParallel), whose "
                                       "flat parameters and forward cannot be profiled or wrapped. " + FSDP1_HINT)


def merge_profiles(profiles: list[Profile]) -> Profile:
    """One profile whose every numeric term is the largest of the ranks', so a plan within budget fits every rank."""
    first = profiles[0]
    shape = [(s.name, [o.name for o in s.options]) for s in first.stages]
    for other in profiles[1:]:
        if [(s.name, [o.name for o in s.options]) for s in other.stages] != shape:
            raise UnsupportedShardingError(
                "the ranks profiled different stages or options (different control flow, or batches of different "
                "shapes): give every rank a batch of the same shape while planning, or pass candidates=")
    merged = combine(profiles, largest)
    if len(profiles) > 1:
        merged = replace(merged, notes=(*first.notes, f"profiled on each of {len(profiles)} ranks in lockstep (the model is sharded); "
                        "every term is the largest over the ranks, so the budget is per rank"))
    return merged


def lockstep_plan(planner: Any, model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None, *,
                  channel: Channel, hint: str = "", fallback: bool = True, **kwargs: Any) -> Plan:
    """Profile on every rank, solve on rank 0 over the termwise maximum, return its plan (or error) on all; with
    ``fallback``, an out-of-memory error on some rank gives every rank the recompute-everything plan.

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
        failed = next((error for _, error in results if error is not None), None)  # the first rank's
        # ``travelling`` marks an out-of-memory error of a rank.
        if failed is not None and fallback and any(getattr(error, "out_of_memory", False) for _, error in results):
            return planner.fallback_plan(model, str(failed)).to_dict()
        if failed is not None:
            raise failed
        return planner.solve_profile(model, merge_profiles([profile for profile, _ in results])).to_dict()

    return Plan.from_dict(channel.from_main(decide, action="planning", hint=hint))
