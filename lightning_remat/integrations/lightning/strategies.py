"""The Lightning strategies ``AutoRemat`` plans under, and the ones it refuses (FSDP1, DeepSpeed: they hold
state where the profile cannot see it) or leaves alone with a warning (``unsupported``)."""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer

from ...service.sharded import FSDP1_HINT


def refuse_fsdp1(trainer: Trainer) -> None:
    """Lightning's FSDPStrategy (FSDP1): flat parameters the profile cannot see; an error naming the ways that work."""
    from lightning.pytorch.strategies import FSDPStrategy

    from ...core.errors import UnsupportedShardingError

    if isinstance(trainer.strategy, FSDPStrategy):
        raise UnsupportedShardingError(
            "AutoRemat does not support Lightning's FSDPStrategy (FSDP1): its flat parameters cannot be profiled. "
            "Use ModelParallelStrategy with fully_shard in configure_model (FSDP2), which AutoRemat plans on "
            "every rank, or call plan_remat and apply_plan on the model in configure_model before it is wrapped. "
            + FSDP1_HINT)


def refuse_deepspeed(trainer: Trainer) -> None:
    """DeepSpeed keeps its state in its own engine, which the profile cannot see: an error naming the ways that work."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from ...core.errors import UnsupportedSetupError

    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy) or any(c.__name__.startswith("DeepSpeed") for c in type(strategy).__mro__):
        raise UnsupportedSetupError(
            f"AutoRemat does not support Lightning's {type(strategy).__name__}: DeepSpeed's engine partitions and "
            "offloads parameters, gradients and optimizer state where the profile cannot see them, so the budget could "
            "not be kept. Use ModelParallelStrategy with fully_shard in configure_model (FSDP2) or DDPStrategy, which "
            "AutoRemat plans, or make a plan with lightning_remat.plan_remat on one device and apply it with "
            "apply_plan in configure_model, and remove AutoRemat from the callbacks.")


def unsupported(trainer: Trainer, pl_module: LightningModule) -> str | None:
    """Why ``AutoRemat`` leaves this run alone (a strategy it does not plan under), or None."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    strategy = trainer.strategy
    supported = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)
    if not isinstance(strategy, supported):
        return (f"the {type(strategy).__name__} strategy is not supported (single-device, DDP and "
                "ModelParallelStrategy (FSDP2) are)")
    return None

