"""``RematAccelerator`` and ``prepare_remat``: recomputation in an Accelerate loop (docs/accelerate.md)."""

from __future__ import annotations

import sys
import warnings
from dataclasses import fields
from typing import Any

import torch  # noqa: F401 - the doctests use it
from accelerate import Accelerator
from torch import nn

from ...core.errors import (AlreadyCheckpointedError, ConflictingArgumentsError, UnsupportedSetupError,
                            UnsupportedShardingError)
from ...core.plan import Plan
from ...runtime.installing.takeover import take_over_checkpointing
from ...runtime.profiling.candidates import find_stages
from .plugin import ENV_BUDGET, LoopFacts, RematPlugin
from .session import RematSession, SessionHook

_UNSUPPORTED = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")

FSDP2_TAKE_OVER = ("RematAccelerator turned off Accelerate's FSDP2 activation checkpointing (activation_checkpointing=True, "
                   "FSDP_ACTIVATION_CHECKPOINTING: every block recomputed) and plans recomputation within its budget "
                   "instead")


def _check_supported(accelerator: Any, take_over: bool = False) -> None:
    """Refuse what the session cannot plan under; ``take_over``: before prepare, FSDP2's checkpointing goes instead."""
    state = getattr(accelerator, "state", accelerator)
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper()
    if kind == "FSDP" and getattr(accelerator, "is_fsdp2", False):
        # FSDP2's own checkpointing wraps every block at prepare: switched off before, refused after.
        plugin = getattr(state, "fsdp_plugin", None)
        if getattr(plugin, "activation_checkpointing", False) and take_over:
            plugin.activation_checkpointing = False
            if state.is_main_process:
                warnings.warn(FSDP2_TAKE_OVER, UserWarning, stacklevel=3)
        elif getattr(plugin, "activation_checkpointing", False):
            raise AlreadyCheckpointedError(
                f"lightning-remat ({ENV_BUDGET} / RematPlugin.budget is set): Accelerate's FSDP plugin recomputes "
                "every block already (activation_checkpointing=True, FSDP_ACTIVATION_CHECKPOINTING); turn it off to "
                f"let lightning-remat choose, or unset {ENV_BUDGET}")
        return
    if kind == "FSDP":
        raise UnsupportedShardingError(
            "lightning-remat does not support Accelerate's FSDP1 (fsdp_version=1): its flat parameters cannot be "
            "profiled. Use FullyShardedDataParallelPlugin(fsdp_version=2), or make a plan with "
            "lightning_remat.plan_remat and apply it with apply_plan before accelerator.prepare, and unset "
            f"{ENV_BUDGET}.")
    if kind == "DEEPSPEED":
        plugin = getattr(state, "deepspeed_plugin", None)
        if getattr(plugin, "zero_stage", None) not in (2, 3) or _offloaded(plugin):
            raise UnsupportedSetupError(deepspeed_refusal(plugin))
        return
    if kind in _UNSUPPORTED:
        raise UnsupportedSetupError(
            f"lightning-remat does not support Accelerate's {kind} mode: a plan is made by profiling the whole "
            "unsharded model on one device. Use one process or DDP, or make a plan with lightning_remat.plan_remat "
            f"on one device, apply it with apply_plan before accelerator.prepare, and unset {ENV_BUDGET}."
        )
    dynamo = getattr(getattr(state, "dynamo_plugin", None), "backend", None)
    if dynamo is not None and str(getattr(dynamo, "value", dynamo)).upper() != "NO":
        raise UnsupportedSetupError("lightning-remat does not support torch.compile through Accelerate (dynamo_backend); "
                                  f"unset {ENV_BUDGET} or the dynamo backend")


def _offloaded(plugin: Any) -> bool:
    """Whether DeepSpeed offloads the optimizer or the parameters (not planned: another device holds them)."""
    zero = (getattr(plugin, "deepspeed_config", None) or {}).get("zero_optimization", {}) or {}
    return any(str((zero.get(key) or {}).get("device", "none")).lower() not in ("none", "auto")
               for key in ("offload_optimizer", "offload_param"))


