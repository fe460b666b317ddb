"""The measured peak of a training step with the plan: its report, next to the prediction, and the
calibration of the plans by it.

``AutoRemat`` meters the first batch under the first plan and one whole steady accumulation window
(``MeasuredWindow``: the package's meter, ``PeakWindow``, with the plans the batches ran under and
the wall time); ``report_measured_peak`` takes the largest peak over the ranks (the budget holds on
every one or it does not hold), logs it, and warns when it is over the budget; ``MeasuredWindow.calibrate``
hands the peak (and, for ``cost="time"``, the seconds per batch) to ``ShapePlans.calibrate``, which
solves the plans again before the next batch when the peak was above its prediction.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ...core.budget import format_bytes
from ...core.plan import Plan
from ...runtime.measuring.measure import PeakWindow
from ...service.plan_figures import installation_cause, shape_cause
from ...service.planning import FALLBACK_PLAN, over_budget
from .channel import lightning_channel


class MeasuredWindow:
    """The package's peak meter over one or more batches, the plans they ran under and its wall time.

    Example:
        >>> import torch
        >>> from lightning_remat.core.plan import Plan
        >>> net = torch.nn.Linear(8, 8)
        >>> plan = Plan([], budget_bytes=10**6, baseline_peak_bytes=900, predicted_peak_bytes=900, predicted_overhead=0.0)
        >>> window = MeasuredWindow(net, None, plan)
        >>> net(torch.randn(4, 8)).sum().backward()
        >>> window.meter.close() > 0, window.plan is plan
        (True, True)
    """

    def __init__(self, model: Any, optimizers: Any, plan: Plan, batches: int = 1, shape: Any = None):
        self.meter = PeakWindow(model, optimizers)
        self.metered = [(plan, shape)]  # the window's batches: (their plan, their shape)
        self.batches = batches
        self.started = time.perf_counter()

    def ran(self, plan: Plan, shape: Any = None) -> None:
        """A batch of the window runs under ``plan``, at ``shape``."""
        self.metered.append((plan, shape))

    @property
    def plan(self) -> Plan:
        """The plan of the highest predicted peak the window ran under: what its peak is held to."""
        return max((p for p, _ in self.metered), key=lambda p: -1 if p.predicted_peak_bytes is None
                   else p.predicted_peak_bytes)

    def causes(self, model: Any) -> list[str | None]:
        """What the package can see of a window over the budget: the plan not installed as planned,
        a batch whose shape was not planned (``plan_figures``)."""
        installed = self.metered[-1][0]
        return [installation_cause(model, installed), *(shape_cause(p, shape) for p, shape in self.metered)]

    def calibrate(self, shape_plans: Any, measured_peak: int, timed: bool) -> bool:
        """``shape_plans.calibrate`` with the window's peak (the largest of the ranks': the same on
        every rank) and, when ``timed``, its seconds per batch. Whether the plans are solved again."""
        seconds = (time.perf_counter() - self.started) / self.batches if timed else None
        return shape_plans is not None and shape_plans.calibrate(measured_peak, self.plan, seconds=seconds)

    def abandon(self) -> None:
        self.meter.abandon()


def figure(nbytes: int | None, other: int | None) -> str:
    """Bytes for a message; exact when rounding would make two different figures look equal (a
    figure a plan does not have, made without a profile, is "not predicted")."""
    if nbytes is None:
        return "not predicted"
    text = format_bytes(nbytes)
    return f"{text} ({nbytes} bytes)" if other is not None and nbytes != other and text == format_bytes(other) else text


def report_measured_peak(trainer: Trainer, plan: Plan, meter: PeakWindow, batch_idx: int, verbose: bool,
                         log_metrics: Callable[[Trainer, dict[str, float]], None],
                         causes: Sequence[str | None] = (), calibrate: Callable[[int], bool] | None = None) -> int:
    """Close ``meter``, log the largest peak of any rank (and on CUDA the reserved peak beside it),
    ``calibrate`` the plans with it, warn when it is over the budget, with the ``causes`` seen
    (``over_budget``), or say it when ``verbose``; the measured peak."""
    channel = lightning_channel(trainer)
    # The largest peak of any rank: the budget holds on every one or it does not hold.
    measured_peak = int(channel.max(meter.close()))
    measured = {"remat/measured_peak_bytes": float(measured_peak)}
    if meter.reserved_bytes is not None:
        # On CUDA: what the caching allocator held beside it (fragmentation included).
        measured["remat/measured_reserved_bytes"] = channel.max(meter.reserved_bytes)
    log_metrics(trainer, measured)
    # A fallback plan (no profile) predicted nothing, and a "min" budget never became bytes.
    predicted = ("no prediction" if plan.fallback
                 else f"predicted {figure(plan.predicted_peak_bytes, plan.budget_bytes)}")
    budget = figure(plan.budget_bytes, measured_peak) if plan.budget_bytes is not None else repr(plan.requested_budget)
    message = (f"AutoRemat: measured peak of a steady training step with "
               f"{FALLBACK_PLAN if plan.fallback else 'the plan'}"
               f"{' (a whole accumulation window)' if trainer.accumulate_grad_batches > 1 else ''}: "
               f"{figure(measured_peak, plan.budget_bytes)} ({predicted}, budget {budget})")
    calibrated = calibrate(measured_peak) if calibrate is not None else False
    warning = over_budget(measured_peak, plan, f"a steady training step (batch {batch_idx})", causes)
    if warning is not None:
        rank_zero_warn(message + ". " + warning + (" The plans are solved again with it (calibrated) before the "
                                                   "next batch." if calibrated else ""))
    elif verbose:
        rank_zero_info(message)
    return measured_peak
