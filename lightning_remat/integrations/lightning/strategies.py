"""The Lightning strategies ``AutoRemat`` plans under, and the ones it refuses or leaves alone.

FSDP1 and DeepSpeed hold parameters, gradients and optimizer state where the profile cannot see
them: ``setup`` raises an error naming the ways that work, rather than train without the budget.
Other strategies are left alone with a warning (``unsupported``). A model that checkpoints already
is taken over (``take_over``).
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer

from ...runtime.installing.takeover import take_over_checkpointing
from ...service.sharded import FSDP1_HINT


def refuse_fsdp1(trainer: Trainer) -> None:
    """Lightning's FSDPStrategy (FSDP1) wraps the model in flat parameters the profile cannot see:
    an error naming the ways that work, rather than a run without the budget."""
    from lightning.pytorch.strategies import FSDPStrategy

    from ...core.errors import UnsupportedShardingError

    if isinstance(trainer.strategy, FSDPStrategy):
        raise UnsupportedShardingError(
            "AutoRemat does not support Lightning's FSDPStrategy (FSDP1): its flat parameters cannot be profiled. "
            "Use ModelParallelStrategy with fully_shard in configure_model (FSDP2), which AutoRemat plans on "
            "every rank, or call plan_remat and apply_plan on the model in configure_model before it is wrapped. "
            + FSDP1_HINT)


def refuse_deepspeed(trainer: Trainer) -> None:
    """DeepSpeed partitions and offloads parameters, gradients and optimizer state in its own engine,
    which the profile cannot see: an error naming the ways that work, as Accelerate's refusal does,
    rather than a run without the budget."""
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


def take_over(pl_module: LightningModule) -> None:
    """The user gave ``AutoRemat`` a budget: Hugging Face's own gradient checkpointing is turned off (one
    warning says so) and the plan recomputes instead; a torch ``checkpoint_wrapper`` (which cannot be taken
    off without renaming parameters) is refused before training (``AlreadyCheckpointedError``)."""
    from lightning.pytorch.utilities import rank_zero_warn

    took_over = take_over_checkpointing(pl_module, "AutoRemat")
    if took_over:
        rank_zero_warn(took_over)
