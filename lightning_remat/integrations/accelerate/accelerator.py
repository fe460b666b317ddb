"""``RematAccelerator`` and ``prepare_remat``: switch recomputation on for the models of an Accelerate loop.

    ACCELERATE_REMAT_BUDGET=200MB accelerate launch train.py

The script uses ``RematAccelerator`` instead of ``Accelerator`` (or keeps the stock ``Accelerator``
and calls ``prepare_remat(model, accelerator=accelerator)``); nothing else in the loop changes.

Supported: one process, DDP (multi-GPU, multi-CPU) and FSDP2 (``fsdp_version=2``: every rank
profiles the sharded model in lockstep; the budget is per rank; the plugin's own
``activation_checkpointing`` is refused with a budget). Not supported: FSDP1, DeepSpeed,
Megatron-LM, XLA and ``torch.compile`` through Accelerate; ``RematAccelerator`` and
``prepare_remat`` raise at start for those (FSDP1: ``UnsupportedShardingError``; the others:
``UnsupportedSetupError``; both ``RematError`` and ``NotImplementedError``), naming the workarounds.
DeepSpeed ZeRO runs with a plan made and applied before ``accelerator.prepare`` (docs/accelerate.md,
"DeepSpeed ZeRO: plan, then prepare"); its refusal says how.
"""

from __future__ import annotations

import warnings
import weakref
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
from .session import RematSession

_UNSUPPORTED = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")

FSDP2_TAKE_OVER = ("RematAccelerator turned off Accelerate's FSDP2 activation checkpointing (activation_checkpointing=True, "
                   "FSDP_ACTIVATION_CHECKPOINTING: every block recomputed) and plans recomputation within its budget "
                   "instead")

_SESSIONS: "weakref.WeakKeyDictionary[nn.Module, RematSession]" = weakref.WeakKeyDictionary()


def _check_supported(accelerator: Any, take_over: bool = False) -> None:
    """Refuse what the session cannot plan under: ``accelerator`` an ``Accelerator`` or its ``AcceleratorState``.
    ``take_over``: nothing is prepared yet, so the FSDP2 plugin's own activation checkpointing is switched off
    (said in one warning) instead of refused."""
    state = getattr(accelerator, "state", accelerator)
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper()
    if kind == "FSDP" and getattr(accelerator, "is_fsdp2", False):
        # FSDP2 shards in place: every rank profiles the sharded model in lockstep. Its own
        # activation checkpointing wraps every block when the model is prepared: off before, refused after.
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
        raise UnsupportedSetupError(deepspeed_refusal(getattr(state, "deepspeed_plugin", None)))
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


def deepspeed_refusal(plugin: Any = None) -> str:
    """What is refused under DeepSpeed, why, and the workaround that runs (``plugin``: Accelerate's ``DeepSpeedPlugin``).

    Example:
        >>> from types import SimpleNamespace
        >>> print(deepspeed_refusal(SimpleNamespace(zero_stage=3)))  # doctest: +ELLIPSIS
        lightning-remat does not support planning inside Accelerate's DeepSpeed mode (ZeRO stage 3), ...
    """
    stage = getattr(plugin, "zero_stage", None)
    stage = "" if stage is None else f" (ZeRO stage {stage})"
    return (
        f"lightning-remat does not support planning inside Accelerate's DeepSpeed mode{stage}, so "
        f"RematAccelerator, prepare_remat, RematTrainerCallback and {ENV_BUDGET} are refused there: DeepSpeed's "
        "engine keeps the partitioned parameters, gradients and optimizer state, and its communication buckets "
        "(reduce_bucket_size, allgather_bucket_size, stage3_prefetch_bucket_size), in flat buffers of its own that "
        "the profile of the model's step does not see, so a per-rank budget could not be checked. DeepSpeed itself "
        "runs with recomputation: plan before prepare. Call lightning_remat.plan_remat(model, step, budget, "
        "optimizer=...) on the unsharded model (ZeRO-3: with fake=True, world_size=N for the per-rank share of "
        "parameters, gradients and optimizer state; ZeRO-2: without, which counts whole gradients and optimizer "
        "state), apply_plan(model, plan), then accelerator.prepare (or build the Trainer) without "
        f"RematTrainerCallback and with {ENV_BUDGET} unset; leave room beside the budget for DeepSpeed's own "
        "buffers, its float32 copy of the rank's partition and its buckets (docs/accelerate.md, 'DeepSpeed ZeRO: "
        "plan, then prepare').")


