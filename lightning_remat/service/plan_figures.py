"""What integrations report of a plan: the ``remat/...`` figures, and the over-budget warning with its causes."""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

from torch import nn

from ..core.budget import format_in_units_of
from ..core.plan import Plan
from ..core.shapes import Shape
from ..runtime.installing.verify import installation_mismatch

METRIC_PREFIX = "remat/"
# Said with every plan priced in measured seconds: its overhead moves from run to run on a busy machine.
MEASURED_TIME_NOTE = ("cost 'time': the overhead is in seconds measured on this machine, which vary from run to run "
                      "when it is busy (so may the plan); cost='flops' (counted, the same on every run; the CPU's "
                      "default) or cost='roofline' give figures that do not move")


def plan_metrics(plan: Plan, measured_peak_bytes: int | None = None) -> dict[str, float]:
    """The ``remat/...`` figures of a plan (and of its measured step); a figure the plan lacks is left out.

    >>> plan_metrics(Plan([], 100, 200, 90, 0.25), measured_peak_bytes=88)["remat/measured_peak_bytes"]
    88.0
    """
    metrics: dict[str, float] = {"num_checkpointed": len(plan.checkpointed)}
    figures = {"budget_bytes": plan.budget_bytes, "baseline_peak_bytes": plan.baseline_peak_bytes,
               "predicted_peak_bytes": plan.predicted_peak_bytes, "predicted_overhead": plan.predicted_overhead}
    metrics.update({name: value for name, value in figures.items() if value is not None})
    if plan.offloaded:
        metrics.update(offloaded_bytes=plan.host_bytes, host_bytes=plan.host_bytes)
    if plan.binding:
        # What binds, as loggers take it (numbers): a 1 under the term's name, and its bytes split.
        binding = plan.binding
        metrics[f"binds/{binding['term'].replace(' ', '_')}"] = 1
        metrics.update({f"binds/{part}_bytes": binding[f"{part}_bytes"] for part in ("static", "stored", "own")})
        metrics.update({f"binds/optimizer_{setting.replace('=', '_').lower()}_peak_bytes": peak
                        for setting, peak in (binding.get("advice") or {}).items()})
    if measured_peak_bytes is not None:
        metrics["measured_peak_bytes"] = measured_peak_bytes
    return {METRIC_PREFIX + k: float(v) for k, v in metrics.items()}


def over_budget(measured_peak_bytes: int, plan: Plan, what: str = "a training step",
                causes: Sequence[str | None] = ()) -> str | None:
    """The warning when a measured step peaked above the plan's budget, with ``causes`` (None skipped), or None.

    >>> plan = Plan([], budget_bytes=1000, baseline_peak_bytes=2000, predicted_peak_bytes=990, predicted_overhead=0.1)
    >>> print(over_budget(1100, plan, "step 7", [None, "this batch shape was not planned (...)"]))
    lightning-remat: step 7 peaked at 1.07 KiB (1100 bytes), above the budget of 1000 B (1000 bytes; predicted 990 B): this batch shape was not planned (...).
    """
    budget = plan.budget_bytes
    if budget is None or measured_peak_bytes <= budget:
        return None
    size = partial(format_in_units_of, plan.requested_budget)  # in the units the budget was given in
    over = (f"lightning-remat: {what} peaked at {size(measured_peak_bytes)} ({measured_peak_bytes} bytes), "
            f"above the budget of {size(budget)} ({budget} bytes")
    seen = "; ".join(dict.fromkeys(c for c in causes if c))
    if plan.fallback:  # no profile: nothing was predicted, and nothing more is recomputed than this
        return (f"{over}) under {FALLBACK_PLAN}, which predicts no peak. " + (f"{seen}. " if seen else "")
                + "Every candidate block is recomputed already: reduce the batch size, raise the budget, or name "
                "more candidates.")
    predicted = "" if plan.predicted_peak_bytes is None else f"; predicted {size(plan.predicted_peak_bytes)}"
    if seen:
        return f"{over}{predicted}): {seen}."
    return f"{over}{predicted}): memory the profile did not see. Lower the budget by the difference."


def installation_cause(model: nn.Module, plan: Plan) -> str | None:
    """Why a step ran outside its plan: what is installed on ``model`` is not ``plan``; None when it is."""
    mismatch = installation_mismatch(model, plan)
    return None if mismatch is None else f"the plan is not installed as planned ({mismatch})"


def shape_cause(plan: Plan, shape: Any) -> str | None:
    """Why a step ran outside its plan (a larger batch ``shape``), or None.

    >>> shape_cause(Plan(fingerprint={"shape": [8, 32]}), Shape(8, 40))
    'this batch shape was not planned (plan made for shape 8x32, batch is 8x40)'
    """
    made_for = plan.fingerprint.get("shape")
    if made_for is None or not isinstance(shape, Shape):
        return None
    planned = Shape(*made_for)
    if planned.covers(shape):
        return None
    return f"this batch shape was not planned (plan made for shape {planned}, batch is {shape})"


# What a plan made without a profile is, in every message that reports on it.
FALLBACK_PLAN = ("the fallback plan (every candidate block recomputed whole, made without a profile because profiling "
                 "ran out of memory or fake tensors cannot run the model)")
