"""Plans that follow the batch's shape: one plan per shape bucket, made from predicted profiles (the first batch's,
the shape fit's nodes, calibrated by measured steps; ``docs/shapes.md``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from ..core.allowances import REAL_PROFILE_ALLOWANCE
from ..core.budget import format_bytes
from ..core.config import DEFAULT_COST, ProfileOptions, RematConfig
from ..core.errors import BudgetTooSmallError, FakeProfileError
from ..core.memory_model import Profile, priced, seconds_per_flop
from ..core.plan import Plan
from ..core.shape_fit import ShapeFit
from ..core.shapes import Shape
from ..runtime.installing.apply import apply_plan
from ..runtime.installing.compiled import runs_compiled
from ..runtime.installing.fingerprint import fingerprint
from ..runtime.installing.installer import check_installed
from ..runtime.measuring.measure import is_out_of_memory, model_device, release_device_memory
from ..runtime.profiling import profile as profiling
from ..runtime.profiling.batch_shape import batch_shape, padding, resize_batch
from ..runtime.profiling.profile_adjust import with_always_alive
from .planning import Planner, _first_line
from .shape_keys import ShapeKeys

PLAN_FOR = ("shape", "largest")
# Nodes of the shape fit (fake profiles) sit on a ladder of this many steps per doubling of the batch
# size and of the sequence length; plans are made at the (finer) buckets between them.
NODE_STEPS = 4
# Why a first batch got the fallback plan when its fake profile failed.
FAKE_FAILED = "fake tensors cannot run the model, and a real step without recomputation might not fit"
LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class ShapePlanCounts:
    """What following the batch's shape has cost so far (``calibrations``: measured steps above their prediction)."""

    real_profiles: int = 0
    fake_profiles: int = 0
    solves: int = 0
    installs: int = 0
    steps: int = 0
    calibrations: int = 0