def _inner_model(model: nn.Module) -> nn.Module:
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_fp32_wrapper=True)


def prepare_remat(model: nn.Module, remat_plugin: RematPlugin | None = None,
                  accelerator: Accelerator | None = None, loop: LoopFacts | None = None) -> nn.Module:
    """Make ``model`` recompute the optimal set of modules within the budget, from its next steps on.

    Use it with the stock ``Accelerator`` (``RematAccelerator`` calls it for you in ``prepare``).
    Call it before or after ``accelerator.prepare``; the training loop stays as it is. The first
    ``remat_plugin.profile_steps`` training steps are observed, the plan is made and applied in place
    at the end of the last of them, and the next step is measured (see the module docstring).

    Args:
        model: the model (already wrapped by DDP is fine: the inner module is watched).
        remat_plugin: the settings; None reads them from the environment (``ACCELERATE_REMAT_BUDGET``,
            ...). Without a budget nothing happens. The name ``RematAccelerator`` takes it under, as
            ``Accelerator`` takes ``fsdp_plugin=`` and ``deepspeed_plugin=``.
        accelerator: to find the prepared optimizer (its state counts in the budget), to log
            ``remat/...`` metrics to its trackers, and to receive ``accelerator.remat_metrics`` and
            ``accelerator.remat_plan``. Without it the optimizer is found when it first steps.
        loop: what the session reads of the loop (optimizers, accumulation, processes, logging), for
            a loop without an ``Accelerator`` of its own to give (the Hugging Face Trainer's callback).

    Returns:
        ``model`` itself; ``remat_session(model)`` gives the plan and metrics.

    Raises:
        ValueError: a malformed environment variable (named in the message).
        AlreadyCheckpointedError: a torch ``checkpoint_wrapper`` wraps a module of the model, or
            Accelerate's FSDP2 plugin has ``activation_checkpointing`` on. Hugging Face's own gradient
            checkpointing is turned off instead (a ``UserWarning`` says so: the plan recomputes).
        NoCandidateError: the model has no module to recompute (set ``candidates``).
        UnsupportedSetupError: (a ``NotImplementedError``) DeepSpeed, Megatron-LM, XLA or torch.compile
            through Accelerate; ``UnsupportedShardingError`` (one of them) for FSDP1.
        ConflictingArgumentsError: the model has a session with other settings already (two
            ``RematTrainerCallback``s with different budgets), naming both.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
        >>> prepare_remat(net, RematPlugin(budget="1GB")) is net
        True
        >>> remat_session(net).phase
        'observe'
        >>> remat_session(net).remove()
    """
    plugin = RematPlugin() if remat_plugin is None else remat_plugin
    if accelerator is not None:
        if not hasattr(accelerator, "remat_metrics"):
            accelerator.remat_metrics = {}
            accelerator.remat_plan = None
    if not plugin.enabled:
        warnings.warn(NO_BUDGET, UserWarning, stacklevel=2)
        return model
    if accelerator is not None:
        _check_supported(accelerator)
    inner = _inner_model(model)
    if inner in _SESSIONS:
        _check_same_settings(_SESSIONS[inner].plugin, plugin)
    else:
        find_stages(inner, plugin.candidates)  # fail at start, not after the first step
    # The user asked us for a budget: Hugging Face's own checkpointing is turned off (said in one line), a
    # torch checkpoint_wrapper refused, so that nothing recomputes twice and nothing runs outside the plan.
    # Again for a model planned already: a second trainer.train() switches the Trainer's checkpointing on again.
    took_over = take_over_checkpointing(inner, f"lightning-remat ({ENV_BUDGET} / RematPlugin.budget)")
    if took_over:
        warnings.warn(took_over, UserWarning, stacklevel=3)
    if inner in _SESSIONS:
        return model
    session = RematSession(inner, plugin, accelerator, loop)
    if accelerator is not None:
        # The same dict: it fills in as the plan is made and measured.
        accelerator.remat_metrics = session.metrics
    _SESSIONS[inner] = session
    return model


