"""The one installer: puts a plan's actions on a model over the registered behaviours, and takes them off."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from ...core.actions import check_actions
from ...core.plan import Plan, StageAction, StageChoice
from ...core.vocabulary import Action
from .behaviours import BEHAVIOURS
from .compiled import uncompiled
from .input_offload import input_offload_of
from .offloader import is_fake
from .records import Target, check_names, installed_segments, recomputed, state_of
from .verify import check_installed, planned_actions

__all__ = ["input_offload_of", "install", "installed_segments", "recomputed", "restore", "snapshot", "uninstall"]


def install(model: nn.Module, plan: Plan, order: Sequence[str] | None = None) -> nn.Module:
    """Put ``plan``'s actions on ``model`` in place (``order``: stages in execution order); a failure puts back."""
    with uncompiled(model) as plain:
        modules = dict(plain.named_modules())
        check_names(model, modules, list(dict.fromkeys(
            m for a in plan.actions if a.action is not Action.KEEP for m in (a.stage, *a.modules, *a.segment))))
        check_actions(plan.actions)
        wanted = planned_actions(plan)
        for b in BEHAVIOURS:
            b.check(modules, wanted[b.name])
        previous = snapshot(plain)
        uninstall(plain)
        try:
            _install(plain, wanted, plan.stage_order if order is None else tuple(order))
            check_installed(plain, plan, "(right after installing it)")  # read back, never assumed
        except BaseException:
            restore(plain, previous)  # all or nothing: the model as it was, then the error as it was
            raise
    return model


def _install(plain: nn.Module, wanted: dict[str, dict[str, Any]], order: tuple[str, ...] | None) -> None:
    # A fake model's offloading keeps metadata only (its memory runs measure what stays on the device).
    target = Target(dict(plain.named_modules()), order, any(is_fake(p) for p in plain.parameters()))
    for b in BEHAVIOURS:
        if wanted[b.name]:
            b.install(target, wanted[b.name])


def uninstall(model: nn.Module) -> nn.Module:
    """Take every behaviour of ours off ``model``: each module gets back exactly the forward (and class) it had."""
    with uncompiled(model) as plain:
        for b in reversed(BEHAVIOURS):
            b.uninstall(plain)
    return model


def snapshot(model: nn.Module) -> Plan:
    """What is installed on ``model`` now, as a plan: one action per module, the offloader's order as its choices."""
    with uncompiled(model) as plain:
        fields: dict[str, dict[str, Any]] = {}
        modules = dict(plain.named_modules())
        for b in BEHAVIOURS:
            for name, setting in b.read(modules).items():
                merged = fields.setdefault(name, {})
                for key, value in b.fields(name, setting).items():
                    merged[key] = {**merged[key], **value} if key == "extra" and key in merged else value
        offloading = state_of(plain, "offload")
        order = offloading.offloader.order if offloading is not None else None
    return Plan([StageAction(name, **fields[name]) for name in modules if name in fields],
                choices=[StageChoice(s, "", 0, 0, 0.0) for s in order or ()])


def restore(model: nn.Module, plan: Plan) -> nn.Module:
    """Install exactly ``plan`` (from ``snapshot``) on ``model`` in place of what it has, unchecked."""
    with uncompiled(model) as plain:
        _install(uninstall(plain), planned_actions(plan), plan.stage_order)
    return model