class ShapePlans:
    """The plan for each batch's shape, solved once per shape bucket: ``use(batch)`` before each step's forward
    installs it (``plan(batch)`` only decides), ``calibrate(peak)`` after takes the measured peak (docs/shapes.md).

    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])
    >>> plans = ShapePlans(net, lambda m, x: m(x).square().mean(), budget="min", per_octave=0)
    >>> [len(plans.use(torch.randn(rows, 16)).checkpointed) > 0 for rows in (64, 256, 64)]
    [True, True, True]
    >>> plans.counts.real_profiles, plans.counts.solves  # two shapes, both planned on fake tensors
    (0, 2)
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, budget: int | str | None = None, *,
                 optimizer: torch.optim.Optimizer | None = None, cost: str | None = DEFAULT_COST, candidates: Any = None,
                 fake: bool | None = None, config: RematConfig | None = None, plan_for: str | None = None,
                 max_shape: Shape | tuple[int, int] | None = None, per_octave: int = 16,
                 shape_of: Callable[[Any], Shape | None] | None = None,
                 resize: Callable[[Any, Shape], Any] | None = None, adjust: Callable[[Profile], Profile] | None = None,
                 install: Callable[[nn.Module, Plan], Any] | None = None, channel: Any = None, hint: str = "",
                 warmup: int | None = None, verbose: bool = True):
        if config is None:
            if budget is None:
                raise ValueError("ShapePlans needs a budget (or a config)")
            # Not the config's ``fake`` (the first batch is faked): it would refuse cost="time".
            config = RematConfig(budget, cost=cost, profile=ProfileOptions(candidates=candidates))
        if plan_for is None:
            plan_for = "largest" if runs_compiled(model) else "shape"
        if plan_for not in PLAN_FOR:
            raise ValueError(f"plan_for must be one of {PLAN_FOR}, got {plan_for!r}")
        if isinstance(per_octave, bool) or not isinstance(per_octave, int) or per_octave < 0:
            raise ValueError(f"per_octave must be an int >= 0, got {per_octave!r}")
        self.model, self.loss_fn, self.optimizer, self.config = model, loss_fn, optimizer, config
        self.plan_for = plan_for
        self.max_shape = Shape(*max_shape) if isinstance(max_shape, tuple) else max_shape
        self.keys = ShapeKeys(plan_for, self.max_shape, per_octave)
        self.shape_of = shape_of or batch_shape
        self.resize = resize or (lambda batch, shape: resize_batch(batch, shape))
        self.adjust, self.install = adjust, install or apply_plan
        self.planner = Planner(config, verbose=verbose)
        self.config = self.planner.for_model(model)  # the cost the target's where unset: the fake nodes price by it
        self.counts = ShapePlanCounts()
        self.channel, self.hint, self.warmup = channel, hint, warmup
        self.real_first = fake is False  # the opt-in real profile of the first batch, where it fits
        self.anchor: tuple[Shape, Profile] | None = None  # the first batch's profile, and its shape
        self.fit: ShapeFit | None = None  # fake nodes, from the first shape other than the first batch's
        self.fallback: Plan | None = None  # profiling ran out of memory: every block recomputed, every shape
        self._seconds_per_flop: float | None = None
        self._timed = False  # whether seconds are measured ones (a real anchor, or a calibrated step)
        self.plans: dict[Shape, Plan] = {}  # bucket -> its plan
        self.sources: dict[Shape, str] = {}  # bucket -> its profile: "profile", "node", "chord", "saved"
        self.installed: Plan | None = None
        self._too_large: set[Shape] = set()  # buckets no plan fits: their batches are planned at their own shape
        self._stale: set[Shape] = set()  # buckets whose plan is solved again at their next batch (calibrated)
        self.fresh = False  # whether the last plan() decided its plan (a new bucket, or one solved again)
        self.unpadded = False  # whether the first batch's attention masks held no padding (``padding``)

    def use(self, batch: Any) -> Plan:
        """Install the plan for ``batch``'s shape (if not installed already), check it is installed, and return it."""
        plan = self.plan(batch)
        # Two plans with the same actions are one installation.
        if self.installed is None or tuple(plan.actions) != tuple(self.installed.actions):
            self.install(self.model, plan)
            self.counts.installs += 1
        self.installed = plan
        check_installed(self.model, plan, f"(ShapePlans.use, batch shape {self.shape_of(batch)}) {self.hint}".strip())
        return plan

    def plan(self, batch: Any) -> Plan:
        """The plan for ``batch``'s shape (the largest of the ranks'): cached per bucket, else decided on rank 0."""
        self.counts.steps += 1
        shape = self.shape_of(batch)
        if shape is None:
            raise ValueError(f"ShapePlans cannot read a batch shape from {type(batch).__name__}: pass shape_of=")
        if self.unpadded and padding(batch):
            # Planned from a batch without padding (no attention mask built): a padded one needs more.
            self.unpadded, self.anchor, self.fit, self.plans, self.sources = False, None, None, {}, {}
            self._stale, self._too_large = set(), set()
        shape = self.keys.meet(shape, self.channel)  # every rank: the largest of the ranks' shapes
        key = self.key(shape)
        self.fresh = key not in self.plans or key in self._stale
        if self.fresh:  # decided on rank 0, its outcome (or its error) on every rank
            if self.channel is None or not self.channel.distributed:
                made_for, plan = self._plan_at(batch, shape, key)
            else:
                made_for, plan = self.channel.from_main(lambda: self._plan_at(batch, shape, key),
                                                        action="planning for a batch shape", hint=self.hint)
            if made_for != key:  # no plan fits the bucket: its batches are planned at their own shape
                self._too_large.add(key)
            self._stale.difference_update((key, made_for))
            self.plans[made_for] = plan
            self.sources.setdefault(made_for, "shared")
            key = made_for
        return self.plans[key]

    def key(self, shape: Shape) -> Shape:
        """The shape ``shape``'s plan is made for: its own where a plan for it exists, else its bucket."""
        shape = self.keys.planned(shape)
        if shape in self.plans or shape in self._too_large:
            return shape
        key = self.keys.bucket(shape)
        return shape if key in self._too_large else key

    def seed(self, shape: Shape, plan: Plan) -> None:
        """Take ``plan`` (saved in a checkpoint) as the plan of ``shape``: its batches are not profiled again."""
        self.plans[shape] = plan
        self.sources.setdefault(shape, "saved")

    def profile_of(self, plan: Plan) -> Profile | None:
        """The profile ``plan`` was solved on (no profiling), or None (a fallback plan, or one seeded from a checkpoint)."""
        shape = plan.fingerprint.get("shape")
        if shape is None:
            return None
        key = Shape.from_list(shape)
        if self.anchor is not None and key == self.anchor[0]:
            return self.anchor[1]
        return self.fit.at(key) if self.fit is not None else None

    def _step(self, batch: Any) -> Callable[[nn.Module], torch.Tensor]:
        return lambda module: self.loss_fn(module, batch)

    def _plan_at(self, batch: Any, shape: Shape, key: Shape) -> tuple[Shape, Plan]:
        """The plan for ``key`` and the shape it is made for: the batch's own where the bucket fails to fit or profile."""
        try:
            if self.fallback is not None:
                return key, self.fallback
            if self.anchor is None and self.fit is None and not self.plans:
                self.unpadded = padding(batch) is False
                self._first(batch)
                if self.fallback is not None:
                    return key, self.fallback
            if self.anchor is not None and key == self.anchor[0]:
                profile, self.sources[key] = self.anchor[1], "profile"
            else:
                self._grow(batch, shape, key)
                profile = self.fit.at(key)
                self.sources[key] = "node" if key in self.fit.nodes else "chord"
            self.counts.solves += 1
            plan = self.planner.solve_profile(self.model, profile)
            # What it was made for: the model's parameters, the batch that asked for it, the shape planned.
            return key, replace(plan, fingerprint={**plan.fingerprint, **fingerprint(self.model, batch),
                                                   "shape": key.to_list()})
        except BudgetTooSmallError as error:
            if key == shape:
                if self.hint:
                    error.add_hint(self.hint)
                raise
            reason = f"no plan fits the budget at {key} ({error.smallest_peak_bytes} bytes at least)"
        except Exception as error:  # noqa: BLE001 - a model that refuses the stretched batch: its own shape then
            if key == shape or (self.fit is not None and key in self.fit.nodes):
                raise
            reason = f"profiling at {key} failed ({type(error).__name__}: {str(error)[:200]})"
        warnings.warn(f"lightning-remat: {reason}; batches of this bucket are planned at their own shape.",
                      UserWarning, stacklevel=3)
        known = shape in self.plans and shape not in self._stale
        return (shape, self.plans[shape]) if known else self._plan_at(batch, shape, shape)

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
        predicted = plan.predicted_peak_bytes if plan is not None else None
        excess = 0 if predicted is None else max(0, int(measured_peak_bytes) - int(predicted))  # above the prediction
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
            rate = None
            if reprice:  # seconds per FLOP of the measured step; None where the profile counts no FLOPs
                flops = (self.profile_of(plan) or anchor).baseline_costs.flops * (1 + (plan.predicted_overhead or 0.0))
                rate = seconds_per_flop(seconds, flops) if flops > 0 and seconds > 0 else None
            if rate is not None:
                self._seconds_per_flop = rate
                anchor, nodes = priced(anchor, rate), {s: priced(n, rate) for s, n in nodes.items()}
            if excess:
                anchor = with_always_alive(anchor, excess, (
                    f"calibrated by a measured step: it peaked {format_bytes(excess)} ({excess} bytes) above the "
                    "plan's prediction (memory the profile did not see: on a GPU the allocator's rounding and library "
                    "workspaces, or code outside the profiled step); counted in every term"))
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
