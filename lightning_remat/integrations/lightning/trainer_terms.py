"""What a Lightning ``Trainer`` adds to a step's memory for ``AutoRemat``: loop scalars, accumulation, DDP."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lightning.pytorch import Trainer

from ...core.allowances import LIGHTNING_LOOP_ALLOWANCE
from ...core.config import RematConfig

LOOP_ALLOWANCE = LIGHTNING_LOOP_ALLOWANCE


def loop_allowance(profile: Any) -> Any:
    """The profile with the scalars Lightning's loop keeps alive through a step (``core.allowances``)."""
    from ...runtime.profiling.profile_adjust import with_always_alive

    return with_always_alive(profile, LOOP_ALLOWANCE, f"an allowance of {LOOP_ALLOWANCE} bytes for the scalars "
                             "Lightning's loop keeps alive through a step; counted in every term")


def config_for(config: RematConfig, trainer: Trainer) -> RematConfig:
    """``config`` with what ``trainer`` adds: gradient accumulation and DDP's gradient buckets."""
    from lightning.pytorch.strategies import DDPStrategy

    return replace(config, profile=replace(
        config.profile, accumulation_steps=max(1, trainer.accumulate_grad_batches),
        gradient_buckets=isinstance(trainer.strategy, DDPStrategy) and trainer.world_size > 1))
