"""The one installer: puts a plan's actions on a model over the registered behaviours, takes them off, and checks
that what is installed is exactly the plan, after every install and at every step that keeps one (a library
patching ``forward`` can undo an installation, and the step would overrun silently).

The built-in behaviours, registered in the order they compose (outermost first):

>>> [b.name for b in BEHAVIOURS][:9]
['chunked_loss', 'fused_loss', 'offload', 'recompute', 'policy', 'input_offload', 'segment', 'residual_parts', 'tile']
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from ...core.actions import check_actions
from ...core.errors import InstallationMismatchError
from ...core.plan import Plan, StageAction, StageChoice
from ...core.vocabulary import Action
from .chunked_loss import ChunkedLoss
from .compiled import uncompiled
from .fused_loss import FusedLoss
from .input_offload import INPUT_OFFLOAD, input_offload_of
from .offload import OFFLOAD
from .offloader import is_fake
from .recompute import RECOMPUTE
from .records import BEHAVIOURS, Target, check_names, installed_segments, recomputed, register, state_of
from .residual_parts import RESIDUAL_PARTS
from .sac import OpPolicy
from .segments import SEGMENT
from .tiled_mlp import TILED_MLP

__all__ = ["input_offload_of", "install", "installed_segments", "recomputed", "restore", "snapshot", "uninstall"]

for _behaviour in (ChunkedLoss(), FusedLoss(), OFFLOAD, RECOMPUTE, OpPolicy(), INPUT_OFFLOAD, SEGMENT, RESIDUAL_PARTS,
                   TILED_MLP):
    register(_behaviour)


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


def planned_actions(plan: Plan) -> dict[str, dict[str, Any]]:
    """Per registered behaviour, the modules ``plan`` puts it on and their settings."""
    return {b.name: {n: v for a in plan.actions for n, v in b.settings(a).items()} for b in BEHAVIOURS}


def installed_actions(model: nn.Module) -> dict[str, Any]:
    """What runs on ``model`` per behaviour: records whose forward is still in place, segments still run."""
    with uncompiled(model) as plain:
        modules = dict(plain.named_modules())  # one walk: this runs at every step
        return {b.name: b.read(modules, only_running=True) for b in BEHAVIOURS}


def installation_mismatch(model: nn.Module, plan: Plan) -> str | None:
    """What differs between ``plan`` and what is installed on ``model``, each behaviour with both sides, or None."""
    planned, installed = planned_actions(plan), installed_actions(model)
    return None if planned == installed else InstallationMismatchError(planned, installed).differences


def check_installed(model: nn.Module, plan: Plan, where: str = "") -> None:
    """Raise ``InstallationMismatchError`` unless ``model`` has exactly ``plan``'s actions; ``where`` says who checked."""
    planned, installed = planned_actions(plan), installed_actions(model)
    if planned != installed:
        raise InstallationMismatchError(planned, installed, where)
