"""Plans that follow the batch's shape: one plan per shape bucket, made from predicted profiles (``docs/shapes.md``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from ..core.config import DEFAULT_COST, ProfileOptions, RematConfig
from ..core.errors import BudgetTooSmallError
from ..core.memory_model import Profile
from ..core.plan import Plan
from ..core.shape_fit import ShapeFit
from ..core.shapes import Shape
from ..runtime.installing.apply import apply_plan
from ..runtime.installing.compiled import runs_compiled
from ..runtime.installing.fingerprint import fingerprint
from ..runtime.installing.verify import check_installed
from ..runtime.profiling.batch_shape import batch_shape, padding, resize_batch
from .planning import Planner
from .shape_keys import ShapeKeys
from .shape_profiles import ShapeProfiles

PLAN_FOR = ("shape", "largest")
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


class ShapePlans(ShapeProfiles):
    """The plan for each batch's shape, solved once per shape bucket: ``use(batch)`` before each step's forward
    installs it (``plan(batch)`` only decides), ``calibrate(peak)`` after takes the measured peak (docs/shapes.md).

    >>> import torch
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
                plan = self._plan_at(batch, shape, key)
            else:
                plan = self.channel.from_main(lambda: self._plan_at(batch, shape, key),
                                              action="planning for a batch shape", hint=self.hint)
            self._stale.discard(key)
            key = self._settle(key, shape, plan)
            self._stale.discard(key)
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

    def predict(self, shape: Shape | tuple[int, int]) -> Profile:
        """The profile predicted at ``shape`` (no profiling); only once a shape other than the first batch's was planned."""
        if self.fit is None:
            raise RuntimeError("ShapePlans.predict needs the fit: plan a batch of another shape than the first")
        if isinstance(shape, tuple):
            shape = Shape(*shape, self.anchor[0].layout if self.anchor is not None else ())
        return self.fit.at(shape)

    def profile_of(self, plan: Plan) -> Profile | None:
        """The profile ``plan`` was solved on (no profiling), or None (a fallback plan, or one seeded from a checkpoint)."""
        shape = plan.fingerprint.get("shape")
        if shape is None:
            return None
        key = Shape.from_list(shape)
        if self.anchor is not None and key == self.anchor[0]:
            return self.anchor[1]
        return self.fit.at(key) if self.fit is not None else None

    def _settle(self, key: Shape, shape: Shape, outcome: tuple[Shape, Plan]) -> Shape:
        made_for, plan = outcome
        if made_for != key:  # no plan fits the bucket: its batches are planned at their own shape
            self._too_large.add(key)
        self.plans[made_for] = plan
        self.sources.setdefault(made_for, "shared")
        return made_for

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
