"""What a plan was made for (``bound``): its modules' parameter shapes, the parameter count, the batch's size,
so ``apply_plan`` refuses it on wider blocks or more stages. Dtypes are recorded, not compared."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ...core.actions import nested_in
from ...core.errors import PlanMismatchError
from ...core.plan import Plan, StageAction  # StageAction: for the examples
from ...core.shapes import Shape
from ..profiling.batch_shape import batch_shape
from .compiled import uncompiled


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]


def batch_elements(batch: Any) -> int:
    """Elements in all tensors of a batch (the size a plan scales with)."""
    return sum(t.numel() for t in _tensors(batch))


def fingerprint(model: nn.Module, batch: Any) -> dict[str, Any]:
    """Parameter bytes (all, trainable) and the batch's elements and shapes."""
    return {
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "trainable_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        "batch_elements": batch_elements(batch),
        "batch_shapes": " ".join(str(tuple(t.shape)) for t in _tensors(batch)),
    }


def _parameters(module: nn.Module) -> dict[str, list]:
    return {name: [list(p.shape), str(p.dtype).removeprefix("torch.")] for name, p in module.named_parameters()}


def binding_of(model: nn.Module, names: list[str]) -> dict[str, Any]:
    """The parameters of the outermost named modules of ``model`` and its parameter count (``Profile.fingerprint``)."""
    names = list(dict.fromkeys(names))
    outer = [n for n in names if not any(nested_in(n, other) for other in names)]
    with uncompiled(model) as plain:
        modules = dict(plain.named_modules())
        return {"module_parameters": {n: _parameters(modules[n]) for n in outer if n in modules},
                "parameter_count": sum(p.numel() for p in plain.parameters())}


def bound(plan: Plan, model: nn.Module) -> Plan:
    """``plan`` recording what it was made for in ``model`` (the parameters of the modules it names, its stages and
    what it recomputes), beside its fingerprint."""
    names = [*plan.stages, *(m for a in plan.actions for m in (*a.modules, *a.segment))]
    return replace(plan, fingerprint={**plan.fingerprint, **binding_of(model, names)})


def _shape(entry: list) -> str:
    return f"({', '.join(str(d) for d in entry[0])}{',' if len(entry[0]) == 1 else ''}) {entry[1]}"


def _module_mismatch(name: str, module: nn.Module | None, recorded: dict[str, list]) -> str | None:
    if module is None:
        return f"module {name!r}, which the plan names, is not in this model"
    now = _parameters(module)
    for param in dict.fromkeys([*recorded, *now]):
        here, then = now.get(param), recorded.get(param)
        if here is None or then is None or list(here[0]) != list(then[0]):
            return (f"module {name!r} parameter {param!r} has shape "
                    f"{_shape(here) if here else 'none (no such parameter)'} in this model; the plan was made for "
                    f"{_shape(then) if then else 'none (no such parameter)'}")
    return None


def mismatch(model: nn.Module, saved: dict[str, Any]) -> str | None:
    """What differs between ``model`` and the model a plan's fingerprint ``saved`` records, or None.

    >>> chain = lambda n: torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(n)])
    >>> saved = bound(Plan([StageAction.recompute("0"), StageAction.recompute("1")]), chain(2)).fingerprint
    >>> mismatch(chain(3), saved)
    "this model has 18 parameters; the plan was made for a model of 12 (module(s) ['2'] are stages the plan does not know)"
    """
    recorded = saved.get("module_parameters", {})
    with uncompiled(model) as plain:
        modules = dict(plain.named_modules())
        for name, parameters in recorded.items():
            found = _module_mismatch(name, modules.get(name), parameters)
            if found:
                return found
        count = sum(p.numel() for p in plain.parameters())
        if "parameter_count" in saved and count != saved["parameter_count"]:
            extra = [n for n, m in modules.items() if n and n not in recorded and any(  # siblings of a stage's kind
                n.rpartition(".")[0] == r.rpartition(".")[0] and type(m) is type(modules.get(r)) for r in recorded)]
            return (f"this model has {count} parameters; the plan was made for a model of {saved['parameter_count']}"
                    + (f" (module(s) {extra} are stages the plan does not know)" if extra else ""))
    return None


def made_for_other(model: nn.Module, plans: list[Plan | None], bytes_too: bool = True) -> str | None:
    """Why one of ``plans`` was made for another model than ``model`` (``bytes_too``: parameter bytes too), or None."""
    plans = [p for p in plans if p is not None]
    found = next((m for m in (mismatch(model, p.fingerprint) for p in plans) if m), None)
    if found is None and bytes_too:
        now = fingerprint(model, None)
        saved = [(p.fingerprint["parameter_bytes"], p.fingerprint.get("trainable_bytes")) for p in plans
                 if "parameter_bytes" in p.fingerprint]
        if any(bytes_ != (now["parameter_bytes"], now["trainable_bytes"]) for bytes_ in saved):
            found = "other parameter bytes"
    return found


def check_binding(model: nn.Module, plan: Plan) -> None:
    """Raise ``PlanMismatchError`` where ``plan`` was made for a model other than ``model``."""
    found = mismatch(model, plan.fingerprint)
    if found is not None:
        raise PlanMismatchError(f"lightning-remat: the plan was made for another model: {found}. Nothing was applied; "
                                "plan this model again (plan_remat, or AutoRemat plans again by itself).")


def outgrows(saved: dict[str, Any], batch: Any) -> bool:
    """Whether ``batch`` is larger than the plan's profiled one: more elements, or a shape it does not cover."""
    if "batch_elements" in saved and batch_elements(batch) > saved["batch_elements"]:
        return True
    if not isinstance(saved.get("shape"), (list, tuple)):
        return False
    shape = batch_shape(batch)
    return shape is not None and not Shape.from_list(saved["shape"]).covers(shape)
