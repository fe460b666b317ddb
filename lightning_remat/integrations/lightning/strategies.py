"""The strategies ``AutoRemat`` plans under, refuses or leaves alone, and what the Trainer adds to a step."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

from ...core.allowances import LIGHTNING_LOOP_ALLOWANCE
from ...core.errors import UnsupportedSetupError, UnsupportedShardingError
from ...service.planning import FSDP1_HINT


def unsupported(trainer: Trainer) -> str | None:
    """Why ``AutoRemat`` leaves this run alone (a strategy it does not plan under), or None; raises for FSDP1 (its
    flat parameters cannot be profiled) and DeepSpeed (its engine holds state the profile cannot see)."""
    from lightning.pytorch.strategies import (DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy,
                                              SingleDeviceStrategy)

    strategy = trainer.strategy
    if isinstance(strategy, FSDPStrategy):
        raise UnsupportedShardingError(
            "AutoRemat does not support Lightning's FSDPStrategy (FSDP1): its flat parameters cannot be profiled. "
            "Use ModelParallelStrategy with fully_shard in configure_model (FSDP2), which AutoRemat plans on "
            "every rank, or call plan_remat and apply_plan on the model in configure_model before it is wrapped. "
            + FSDP1_HINT)
    # Before DDP: DeepSpeedStrategy is one.
    if isinstance(strategy, DeepSpeedStrategy) or any(c.__name__.startswith("DeepSpeed") for c in type(strategy).__mro__):
        raise UnsupportedSetupError(
            f"AutoRemat does not support Lightning's {type(strategy).__name__}: DeepSpeed's engine partitions and "
            "offloads parameters, gradients and optimizer state where the profile cannot see them, so the budget could "
            "not be kept. Use ModelParallelStrategy with fully_shard in configure_model (FSDP2) or DDPStrategy, which "
            "AutoRemat plans, or make a plan with lightning_remat.plan_remat on one device and apply it with "
            "apply_plan in configure_model, and remove AutoRemat from the callbacks.")
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)):
        return (f"the {type(strategy).__name__} strategy is not supported (single-device, DDP and "
                "ModelParallelStrategy (FSDP2) are)")
    return None


def loop_allowance(profile: Any) -> Any:
    """The profile with the scalars Lightning's loop keeps alive through a step (``core.allowances``)."""
    from ...runtime.profiling.profile_adjust import with_always_alive

    return with_always_alive(profile, LIGHTNING_LOOP_ALLOWANCE, f"an allowance of {LIGHTNING_LOOP_ALLOWANCE} bytes for "
                             "the scalars Lightning's loop keeps alive through a step; counted in every term")

