"""The measured peak of a steady training step with the plan: its report, next to the prediction.

``AutoRemat`` meters one whole accumulation window (``PeakWindow``); ``report_measured_peak`` takes
the largest peak over the ranks (the budget holds on every one or it does not hold), logs it, and
warns when it is over the budget.
"""

from __future__ import annotations

from typing import Callable, Sequence

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ...core.budget import format_bytes
from ...core.plan import Plan
from ...runtime.measuring.measure import PeakWindow
from ...service.planning import FALLBACK_PLAN, over_budget
from .channel import lightning_channel


def figure(nbytes: int | None, other: int | None) -> str:
    """Bytes for a message; exact when rounding would make two different figures look equal (a
    figure a plan does not have, made without a profile, is "not predicted")."""
    if nbytes is None:
        return "not predicted"
    text = format_bytes(nbytes)
    return f"{text} ({nbytes} bytes)" if other is not None and nbytes != other and text == format_bytes(other) else text


def report_measured_peak(trainer: Trainer, plan: Plan, meter: PeakWindow, batch_idx: int, verbose: bool,
                         log_metrics: Callable[[Trainer, dict[str, float]], None],
                         causes: Sequence[str | None] = ()) -> int:
    """Close ``meter``, log the largest peak of any rank (and on CUDA the reserved peak beside it),
    warn when it is over the budget, with the ``causes`` seen (``over_budget``), or say it when
    ``verbose``; the measured peak."""
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
    warning = over_budget(measured_peak, plan, f"a steady training step (batch {batch_idx})", causes)
    if warning is not None:
        rank_zero_warn(message + ". " + warning)
    elif verbose:
        rank_zero_info(message)
    return measured_peak
