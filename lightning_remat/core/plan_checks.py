"""Every field of a saved plan checked before a plan is built: a bad one is a ``PlanFormatError`` naming it."""

from __future__ import annotations

import math
from typing import Any, Mapping

from .actions import nested_in
from .budget import MAX_BUDGET_BYTES as MAX_BYTES  # the largest byte count a plan holds
from .errors import PlanFormatError
from .shapes import Shape
from .vocabulary import CostKind

_BYTES = "a whole number of bytes from 0 to 2**63 - 1"
_OPTIONAL_BYTES = ("budget_bytes", "baseline_peak_bytes", "predicted_peak_bytes")
_STATIC_BYTES = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "host_bytes")


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _whole(value: Any, low: int = 0, high: int = MAX_BYTES) -> bool:
    """An int (or an integral finite float, as JSON may write one) within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return False
    return low <= value <= high


def check_bytes(field: str, value: Any, optional: bool = False) -> None:
    """A byte count of a plan (None or NaN too where ``optional``: not predicted)."""
    if optional and (value is None or _is_nan(value)):
        return
    if not _whole(value):
        raise PlanFormatError(field, value, _BYTES + (" (or null)" if optional else ""))


def _check_choices(value: Any, stages: list[str] | None) -> None:
    if not isinstance(value, (list, tuple)):
        raise PlanFormatError("choices", value, "a list of the stages' chosen options")
    seen: set[str] = set()
    for i, choice in enumerate(value):
        where = f"choices[{i}]"
        if not isinstance(choice, Mapping) or set(choice) != {"stage", "option", "baseline_stored_bytes",
                                                              "stored_bytes", "cost"}:
            raise PlanFormatError(where, choice, "a dict of stage, option, baseline_stored_bytes, stored_bytes, cost")
        for key in ("stage", "option"):
            if not isinstance(choice[key], str):
                raise PlanFormatError(f"{where}.{key}", choice[key], "a string")
        for key in ("baseline_stored_bytes", "stored_bytes"):
            # Stored bytes may be below zero: a recompute can free what the stage's input held.
            if not _whole(choice[key], -MAX_BYTES):
                raise PlanFormatError(f"{where}.{key}", choice[key], "a whole number of bytes")
        cost = choice["cost"]
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost):
            raise PlanFormatError(f"{where}.cost", cost, "a finite number")
        # A block recomputed whole is one action over several chosen stages (its children).
        known = stages is None or any(choice["stage"] == s or nested_in(choice["stage"], s) for s in stages)
        if choice["stage"] in seen or not known:
            raise PlanFormatError(f"{where}.stage", choice["stage"],
                                  "a stage of the plan's actions (or inside one), chosen once" if stages is not None
                                  else "a stage chosen once")
        seen.add(choice["stage"])


def _check_binding(fingerprint: Mapping[str, Any]) -> None:
    """The model a plan records (``runtime.installing.fingerprint.bound``): shapes and counts."""
    modules = fingerprint.get("module_parameters", {})
    if not isinstance(modules, Mapping):
        raise PlanFormatError("fingerprint.module_parameters", modules, "a dict of module names to their parameters")
    for name, parameters in modules.items():
        ok = isinstance(name, str) and isinstance(parameters, Mapping) and all(
            isinstance(p, str) and isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[0], (list, tuple))
            and all(_whole(d, 0) for d in v[0]) and isinstance(v[1], str) for p, v in parameters.items())
        if not ok:
            raise PlanFormatError(f"fingerprint.module_parameters[{name!r}]", parameters,
                                  "a dict of parameter names to [shape, dtype]")
    # The figures the integrations compare with a model and a batch (``runtime.installing.fingerprint``).
    for key in ("parameter_count", "parameter_bytes", "trainable_bytes", "batch_elements"):
        if key in fingerprint and not _whole(fingerprint[key]):
            raise PlanFormatError(f"fingerprint.{key}", fingerprint[key], "a whole number >= 0")


def _check_mappings(data: Mapping[str, Any]) -> None:
    for field in ("fingerprint", "sharding", "policies", "offload_limits"):
        value = data.get(field, {})
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise PlanFormatError(field, value, "a dict with string keys")
    for name, limit in data.get("offload_limits", {}).items():
        check_bytes(f"offload_limits[{name!r}]", limit)
    _check_binding(data.get("fingerprint", {}))


def check_plan_dict(data: Any) -> None:
    """Raise ``PlanFormatError`` naming the first field of ``data`` that no plan can hold."""
    if not isinstance(data, Mapping):
        raise PlanFormatError("dict", data, "a dict (Plan.to_dict)")
    for field in _OPTIONAL_BYTES:
        check_bytes(field, data.get(field), optional=True)
    for field in _STATIC_BYTES:
        check_bytes(field, data.get(field, 0))
    overhead = data.get("predicted_overhead")
    # None or NaN: not predicted. No sign required: a cost in seconds is a difference of timings (may be below zero).
    if overhead is not None and not _is_nan(overhead) and (
            isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not math.isfinite(overhead)):
        raise PlanFormatError("predicted_overhead", overhead, "a finite number (or null)")
    if "cost_kind" in data and data["cost_kind"] not in CostKind.values():
        raise PlanFormatError("cost_kind", data["cost_kind"], f"one of {CostKind.values()}")
    if not isinstance(data.get("requested_budget", ""), str):
        raise PlanFormatError("requested_budget", data["requested_budget"], "a string")
    notes = data.get("notes", [])
    if not isinstance(notes, (list, tuple)) or not all(isinstance(v, str) for v in notes):
        raise PlanFormatError("notes", notes, "a list of strings")
    if not isinstance(data.get("fallback", False), bool):
        raise PlanFormatError("fallback", data["fallback"], "true or false")
    _check_mappings(data)
    actions = data.get("actions")
    if actions is not None and not (isinstance(actions, (list, tuple))
                                    and all(isinstance(a, Mapping) and isinstance(a.get("stage"), str)
                                            for a in actions)):
        raise PlanFormatError("actions", actions, "a list of actions, each a dict with a 'stage'")
    stages = [a["stage"] for a in actions] if actions is not None else None
    _check_choices(data.get("choices", []), stages)


def _layout(layout: Any) -> bool:
    """Whether ``layout`` is a shape's layout (``Shape.to_list``'s third item)."""
    try:
        Shape(1, 1, layout)
    except (TypeError, ValueError):
        return False
    return True


def check_saved_state(state: Any, owner: str) -> None:
    """Check the state an integration keeps in a checkpoint (``plan``, ``plans``); ``owner`` names it in the error."""
    if not isinstance(state, Mapping):
        raise PlanFormatError("state", state, "a dict", owner)
    if not (state.get("plan") is None or isinstance(state["plan"], Mapping)):
        raise PlanFormatError("plan", state["plan"], "a plan's dict (Plan.to_dict) or null", owner)
    plans = state.get("plans", [])
    if not isinstance(plans, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) in (3, 4) and _whole(p[0], 1) and _whole(p[1], 1)
            and isinstance(p[2], Mapping) and (len(p) == 3 or _layout(p[3])) for p in plans):
        raise PlanFormatError("plans", plans, "a list of [batch size, sequence length, plan's dict] (and the "
                              "shape's layout, [[path, [sizes]], ...], fourth)", owner)
    measured = state.get("measured_peak_bytes")
    if measured is not None and not _whole(measured):
        raise PlanFormatError("measured_peak_bytes", measured, _BYTES + " (or null)", owner)
    size = state.get("batch_size")
    if size is not None and not _whole(size, 1):
        raise PlanFormatError("batch_size", size, "a whole number >= 1 (or null)", owner)
