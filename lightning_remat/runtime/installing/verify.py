"""Check that what is installed on a model is exactly what its plan says, behaviour by behaviour.

Cheap (one walk over the modules), so it runs after every install and at every step that keeps a
plan: an installation can be undone behind the plan's back (a library patching ``forward``), and a
step under a plan that is not installed runs over its budget silently.

Example:
    >>> from torch import nn
    >>> from lightning_remat.core.plan import Plan, StageAction
    >>> from lightning_remat.runtime.installing.installer import install, uninstall
    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
    >>> plan = Plan([StageAction.recompute("0"), *(StageAction.in_segment(s, ["1", "2"]) for s in ["1", "2"])])
    >>> check_installed(install(net, plan), plan)        # nothing to say: installed as planned
    >>> installation_mismatch(uninstall(net), plan)
    "recompute: the plan says {'0': True}, installed is {}; segment: the plan says {'1': ('1', '2'), '2': ('1', '2')}, installed is {}"
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...core.errors import InstallationMismatchError
from ...core.plan import Plan
from .behaviours import BEHAVIOURS
from .compiled import uncompiled


def planned_actions(plan: Plan) -> dict[str, dict[str, Any]]:
    """Per registered behaviour, the modules ``plan`` puts it on and their settings.

    Example:
        >>> from lightning_remat.core.plan import StageAction
        >>> planned_actions(Plan([StageAction.recompute("h.1", policy="save_matmuls")]))["policy"]
        {'h.1': 'save_matmuls'}
    """
    return {b.name: {n: v for a in plan.actions for n, v in b.settings(a).items()} for b in BEHAVIOURS}


def installed_actions(model: nn.Module) -> dict[str, Any]:
    """What runs on ``model`` per behaviour: records whose forward is still in place, segments still run.

    Example:
        >>> installed_actions(nn.Linear(2, 2))["recompute"]
        {}
    """
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
