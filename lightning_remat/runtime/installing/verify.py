"""Check that what is installed on a model is exactly what its plan says: the installer's records
read back (``records.py``) against the plan's actions, kind by kind.

Cheap (one walk over the model's modules, no tensor touched), so it runs after every install and at
every step that keeps a plan (``service.shape_plans.ShapePlans.use``, the integrations): a plan
that is "already installed" is checked, not assumed, since the installation can be undone behind
the plan's back (a copy of the model sharing its records, a ``remove_remat``, a library patching
``forward``), and a step under a plan that is not installed runs over its budget silently.

Example:
    >>> from torch import nn
    >>> from lightning_remat.core.plan import Plan
    >>> from lightning_remat.runtime.installing.installer import install, uninstall
    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
    >>> plan = Plan(["0"], segments=[["1", "2"]])
    >>> check_installed(install(net, plan), plan)        # nothing to say: installed as planned
    >>> installation_mismatch(uninstall(net), plan)
    "recomputed: the plan says {'0': ''}, installed is {}; segments: the plan says [['1', '2']], installed is []"
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...core.errors import InstallationMismatchError
from ...core.plan import Plan
from .compiled import uncompiled
from .records import RECORD, input_offload_of, installed_segments, offloaded, recomputed


def planned_actions(plan: Plan) -> dict[str, Any]:
    """What ``plan`` puts on a model, per kind, in the form ``installed_actions`` reads it back.

    Example:
        >>> planned_actions(Plan(["h.1"], policies={"h.1": "save_matmuls"}))["recomputed"]
        {'h.1': 'save_matmuls'}
    """
    policies = plan.policies
    return {"recomputed": {name: policies.get(name, "") for name in sorted(plan.checkpointed)},
            "segments": sorted(list(s) for s in plan.segments),
            "offloaded": sorted(plan.offloaded),
            "offloaded_inputs": sorted(plan.offloaded_inputs),
            "chunked_heads": dict(sorted(plan.chunked_loss.items()))}


def installed_actions(model: nn.Module) -> dict[str, Any]:
    """What the installer's records say is on ``model`` (names of the uncompiled model), per kind.

    Example:
        >>> installed_actions(nn.Linear(2, 2))["recomputed"]
        {}
    """
    with uncompiled(model) as plain:
        return {"recomputed": dict(sorted(recomputed(plain).items())),
                "segments": sorted(installed_segments(plain)),
                "offloaded": sorted(offloaded(plain)),
                "offloaded_inputs": sorted(input_offload_of(plain)[0]),
                "chunked_heads": dict(sorted((name, m.__dict__[RECORD].chunks) for name, m in plain.named_modules()
                                             if RECORD in m.__dict__ and m.__dict__[RECORD].chunks))}


def installation_mismatch(model: nn.Module, plan: Plan) -> str | None:
    """What differs between ``plan`` and what is installed on ``model``, each kind with both sides;
    None when they are the same."""
    planned, installed = planned_actions(plan), installed_actions(model)
    return None if planned == installed else InstallationMismatchError(planned, installed).differences


def check_installed(model: nn.Module, plan: Plan, where: str = "") -> None:
    """Raise ``InstallationMismatchError`` (naming what the plan says and what is installed) unless
    what is installed on ``model`` is exactly ``plan``'s actions; ``where`` says who checked."""
    planned, installed = planned_actions(plan), installed_actions(model)
    if planned != installed:
        raise InstallationMismatchError(planned, installed, where)
