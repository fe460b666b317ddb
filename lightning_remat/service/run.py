"""One run lifecycle (plan, install, measure, report) that the integrations drive through a ``RunHost``; what it
reports of a plan: the ``remat/...`` figures, and the over-budget warning with its causes."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Sequence

from torch import nn

from ..core.budget import format_in_units_of
from ..core.plan import Plan, saved_plans, saved_state_plans
from ..core.shapes import Shape
from ..runtime.installing.apply import apply_plan
from ..runtime.installing.fingerprint import fingerprint
from ..runtime.installing.installer import installation_mismatch
from ..runtime.measuring.measure import PeakWindow
from .channel import Channel
from .planning import Planner
from .shape_plans import ShapePlans

logger = logging.getLogger(__name__)


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
    return {"remat/" + k: float(v) for k, v in metrics.items()}


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


@dataclass
class RunHost:
    """What a training loop gives the lifecycle, as callables (``step_for(batch)`` -> ``step(module) -> loss``);
    ``summary``: figures summarise the run (Accelerate's ``remat_metrics``), not each plan as it comes; ``hint``:
    where the budget was given, added to the planner's errors."""

    model: nn.Module
    step_for: Callable[[Any], Callable[[nn.Module], Any]] | None = None
    channel: Callable[[], Channel] = Channel
    optimizers: Callable[[], Any] = lambda: None
    accumulation: Callable[[], int] = lambda: 1
    log: Callable[[dict[str, float]], None] = lambda figures: None
    info: Callable[[str], None] = logger.info
    warn: Callable[[str], None] = logger.warning
    table: Callable[[Plan, str], None] | None = None
    name: str = "lightning-remat"
    summary: bool = False
    hint: str = ""


class MeasuredWindow:
    """The package's peak meter over one or more batches, the plans they ran under and its wall time."""

    def __init__(self, meter: PeakWindow, plan: Plan | None = None, batches: int = 1, shape: Any = None):
        self.meter = meter
        self.metered = [(plan, shape)] if plan is not None else []  # the window's batches: (plan, shape)
        self.batches = batches
        self.started = time.perf_counter()
        self.installed = plan  # the plan installed when the window closes

    def ran(self, plan: Plan | None, shape: Any = None) -> None:
        """A batch of the window runs under ``plan``, at ``shape``."""
        if plan is not None:
            self.metered.append((plan, shape))
            self.installed = plan

    @property
    def plan(self) -> Plan:
        """The plan of the highest predicted peak the window ran under: what its peak is held to."""
        return max((p for p, _ in self.metered), key=lambda p: -1 if p.predicted_peak_bytes is None
                   else p.predicted_peak_bytes)

    def calibrate(self, shape_plans: Any, measured_peak: int, timed: bool) -> bool:
        """``shape_plans.calibrate`` with the window's peak (the ranks' largest) and, when ``timed``, its seconds."""
        seconds = (time.perf_counter() - self.started) / self.batches if timed else None
        return shape_plans is not None and shape_plans.calibrate(measured_peak, self.plan, seconds=seconds)


def _figure(nbytes: int | None, other: int | None, units: Any = None) -> str:
    # In the units of the budget ``units`` as given; exact bytes when rounding would make two figures look equal.
    if nbytes is None:
        return "not predicted"
    text = format_in_units_of(units, nbytes)
    equal = other is not None and nbytes != other and text == format_in_units_of(units, other)
    return f"{text} ({nbytes} bytes)" if equal else text


class RunLifecycle:
    """A run's plans (one per batch shape), their figures (``metrics``, updated in place) and measured windows.

    >>> import torch
    >>> net = nn.Sequential(nn.Linear(8, 8))
    >>> logged = []
    >>> run = RunLifecycle(RunHost(net, log=logged.append, name="demo"))
    >>> plan = Plan([], budget_bytes=10**6, baseline_peak_bytes=900, predicted_peak_bytes=900, predicted_overhead=0.0)
    >>> run.announce(plan, "a plan")
    >>> window = run.window(plan)
    >>> net(torch.randn(4, 8)).sum().backward()
    >>> run.finish(window, "step 1") > 0, sorted(logged[-1])
    (True, ['remat/measured_peak_bytes'])
    """

    def __init__(self, host: RunHost):
        self.host = host
        self.plan: Plan | None = None
        self.plans: list[Plan] = []
        self.metrics: dict[str, float] = {}
        self.shape_plans: Any = None
        self.saved: dict[Shape, Plan] = {}  # a checkpoint's plans per shape: seeded into the next ShapePlans
        self.profiles = 0  # profiling passes run for the run's plans (real and fake)
        self.measure_in: int | None = None  # batches until the measured window starts (batch-driven hosts)
        self._window_left = 0
        self._meter: MeasuredWindow | None = None  # the first steady window of a plan
        self._first: MeasuredWindow | None = None  # the first batch under the first plan (calibration)

    def config(self, config: Any, buckets: bool, **profile: Any) -> Any:
        """``config`` for this loop: its accumulation, ``buckets`` (DDP's gradient buckets), ``profile`` options."""
        return replace(config, profile=replace(config.profile, accumulation_steps=max(1, self.host.accumulation()),
                                               gradient_buckets=buckets, **profile))

    def shapes(self, config: Any, saved: dict | None = None, **options: Any) -> ShapePlans:
        """The run's ``ShapePlans`` on the host's step, ranks and optimizers, seeded with ``saved`` (None: its own)."""
        found = self.host.optimizers()
        if isinstance(found, (list, tuple)):  # one optimizer as itself, several as a list, none as None
            found = found[0] if len(found) == 1 else list(found) or None
        self.shape_plans = ShapePlans(self.host.model, lambda module, batch: self.host.step_for(batch)(module),
                                      config=config, optimizer=found, channel=self.host.channel(),
                                      hint=self.host.hint, **options)
        for shape, plan in (self.saved if saved is None else saved).items():
            self.shape_plans.seed(shape, plan)
        return self.shape_plans

    def state_dict(self) -> dict[str, Any]:
        """The plans as a checkpoint keeps them: the latest, and one per batch shape (none followed yet: ``saved``)."""
        plans = self.shape_plans.plans if self.shape_plans is not None else self.saved
        return {"plan": self.plan.to_dict() if self.plan is not None else None, "plans": saved_state_plans(plans)}

    def load_state_dict(self, state: dict[str, Any], owner: str) -> Plan | None:
        """Keep a checkpoint's plans per shape in ``saved`` (all checked first, errors naming ``owner``); its latest."""
        plan, plans = saved_plans(state, owner)
        self.saved = dict(plans)
        return plan

    def follow(self, batch: Any) -> bool:
        """Install the plan for ``batch``'s shape; whether it was decided now."""
        counts = self.shape_plans.counts
        before = counts.real_profiles + counts.fake_profiles
        self.plan = self.shape_plans.use(batch)
        self.profiles += counts.real_profiles + counts.fake_profiles - before
        return self.shape_plans.fresh

    def plan_shared(self, config: Any, step: Any, batch: Any = None, verbose: bool = True, **options: Any) -> Plan:
        """One plan from a real profile on every rank in lockstep (FSDP2 has no fake twin), installed on every rank."""
        plan = Planner(config, verbose=verbose).shared_plan(self.host.model, step, self.host.optimizers() or None,
                                                             channel=self.host.channel(), hint=self.host.hint,
                                                             **options)
        if batch is not None:
            plan = replace(plan, fingerprint={**plan.fingerprint, **fingerprint(self.host.model, batch)})
        self.profiles += 1
        apply_plan(self.host.model, plan)
        self.plan = plan
        return plan

    def announce(self, plan: Plan, title: str | None = None, full: bool = True) -> None:
        """Take ``plan`` as the run's latest, log its figures and show it (``full=False``: one line; no ``title``: not)."""
        # One plan per shape: a plan made again for a shape (observed, calibrated) replaces its first.
        self.plan, shape = plan, plan.fingerprint.get("shape")
        self.plans[:] = [p for p in self.plans if p.fingerprint.get("shape") != shape] + [plan]
        largest = max(self.plans, key=lambda p: p.predicted_peak_bytes or 0)
        for key in [k for k in self.metrics if not k.startswith("remat/measured_")]:
            del self.metrics[key]  # in place: a host may hand this dict out (accelerator.remat_metrics)
        self.metrics.update({**plan_metrics(largest), "remat/num_plans": len(self.plans)})
        self.host.log(dict(self.metrics) if self.host.summary else plan_metrics(plan))
        if title is None:
            return
        if full:
            (self.host.table or (lambda p, t: self.host.info(f"{t}:\n{p.summary()}")))(plan, title)
        else:
            self.host.info(f"{self.host.name}: {title}: {len(plan.checkpointed)} module(s) recomputed, "
                           f"predicted peak {_figure(plan.predicted_peak_bytes, plan.budget_bytes)}")

    def window(self, plan: Plan | None = None, batches: int = 1, shape: Any = None,
               meter: PeakWindow | None = None) -> MeasuredWindow:
        """A measured window from now over ``batches`` batches, the first under ``plan`` at ``shape``."""
        meter = meter if meter is not None else PeakWindow(self.host.model, self.host.optimizers() or None)
        return MeasuredWindow(meter, plan, batches, shape)

    def finish(self, window: MeasuredWindow, what: str) -> int:
        """Close a measured window: log the ranks' largest peak, calibrate, warn when over the budget; the peak."""
        channel = self.host.channel()
        # The largest peak of any rank: the budget holds on every one or it does not hold.
        peak = int(channel.max(window.meter.close()))
        measured = {"remat/measured_peak_bytes": float(peak)}
        if window.meter.reserved_bytes is not None:
            # On CUDA: what the caching allocator held beside it (fragmentation included).
            measured["remat/measured_reserved_bytes"] = float(channel.max(window.meter.reserved_bytes))
        run = {k: max(v, self.metrics.get(k, 0)) for k, v in measured.items()}  # the run's largest
        self.metrics.update(run)
        self.host.log(run if self.host.summary else measured)
        plan = window.plan
        calibrated = window.calibrate(self.shape_plans, peak, timed=True)
        # A fallback plan (no profile) predicted nothing, and a "min" budget never became bytes.
        units = plan.requested_budget
        predicted = ("no prediction" if plan.fallback else
                     f"predicted {_figure(plan.predicted_peak_bytes, plan.budget_bytes, units)}")
        budget = _figure(plan.budget_bytes, peak, units) if plan.budget_bytes is not None else repr(units)
        message = (f"{self.host.name}: measured peak of a steady training step with "
                   f"{FALLBACK_PLAN if plan.fallback else 'the plan'}"
                   f"{' (a whole accumulation window)' if self.host.accumulation() > 1 else ''}: "
                   f"{_figure(peak, plan.budget_bytes, units)} ({predicted}, budget {budget})")
        # What explains a window over the budget: the plan not installed, a batch shape not planned.
        mismatch = installation_mismatch(self.host.model, window.installed)
        causes = [None if mismatch is None else f"the plan is not installed as planned ({mismatch})",
                  *(shape_cause(p, shape) for p, shape in window.metered)]
        warning = over_budget(peak, plan, what, causes)
        if warning is not None:
            self.host.warn(message + ". " + warning + (" The plans are solved again with it (calibrated) before "
                                                       "the next batch." if calibrated else ""))
        else:
            self.host.info(message)
        return peak

    def measure_after(self, batches: int) -> None:
        """Measure the first whole accumulation window at least ``batches`` batches on, unless one is due."""
        if self._meter is None and self.measure_in is None:
            window = max(1, self.host.accumulation())
            self.measure_in = -(-batches // window) * window

    def before_batch(self, batch_idx: int, shape: Any, calibrate: bool = False) -> None:
        """A batch starts: open windows count it; ``calibrate`` meters it alone; a window due opens."""
        for measured in (self._first, self._meter):
            if measured is not None:
                measured.ran(self.plan, shape)
        if calibrate:
            self._first = self.window(self.plan)
        window = max(1, self.host.accumulation())
        if self.measure_in is not None:
            if self.measure_in > 0:
                self.measure_in -= 1
            elif batch_idx % window == 0:
                # One meter over a whole accumulation window: every micro-batch and the optimizer step.
                self.measure_in, self._window_left = None, window
                self._meter = self.window(self.plan, window, shape)

    def after_batch(self, what: str) -> int | None:
        """A batch ended: close due windows; the measured peak when a measured window closed."""
        if self._first is not None:  # the largest peak of the ranks, above its prediction, calibrates the plans
            first, self._first = self._first, None
            first.calibrate(self.shape_plans, int(self.host.channel().max(first.meter.close())), timed=False)
        if self._meter is None:
            return None
        self._window_left -= 1
        if self._window_left > 0:
            return None
        window, self._meter = self._meter, None
        return self.finish(window, what)

    def abandon(self) -> None:
        """Close the open windows without a report (an exception, the end of the fit)."""
        for measured in (self._meter, self._first):
            if measured is not None:
                measured.meter.abandon()
        self._meter = self._first = None
