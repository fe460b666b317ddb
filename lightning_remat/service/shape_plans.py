"""Plans that follow the batch's shape: one plan per shape bucket, made from predicted profiles.

A plan is made from a profile at one batch shape; a run changes shape every step (dynamic padding,
the last short batch). ``ShapePlans`` gives each step the plan for its own shape (``docs/shapes.md``
says how): the first batch is profiled on fake tensors and planned before it runs (the *anchor*;
a model fake tensors cannot run gets the fallback plan); each batch's shape is rounded up to a
bucket (``ShapeBuckets``: 16 per doubling of each size that varies) whose plan is predicted from
fake-tensor profiles at a few shapes (``core.shape_fit``), solved once and installed between steps
when it changes; ``calibrate(measured_peak)`` adds a measured step's excess over its prediction to
the anchor and solves every plan again. No step runs without a plan, and none runs without
recomputation to be profiled. ``counts`` says what it cost; ``plan_for="largest"`` (for
``torch.compile``, which recompiles at every change of plan) plans every batch for the largest shape met.

Example:
    >>> import torch
    >>> block = lambda: nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    >>> model = nn.Sequential(nn.Embedding(64, 16), *[block() for _ in range(4)])
    >>> plans = ShapePlans(model, lambda m, ids: m(ids).square().mean(), budget="min")
    >>> for length in (16, 40, 24):
    ...     ids = torch.randint(0, 64, (2, length))
    ...     plan = plans.use(ids)                       # before the forward pass
    ...     model(ids).square().mean().backward()
    >>> plans.counts.real_profiles, sorted(str(shape) for shape in plans.plans)  # buckets: 1/16 octave
    (0, ['2x16', '2x24', '2x40'])
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from ..core.config import ProfileOptions, RematConfig
from ..core.errors import BudgetTooSmallError
from ..core.memory_model import Profile
from ..core.plan import Plan
from ..core.shape_fit import ShapeFit
from ..core.shapes import Shape
from ..runtime.installing.apply import apply_plan
from ..runtime.installing.compiled import runs_compiled
from ..runtime.installing.fingerprint import fingerprint
from ..runtime.installing.verify import check_installed
from ..runtime.profiling.batch_shape import batch_shape, resize_batch
from .planning import Planner
from .shape_keys import ShapeKeys
from .shape_profiles import ShapeProfiles

PLAN_FOR = ("shape", "largest")
LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class ShapePlanCounts:
    """What following the batch's shape has cost so far.

    Attributes:
        real_profiles: profiles of a real step (each runs the step without recomputation): 0, or 1
            with ``fake=False`` where the plain step is predicted to fit.
        fake_profiles: profiles on fake tensors (nodes of the shape fit; no memory allocated).
        solves: plans solved (one per bucket met).
        installs: times a plan was installed on the model (the first, and each change of plan).
        steps: batches seen.
        calibrations: measured steps that peaked above their plan's prediction (each re-solves the plans).

    Example:
        >>> ShapePlanCounts().real_profiles
        0
    """

    real_profiles: int = 0
    fake_profiles: int = 0
    solves: int = 0
    installs: int = 0
    steps: int = 0
    calibrations: int = 0


def _signature(plan: Plan) -> tuple:
    """What an installed plan changes on the model: two plans with the same actions are one installation."""
    return tuple(plan.actions)


class ShapePlans(ShapeProfiles):
    """The plan for each batch's shape: predicted, solved once per shape bucket, installed when it changes.

    Call ``use(batch)`` before each training step's forward pass (``plan(batch)`` decides without
    installing; ``fresh`` then says whether it decided a plan), and ``calibrate(peak)`` with a
    step's measured peak after it (optional: a step over its prediction re-solves the plans).

    Args:
        model: the model, in training mode.
        loss_fn: ``loss_fn(model, batch)`` runs the forward pass on ``batch`` and returns the loss
            (the profiles call it on fake copies of ``model`` and of ``batch`` at other shapes).
        budget: as ``parse_budget``: ``"10GB"``, bytes, ``"80%"``, ``"min"``. Or pass ``config``.
        optimizer: counted in the budget (its state and its step).
        cost: ``"flops"`` (counted FLOPs: the same plans on every run), ``"time"`` (counted FLOPs
            at the seconds per FLOP of the first step ``calibrate`` is given a time for) or ``"roofline"``.
        candidates: None for automatic stages, or module classes / name patterns.
        fake: None or True: the first batch is profiled on fake tensors (no real profiling pass).
            False: the first batch is also profiled for real (measured timings, carried to every
            shape), only where the fake profile predicts that its plain step fits the budget;
            elsewhere the fake profile stands, with a warning.
        config: a ``RematConfig`` instead of ``budget``, ``cost`` and ``candidates``.
        plan_for: ``"shape"`` (each bucket its own plan: a short batch does not pay for a long
            one's recompute) or ``"largest"`` (every batch planned for the largest shape met so far
            and ``max_shape``: the plan changes only when that grows, for ``torch.compile``, which
            recompiles at every change of plan). None: ``"largest"`` for a model that runs compiled
            (``runs_compiled``: a ``torch.compile`` wrapper, a module compiled in place, Lightning's
            compiled module), else ``"shape"``.
        max_shape: the largest ``Shape`` (or ``(batch_size, seq_len)``) the data has, when known:
            buckets never round beyond it, and ``plan_for="largest"`` plans for it from the start
            (a shape without a layout bounds the batch size and sequence length of every layout).
        per_octave: plan buckets per doubling of each dimension (16: a plan is for a shape at most
            1/16 above its batch's in each dimension, at most 16 plans per doubling; 0: every shape
            its own plan, optimal for each batch at one solve per distinct shape).
        shape_of: ``shape_of(batch) -> Shape`` where ``batch_shape`` does not read the batch right.
        resize: ``resize(batch, shape) -> batch`` where ``resize_batch`` cannot stretch it.
        adjust: ``adjust(profile) -> profile``, applied to the first batch's profile (an
            integration's allowance for what its loop keeps alive); carried to every shape.
        install: ``install(model, plan)``; default ``apply_plan``.
        channel: how ranks talk (``service.channel``): every rank's batch shape is gathered and the
            largest planned, rank 0 profiles and solves, every rank gets its plan (or its error).
            None: one process.
        hint: added to the message of an error of ours (which integration, which setting).
        warmup: unmeasured steps before the first batch's real profile (``fake=False``; None: the config's).
        verbose: a progress display while a profile runs longer than a few seconds (rank 0, on a
            terminal); False shows nothing.

    Example:
        >>> import torch
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])
        >>> plans = ShapePlans(net, lambda m, x: m(x).square().mean(), budget="min", per_octave=0)
        >>> [len(plans.use(torch.randn(rows, 16)).checkpointed) > 0 for rows in (64, 256, 64)]
        [True, True, True]
        >>> plans.counts.real_profiles, plans.counts.solves  # two shapes, both planned on fake tensors
        (0, 2)
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, budget: int | str | None = None, *,
                 optimizer: torch.optim.Optimizer | None = None, cost: str = "flops", candidates: Any = None,
                 fake: bool | None = None, config: RematConfig | None = None, plan_for: str | None = None,
                 max_shape: Shape | tuple[int, int] | None = None, per_octave: int = 16,
                 shape_of: Callable[[Any], Shape | None] | None = None,
                 resize: Callable[[Any, Shape], Any] | None = None, adjust: Callable[[Profile], Profile] | None = None,
                 install: Callable[[nn.Module, Plan], Any] | None = None, channel: Any = None, hint: str = "",
                 warmup: int | None = None, verbose: bool = True):
        if config is None:
            if budget is None:
                raise ValueError("ShapePlans needs a budget (or a config)")
            # The first batch is profiled on fake tensors whatever ``fake`` says; the config's
            # ``fake`` would refuse cost="time", which is priced from the first measured step here.
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

    # ------------------------------------------------------------------------------ the interface

    def use(self, batch: Any) -> Plan:
        """Install the plan for ``batch``'s shape (if it is not installed already) and return it.

        Either way what is installed is then read back and compared with the plan (cheap: the
        installer's records against the plan's actions), so a step never runs under a plan that is
        installed only in name.

        Raises:
            InstallationMismatchError: what is on the model is not the plan (something undid or
                changed the installation between steps); it names both.
        """
        plan = self.plan(batch)
        if self.installed is None or _signature(plan) != _signature(self.installed):
            self.install(self.model, plan)
            self.counts.installs += 1
        self.installed = plan
        check_installed(self.model, plan, f"(ShapePlans.use, batch shape {self.shape_of(batch)}) {self.hint}".strip())
        return plan

    def plan(self, batch: Any) -> Plan:
        """The plan for ``batch``'s shape (on every rank, the largest shape of any rank's batch):
        cached for its bucket, else predicted and solved (on rank 0, and shared)."""
        self.counts.steps += 1
        shape = self.shape_of(batch)
        if shape is None:
            raise ValueError(f"ShapePlans cannot read a batch shape from {type(batch).__name__}: pass shape_of=")
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
        """The shape ``shape``'s plan is made for: its own when a plan for it exists (the profiled
        first batch), else its bucket (at least ``shape``; with ``plan_for="largest"``, at least
        every shape of its layout's structure met before and ``max_shape``). The layout's sizes that
        have varied (an image's height) are rounded up with the batch size and sequence length;
        those that have not (its channels) stay as they are."""
        shape = self.keys.planned(shape)
        if shape in self.plans or shape in self._too_large:
            return shape
        key = self.keys.bucket(shape)
        return shape if key in self._too_large else key

    def seed(self, shape: Shape, plan: Plan) -> None:
        """Take ``plan`` as the plan of ``shape`` (one saved in a checkpoint): batches of that shape
        are not profiled again."""
        self.plans[shape] = plan
        self.sources.setdefault(shape, "saved")

    def predict(self, shape: Shape | tuple[int, int]) -> Profile:
        """The profile predicted at ``shape`` (no profiling: outside the nodes, by the shape law,
        not a bound; a ``(batch_size, seq_len)`` at the first batch's layout). Only once a shape
        other than the first batch's has been planned."""
        if self.fit is None:
            raise RuntimeError("ShapePlans.predict needs the fit: plan a batch of another shape than the first")
        if isinstance(shape, tuple):
            shape = Shape(*shape, self.anchor[0].layout if self.anchor is not None else ())
        return self.fit.at(shape)

    def profile_of(self, plan: Plan) -> Profile | None:
        """The profile ``plan`` (one of these plans) was solved on, without profiling anything: the
        first batch's where the plan is for its shape, else the fit's; None when there is neither
        (a fallback plan, or one seeded from a checkpoint)."""
        shape = plan.fingerprint.get("shape")
        if shape is None:
            return None
        key = Shape.from_list(shape)
        if self.anchor is not None and key == self.anchor[0]:
            return self.anchor[1]
        return self.fit.at(key) if self.fit is not None else None

    # ------------------------------------------------------------------------------- internals

    def _settle(self, key: Shape, shape: Shape, outcome: tuple[Shape, Plan]) -> Shape:
        """Store a plan decided for ``key`` (under the shape it was made for)."""
        made_for, plan = outcome
        if made_for != key:  # no plan fits the bucket: its batches are planned at their own shape
            self._too_large.add(key)
        self.plans[made_for] = plan
        self.sources.setdefault(made_for, "shared")
        return made_for

    def _step(self, batch: Any) -> Callable[[nn.Module], torch.Tensor]:
        return lambda module: self.loss_fn(module, batch)

    def _plan_at(self, batch: Any, shape: Shape, key: Shape) -> tuple[Shape, Plan]:
        """The plan for ``key`` (and the shape it is made for): at the batch's own shape when no
        plan fits the bucket, or the bucket cannot be profiled. The profile at ``key``: the first
        batch's own where ``key`` is its shape, else predicted (adding the nodes around ``key`` that
        are missing); solved within the budget."""
        try:
            if self.fallback is not None:
                return key, self.fallback
            if self.anchor is None and self.fit is None and not self.plans:
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
