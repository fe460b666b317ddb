"""Apply a plan and undo it exactly: each ``forward`` an instance attribute, no wrapper, the same state_dict keys."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace
from typing import Iterable, Iterator

import torch
from torch import nn

from ...core.actions import module_names
from ...core.errors import AlreadyCheckpointedError
from ...core.plan import Plan, StageAction
from ...core.vocabulary import Action
from . import installer
from .compiled import uncompiled
from .fingerprint import check_binding


def existing_checkpointing(model: nn.Module) -> list[str]:
    """Activation checkpointing in ``model`` that is not ours (Hugging Face's, torch's ``checkpoint_wrapper``).

    >>> existing_checkpointing(nn.Linear(2, 2))
    []
    """
    found = []
    # transformers 5 renamed the flag (the old name warns); PEFT's wrappers forward it, so ask the instance.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        flag = getattr(model, "is_activation_checkpointing", None)
        if flag is None:
            flag = getattr(model, "is_gradient_checkpointing", False)
    if flag:
        found.append(f"Hugging Face gradient checkpointing is enabled on {type(model).__name__} "
                     "(call model.gradient_checkpointing_disable() to let lightning-remat choose)")
    else:
        for name, module in model.named_modules():
            if getattr(module, "gradient_checkpointing", False) is True:
                found.append(f"Hugging Face gradient checkpointing is enabled on {name or type(model).__name__}")
                break
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # pragma: no cover - torch built without distributed
        CheckpointWrapper = ()  # type: ignore[assignment]
    wrapped = [name for name, m in model.named_modules() if CheckpointWrapper and isinstance(m, CheckpointWrapper)]
    if wrapped:
        found.append(f"torch checkpoint_wrapper wraps {len(wrapped)} module(s), e.g. {wrapped[0]!r} "
                     "(as FSDP activation_checkpointing_policy does)")
    return found


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that lightning-remat currently recomputes alone.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    >>> checkpointed_modules(apply_plan(net, ["0"]))
    ['0']
    """
    return list(installer.recomputed(model))


def segmented_modules(model: nn.Module) -> list[list[str]]:
    """The segments of ``model`` lightning-remat currently recomputes as one checkpoint each.

    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(3)])
    >>> segmented_modules(apply_plan(net, Plan([StageAction.in_segment(s, ["0", "1"]) for s in ("0", "1")])))
    [['0', '1']]
    """
    with uncompiled(model) as model:
        return installer.installed_segments(model)


def recomputation_of(plan: Plan) -> Plan:
    """``plan``'s recomputed modules (with their policies) and segments alone.

    >>> alone = recomputation_of(Plan([StageAction.recompute("0", offload_input=True), StageAction.offload("1")]))
    >>> alone.checkpointed, alone.offloaded_inputs, alone.offloaded
    (['0'], [], [])
    """
    return Plan([replace(a, offload_input=False) for a in plan.actions if a.action in (Action.RECOMPUTE, Action.SEGMENT)])


def apply_plan(model: nn.Module, plan: Plan | Iterable[str]) -> nn.Module:
    """Put, in place, the plan's actions on the modules it names; returns ``model``.

    ``plan``: a ``Plan``, or names of modules to recompute. A previous plan is replaced;
    an error leaves the model as it was; names are the uncompiled model's. Raises ``AlreadyCheckpointedError``,
    ``PlanMismatchError`` (other shapes, a missing module) and ``InvalidPlanError``.

    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> _ = apply_plan(net, ["0"])
    >>> net(torch.randn(2, 4, requires_grad=True)).sum().backward()
    >>> _ = remove_remat(net)
    >>> "forward" in net[0].__dict__
    False
    """
    if not isinstance(plan, Plan):
        plan = Plan([StageAction.recompute(n) for n in module_names("plan", plan)])
    # A plan solved for other shapes would break its budget silently: refused before anything changes.
    check_binding(model, plan)
    existing = existing_checkpointing(model)
    if existing and (plan.checkpointed or plan.segments):
        raise AlreadyCheckpointedError(
            "Not applying the recompute plan, to avoid checkpointing twice: " + "; ".join(existing)
        )
    return installer.install(model, plan)


def remove_remat(model: nn.Module) -> nn.Module:
    """Undo ``apply_plan``: every module gets back exactly the forward it had. Returns ``model``.

    >>> net = nn.Sequential(nn.Linear(2, 2))
    >>> remove_remat(apply_plan(net, ["0"])) is net and checkpointed_modules(net) == []
    True
    """
    return installer.uninstall(model)


@contextlib.contextmanager
def applied(model: nn.Module, plan: Plan) -> Iterator[nn.Module]:
    """Apply ``plan`` for the duration of a ``with`` block, then restore exactly what the model had."""
    previous = installer.snapshot(model)
    apply_plan(model, plan)
    try:
        yield model
    finally:
        installer.restore(model, previous)