def _check_same_settings(held: RematPlugin, asked: RematPlugin) -> None:
    """A model has one session: a second asking for other settings (two ``RematTrainerCallback``s,
    ``prepare_remat`` beside ``RematAccelerator``) is refused, not ignored. The same settings again
    (a second ``trainer.train()``) reuse it."""
    if held != asked:
        differ = [f"{name}={getattr(held, name)!r} and {name}={getattr(asked, name)!r}"
                  for name in ("budget", "profile_steps", "candidates", "cost", "offload", "policies", "chunk_loss")
                  if getattr(held, name) != getattr(asked, name)]
        raise ConflictingArgumentsError(
            f"lightning-remat: this model is planned already, with other settings: {'; '.join(differ)}. A second "
            "RematTrainerCallback, prepare_remat or RematAccelerator for the same model would be ignored: give one")


# Without a budget RematAccelerator and prepare_remat do nothing; they say so (issue 29: a script that went
# on to read remat_plan.summary() crashed on None, with nothing said).
NO_BUDGET = (f"lightning-remat: no budget given (RematPlugin(budget=...)) and {ENV_BUDGET} is not set: recomputing "
             "nothing; remat_plan stays None and remat_metrics empty")


def remat_session(model: nn.Module) -> RematSession | None:
    """The ``RematSession`` that ``prepare_remat`` attached to ``model`` (or its DDP wrapper), if any.

    Example:
        >>> remat_session(nn.Linear(2, 2)) is None
        True
    """
    return _SESSIONS.get(_inner_model(model))


class RematAccelerator(Accelerator):
    """``Accelerator`` that keeps each training step within a memory budget by recomputation.

    Takes every argument of ``Accelerator``, and ``remat_plugin``. Without a plugin the settings
    come from the environment, so an unchanged script is switched on at launch::

        ACCELERATE_REMAT_BUDGET=200MB accelerate launch train.py

    Each model given to ``prepare`` (for training) gets ``prepare_remat``: its first
    ``profile_steps`` steps are observed, then the plan is applied in place (parameter names and
    ``state_dict`` keys do not change, so ``save_state``/``load_state`` work with or without it).

    Args:
        remat_plugin: the settings; None reads ``RematPlugin`` from the environment. A malformed
            value fails here, at start, naming the variable. Named as ``Accelerator``'s own
            ``fsdp_plugin``/``deepspeed_plugin``; ``prepare_remat`` takes it under the same name.
        *args, **kwargs: passed to ``Accelerator``.

    Attributes:
        remat_plugin: the settings in use.
        remat_plan: the applied ``Plan`` (None before it is made, or without a budget: then
            ``RematAccelerator()`` warns that it recomputes nothing).
        remat_metrics: ``remat/budget_bytes``, ``remat/baseline_peak_bytes``,
            ``remat/predicted_peak_bytes``, ``remat/predicted_overhead``, ``remat/num_checkpointed``
            once planned, and ``remat/measured_peak_bytes`` after the next step; the same figures
            go to ``accelerator.log`` when trackers are initialised.

    Example:
        >>> from torch import nn
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

    def _prepare_fsdp2(self, *args: Any) -> Any:
        """Prepare as Accelerate does with FSDP2 (which shards in place and does not go through
        ``prepare_model``), then watch each sharded model in training mode for recomputation."""
        result = super()._prepare_fsdp2(*args)
        if self.remat_plugin.enabled:
            for obj in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(obj, nn.Module) and obj.training:
                    prepare_remat(obj, self.remat_plugin, accelerator=self)
        return result

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        """Prepare as ``Accelerator.prepare_model`` does, and watch the model for recomputation."""
        if self.remat_plugin.enabled and not evaluation_mode:
            prepare_remat(model, self.remat_plugin, accelerator=self)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
