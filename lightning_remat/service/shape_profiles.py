"""The profiles ``ShapePlans`` plans on: the first batch's, the shape fit's nodes, calibrated by measured steps."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

from ..core.allowances import REAL_PROFILE_ALLOWANCE
from ..core.budget import format_bytes
from ..core.errors import FakeProfileError
from ..core.memory_model import Profile, priced, seconds_per_flop
from ..core.plan import Plan
from ..core.shape_fit import ShapeFit
from ..core.shapes import Shape
from ..runtime.measuring.measure import is_out_of_memory, model_device, release_device_memory
from ..runtime.profiling import profile as profiling
from ..runtime.profiling.profile_adjust import with_always_alive
from .planning import _first_line

# Nodes of the shape fit (fake profiles) sit on a ladder of this many steps per doubling of the batch
# size and of the sequence length; plans are made at the (finer) buckets between them.
NODE_STEPS = 4
# Why a first batch got the fallback plan when its fake profile failed.
FAKE_FAILED = "fake tensors cannot run the model, and a real step without recomputation might not fit"


class ShapeProfiles:
    """The profiling half of ``ShapePlans``: the first batch's profile, the fit's nodes, calibration."""

    # Set by ShapePlans.__init__.
    anchor: tuple[Shape, Profile] | None
    fit: ShapeFit | None
    fallback: Plan | None
    installed: Plan | None
    plans: dict
    _stale: set
    _seconds_per_flop: float | None
    _timed: bool

    def _first(self, batch: Any) -> None:
        """Profile the first batch on fake tensors as the anchor (a real profile with ``fake=False`` where it fits)."""
        shape = self.shape_of(batch)
        try:
            node = self._fake_profile(batch, shape)
        except Exception as error:  # noqa: BLE001 - re-raised unless the fallback plan is the answer
            if not isinstance(error, FakeProfileError) and not is_out_of_memory(error):
                raise
            cause = (FAKE_FAILED if isinstance(error, FakeProfileError) else "out of memory while profiling")
            reason = f"{type(error).__name__}: {_first_line(error)}"
        else:
            anchor = self.adjust(node) if self.adjust else node
            real = self._real_profile(batch) if self.real_first and self._plain_step_fits(anchor) else None
            if real is not None:
                self._seconds_per_flop = seconds_per_flop(real.baseline_costs.time, real.baseline_costs.flops)
                self._timed = True
                node, anchor = priced(node, self._seconds_per_flop), real
            self.fit = ShapeFit({shape: node}, anchor=(shape, anchor) if anchor is not node else None)
            self.anchor = (shape, anchor)
            return
        # Outside the except block: the traceback no longer pins the failed pass's tensors.
        self.fallback = self.planner.fallback_plan(self.model, reason, cause=cause)

    def _plain_step_fits(self, anchor: Profile) -> bool:
        """Whether the plain step the real profile runs is predicted to fit the budget; warns when not."""
        budget = self.config.budget_bytes(model_device(self.model))
        needed = anchor.baseline_peak_bytes + REAL_PROFILE_ALLOWANCE
        if isinstance(budget, int) and needed <= budget:
            return True
        warnings.warn(f"lightning-remat: fake=False: the first batch is not profiled for real: its step without "
                      f"recomputation is predicted to peak at {format_bytes(needed)} with the profiler's own "
                      f"tensors, {'above the budget' if isinstance(budget, int) else 'and the budget is min'}"
                      "; it is planned on its fake-tensor profile (costs: counted FLOPs).", UserWarning, stacklevel=7)
        return False

    def calibrate(self, measured_peak_bytes: int, plan: Plan | None = None, seconds: float | None = None) -> bool:
        """Take a measured step into account (every rank; ``seconds`` price fakes under "time"); whether re-solved."""
        plan = plan or self.installed
        excess = measured_excess(plan, measured_peak_bytes) if plan is not None else 0
        reprice = seconds is not None and self.config.cost == "time" and not self._timed
        if plan is None or self.fallback is not None or not (excess or reprice):
            return False
        nodes = self.fit.nodes if self.fit is not None else {}
        base = self.anchor or (next(iter(nodes.items())) if nodes else None)
        if base is None and (self.channel is None or not self.channel.distributed):
            return False  # nothing was profiled here (plans seeded from a checkpoint): nothing to correct
        self._timed = self._timed or reprice
        if base is not None:  # one process, or rank 0 (which profiles and solves for every rank)
            shape, anchor = base
            rate = measured_rate(plan, self.profile_of(plan) or anchor, seconds) if reprice else None
            if rate is not None:
                self._seconds_per_flop = rate
                anchor, nodes = priced(anchor, rate), {s: priced(n, rate) for s, n in nodes.items()}
            if excess:
                anchor = with_measured_excess(anchor, excess)
            self.anchor = (shape, anchor)
            self.fit = ShapeFit(nodes, anchor=self.anchor) if nodes else None
        self.counts.calibrations += bool(excess)
        self._stale.update(self.plans)  # each solved again at its next batch (``fresh`` then says so)
        return True

    def _grow(self, batch: Any, shape: Shape, key: Shape) -> None:
        """Make the fit bracket ``key``: a node at the anchor's shape or at ``key``, then the missing ladder nodes."""
        if self.fit is None and self.anchor is not None and self.anchor[0].comparable(shape):
            anchor_shape, anchor = self.anchor
            self.fit = ShapeFit({anchor_shape: self._fake_profile(batch, anchor_shape)}, anchor=self.anchor)
        elif self.fit is None:
            # Nothing was profiled (a seeded plan), or this batch cannot be stretched to the first batch's
            # layout: start at ``key``, anchored on its own fake node.
            node = self._fake_profile(batch, key)
            self.fit = ShapeFit({key: node}, anchor=(key, self.adjust(node)) if self.adjust else None)
        for node in self.fit.missing_nodes(key, NODE_STEPS, self.max_shape):
            self.fit = self.fit.with_node(node, self._fake_profile(batch, node))
        if not self.fit.bounded(key):  # not reached with ladder nodes; a node at the bucket itself is exact
            self.fit = self.fit.with_node(key, self._fake_profile(batch, key))

    def _real_profile(self, batch: Any) -> Profile | None:
        """The first batch profiled for real (``adjust`` applied); None after an out-of-memory error."""
        self.counts.real_profiles += 1
        try:
            return self.planner.profile(self.model, self._step(batch), self.optimizer, adjust=self.adjust,
                                        warmup=self.warmup)
        except Exception as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
            if not is_out_of_memory(error):
                raise
            reason = f"{type(error).__name__}: {_first_line(error)}"
        release_device_memory()  # outside the except block: the traceback no longer pins the step's tensors
        warnings.warn(f"lightning-remat: out of memory while profiling the first batch ({reason}); plans are made "
                      "on fake-tensor profiles alone.", UserWarning, stacklevel=7)
        return None

    def _fake_profile(self, batch: Any, at: Shape) -> Profile:
        """A node: the step on ``batch`` stretched to ``at``, profiled on fake tensors and priced."""
        stretched = batch if at == self.shape_of(batch) else self.resize(batch, at)
        options = replace(self.config.profile, fake=True, warmup=0,
                          device=self.config.profile.device or str(model_device(self.model)))
        self.counts.fake_profiles += 1
        with self.planner.progress(self.model, fake=True):
            try:
                profile = profiling.profile_step(self.model, self._step(stretched), optimizer=self.optimizer,
                                                 options=options)
            except FakeProfileError as error:  # a fake pass of ours, not the user's: fake=False is no advice
                raise error if self.config.profile.fake else FakeProfileError(error.op, error.detail, requested=False)
        # Before a timed step: FLOPs stand in for seconds (an overhead is a ratio, the same in either).
        rate = self._seconds_per_flop or (1e-12 if self.config.cost != "flops" else None)
        return priced(profile, rate) if rate else profile


def measured_excess(plan: Plan, measured_peak_bytes: int) -> int:
    """Bytes a measured step under ``plan`` peaked above its prediction (0 if not, or nothing was predicted)."""
    predicted = plan.predicted_peak_bytes
    return 0 if predicted is None else max(0, int(measured_peak_bytes) - int(predicted))


def with_measured_excess(profile: Profile, excess: int) -> Profile:
    """``profile`` with ``excess`` bytes more in every term."""
    return with_always_alive(profile, excess, (
        f"calibrated by a measured step: it peaked {format_bytes(excess)} ({excess} bytes) above the plan's "
        "prediction (memory the profile did not see: on a GPU the allocator's rounding and library workspaces, "
        "or code outside the profiled step); counted in every term"))


def measured_rate(plan: Plan, profile: Profile, seconds: float) -> float | None:
    """Seconds per FLOP of a step measured at ``seconds`` under ``plan``; None when the profile counts no FLOPs."""
    flops = profile.baseline_costs.flops * (1.0 + (plan.predicted_overhead or 0.0))
    return seconds_per_flop(seconds, flops) if flops > 0 and seconds > 0 else None

