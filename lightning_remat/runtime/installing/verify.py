"""Check that what is installed on a model is exactly what its plan says: the installer's records
read back (``records.py``; a record counts only while its forward is the module's, a segment only
while its Sequential's class runs it) against the plan's actions, kind by kind.

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
from .records import RECORD, running
from .sequential import SEGMENTS


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
    """What runs on ``model`` (names of the uncompiled model), per kind: the installer's records whose
    forward is still in place (``records.running``), and the segments of Sequentials whose class
    still runs them.

    Example:
        >>> installed_actions(nn.Linear(2, 2))["recomputed"]
        {}
    """
    records, segments = {}, []
    with uncompiled(model) as plain:
        for name, m in plain.named_modules():  # one walk: this runs at every step
            if RECORD in m.__dict__ and (record := running(m)) is not None:
                records[name] = record
            if SEGMENTS in m.__dict__ and getattr(type(m), "_remat_segmented", False):
                segments += [list(names) for _, _, runner, names in m.__dict__[SEGMENTS] if _recomputes(runner)]
    return {"recomputed": {n: r.policy for n, r in sorted(records.items()) if r.recompute},
            "segments": sorted(segments),
            "offloaded": sorted(n for n, r in records.items() if r.offload is not None),
            "offloaded_inputs": sorted(n for n, r in records.items() if r.recompute and r.input_offload is not None),
            "chunked_heads": {n: r.chunks for n, r in sorted(records.items()) if r.chunks}}


def _recomputes(runner: nn.Module) -> bool:
    record = running(runner)
    return record is not None and record.recompute


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