def deepspeed_refusal(plugin: Any = None) -> str:
    """What is refused under DeepSpeed, why, and the ways that run.

    >>> from types import SimpleNamespace
    >>> deepspeed_refusal(SimpleNamespace(zero_stage=1)).split(":")[0]
    'lightning-remat plans DeepSpeed ZeRO-2 and ZeRO-3 without offload only (this is ZeRO stage 1)'
    """
    stage = getattr(plugin, "zero_stage", None)
    said = "unknown" if stage is None else str(stage)
    why = {
        0: "without ZeRO (stage 0) DeepSpeed's engine reduces whole gradients in buffers of its own; untested",
        1: "ZeRO-1 (optimizer state only) is untested",
    }.get(stage, "DeepSpeed offloads the optimizer or the parameters to another device (offload_optimizer, "
                 "offload_param), which the plan of this device does not model" if stage in (2, 3) else "untested")
    return (
        f"lightning-remat plans DeepSpeed ZeRO-2 and ZeRO-3 without offload only (this is ZeRO stage {said}): "
        f"RematAccelerator, prepare_remat, RematTrainerCallback and {ENV_BUDGET} are refused here, because {why}. "
        "What works: zero_stage=2 or 3 without offload, planned per rank with the partitioned parameters, "
        "gradients and optimizer state counted; or plan before prepare: lightning_remat.plan_remat(model, step, "
        "budget, optimizer=...) on the unsharded model, apply_plan(model, plan), then accelerator.prepare (or build "
        f"the Trainer) without RematTrainerCallback and with {ENV_BUDGET} unset, leaving room beside the budget "
        "for DeepSpeed's own buffers (docs/accelerate.md, 'DeepSpeed: plan, then prepare').")


def _inner_model(model: nn.Module) -> nn.Module:
    """``model`` out of its DDP, DataParallel, FSDP1 or DeepSpeed engine wrappers: Accelerate's
    ``extract_model_from_parallel`` imports DeepSpeed where installed (2 s), called only once an engine can exist."""
    if "deepspeed" in sys.modules or hasattr(model, "_orig_mod"):  # or torch.compile's wrapper, which it keeps
        from accelerate.utils import extract_model_from_parallel

        return extract_model_from_parallel(model, keep_fp32_wrapper=True)
    fsdp1 = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", nn.DataParallel)
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel, fsdp1)):
        model = model.module
    return model


def prepare_remat(model: nn.Module, remat_plugin: RematPlugin | None = None,
                  accelerator: Accelerator | None = None, loop: LoopFacts | None = None) -> nn.Module:
    """Make ``model`` recompute the optimal set of modules within the budget, from its next steps on.

    Before or after ``accelerator.prepare``; the first ``profile_steps`` steps are observed, the plan applied
    after the last of them, and the next step measured (docs/accelerate.md).

    Args:
        model: the model (already wrapped by DDP is fine: the inner module is watched).
        remat_plugin: the settings; None reads them from ``ACCELERATE_REMAT_*``. Without a budget nothing happens.
        accelerator: finds the prepared optimizer, logs ``remat/...`` to its trackers, and receives
            ``accelerator.remat_metrics`` and ``accelerator.remat_plan``.
        loop: what the session reads of a loop without an ``Accelerator`` to give (the Trainer's callback).

    Raises:
        AlreadyCheckpointedError: a torch ``checkpoint_wrapper`` in the model, or Accelerate's FSDP2
            ``activation_checkpointing`` on (Hugging Face's own checkpointing is turned off instead, said once).
        UnsupportedSetupError, UnsupportedShardingError: DeepSpeed other than ZeRO-2/3 without offload,
            Megatron-LM, XLA, torch.compile, FSDP1.
        ConflictingArgumentsError: the model has a session with other settings already.

    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
    >>> prepare_remat(net, RematPlugin(budget="1GB")) is net
    True
    >>> remat_session(net).phase
    'observe'
    >>> remat_session(net).remove()
    """
    plugin = RematPlugin() if remat_plugin is None else remat_plugin
    if accelerator is not None and not hasattr(accelerator, "remat_metrics"):
        accelerator.remat_metrics, accelerator.remat_plan = {}, None
    if not plugin.enabled:
        warnings.warn(NO_BUDGET, UserWarning, stacklevel=2)
        return model
    loop = loop or LoopFacts.of(accelerator)
    if loop.state is not None:
        _check_supported(loop.state)
    inner = _inner_model(model)
    held = remat_session(inner)
    if held is not None:
        _check_same_settings(held.plugin, plugin)
    # Also for a model planned already: a second trainer.train() switches the Trainer's checkpointing on again.
    take_over_checkpointing(inner, loop.who, getattr(loop.state, "is_main_process", True))
    if held is not None:
        return model
    find_stages(inner, plugin.candidates)  # fail at start, not after the first step
    session = RematSession(inner, plugin, accelerator, loop)
    if accelerator is not None:
        accelerator.remat_metrics = session.metrics  # the same dict: it fills in as the plan is made and measured
    return model


