"""Check that what is installed is exactly the plan, after every install and at every step that keeps one: a
library patching ``forward`` can undo an installation, and the step would overrun silently."""

from __future__ import annotations

from typing import Any

from torch import nn

from ...core.errors import InstallationMismatchError
from ...core.plan import Plan
from .behaviours import BEHAVIOURS
from .compiled import uncompiled


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