def _said(name: str, value: object) -> str:
    return f"{name} unset" if value is None else f"{name}={value!r}"


def _check_same_settings(held: RematPlugin, asked: RematPlugin) -> None:
    """A model has one session: other settings are refused, not ignored."""
    if held != asked:
        differ = [f"{_said(name, getattr(held, name))} and {_said(name, getattr(asked, name))}"
                  for name in (f.name for f in fields(held)) if getattr(held, name) != getattr(asked, name)]
        raise ConflictingArgumentsError(
            f"lightning-remat: this model is planned already, with other settings: {'; '.join(differ)}. A second "
            "RematTrainerCallback, prepare_remat or RematAccelerator for the same model would be ignored: give one")


NO_BUDGET = (f"lightning-remat: no budget given (RematPlugin(budget=...)) and {ENV_BUDGET} is not set: recomputing "
             "nothing; remat_plan stays None and remat_metrics empty")


def remat_session(model: nn.Module) -> RematSession | None:
    """The ``RematSession`` that ``prepare_remat`` attached to ``model`` (or its DDP wrapper), if any: its forward
    pre-hook, until ``remove()``, is the model's only hold on it (nothing global holds a session or its model).

    >>> remat_session(nn.Linear(2, 2)) is None
    True
    """
    hooks = _inner_model(model)._forward_pre_hooks.values()
    return next((hook.session for hook in hooks if isinstance(hook, SessionHook) and hook.session is not None), None)


class RematAccelerator(Accelerator):
    """``Accelerator`` that keeps each training step within a memory budget by recomputation.

    ``remat_plugin``: None reads ``RematPlugin`` from the environment. Each training model given to ``prepare``
    gets ``prepare_remat``; ``remat_plan`` is the applied ``Plan``, ``remat_metrics`` the ``remat/...`` figures.

    >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)])
    >>> optimizer = torch.optim.Adam(model.parameters())
    >>> accelerator = RematAccelerator(cpu=True, remat_plugin=RematPlugin(budget="min", cost="flops"))
    >>> model, optimizer = accelerator.prepare(model, optimizer)
    >>> x = torch.randn(64, 32)
    >>> for _ in range(3):  # the user's loop, unchanged: step 1 is observed, then planned, step 2 measured
    ...     optimizer.zero_grad(set_to_none=True)
    ...     accelerator.backward(model(x).square().mean())
    ...     optimizer.step()
    >>> metrics = accelerator.remat_metrics
    >>> metrics["remat/num_checkpointed"] > 0, metrics["remat/measured_peak_bytes"] <= metrics["remat/budget_bytes"]
    (True, True)
    >>> from accelerate.state import AcceleratorState
    >>> AcceleratorState._reset_state(True)
    """

    def __init__(self, *args: Any, remat_plugin: RematPlugin | None = None, **kwargs: Any):
        # Read the environment before anything else, so a bad value fails before any set-up.
        plugin = RematPlugin() if remat_plugin is None else remat_plugin
        super().__init__(*args, **kwargs)
        self.remat_plugin = plugin
        self.remat_plan: Plan | None = None
        self.remat_metrics: dict[str, float] = {}
        if plugin.enabled:
            _check_supported(self, take_over=True)  # before any prepare: the plugin's own checkpointing can go
        elif self.is_main_process:  # a no-op, said once: remat_plan stays None
            warnings.warn(NO_BUDGET, UserWarning, stacklevel=2)

    def _watch_prepared(self, result: Any) -> Any:
        if self.remat_plugin.enabled:
            for obj in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(obj, nn.Module) and obj.training:
                    prepare_remat(obj, self.remat_plugin, accelerator=self)
        return result

    def _prepare_deepspeed(self, *args: Any) -> Any:
        """DeepSpeed wraps the model in its engine, not through ``prepare_model``."""
        return self._watch_prepared(super()._prepare_deepspeed(*args))

    def _prepare_fsdp2(self, *args: Any) -> Any:
        """FSDP2 shards in place, not through ``prepare_model``."""
        return self._watch_prepared(super()._prepare_fsdp2(*args))

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        """``Accelerator.prepare_model``, and ``prepare_remat``."""
        if self.remat_plugin.enabled and not evaluation_mode:
            prepare_remat(model, self.remat_plugin, accelerator=self)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
