"""Plans that follow the batch's shape: one plan per shape bucket, made from predicted profiles.

A plan is made from a profile at one batch shape; a run changes shape every step (dynamic padding,
the last short batch). ``ShapePlans`` gives each step the plan for its own shape:

1. The first batch is profiled for real, as every integration profiled it before, and planned on
   that profile: the *anchor* (real timings, the allocator's view, an integration's adjustment).
   That is the only real profiling pass of a run, whatever the data (none with ``fake=True``).
2. Every batch: its shape (batch size, sequence length and layout: which tensors it holds, an
   image's height and width, ``core.shapes``) is rounded up to a bucket (``ShapeBuckets``: 16 steps
   per doubling of the batch size, of the sequence length and of each size of the layout that
   varies), whose plan is cached. A bucket met for the first time is predicted from *nodes*,
   fake-tensor profiles at a few shapes of its layout (``core.shape_fit``: between nodes, by
   interpolation, at or above the truth; the nodes around it that are missing are profiled, on fake
   tensors: nothing is allocated, nothing real runs), carried from the anchor, and solved within
   the budget. So no step runs without a plan after the first, and no step runs without
   recomputation to be profiled.
3. The plan is installed between steps when it changes (``apply_plan``); gradients are those of the
   model without recomputation, whatever plan a step runs under.

``counts`` says how many real and fake profiling passes, solves and plan changes a run took.

Under ``torch.compile`` each plan change (and each new shape) recompiles the graphs it touches:
``plan_for="largest"`` plans every batch for the largest shape met so far (or ``max_shape``, when
declared: then the first plan is the only one), so the plan changes at most as often as the largest
shape grows. See ``docs/shapes.md``.

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
    (1, ['2x16', '2x24', '2x40'])
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from ..core.config import ProfileOptions, RematConfig
from ..core.errors import BudgetTooSmallError, FakeProfileError
from ..core.memory_model import Profile
from ..core.plan import Plan
from ..core.shape_fit import ShapeFit
from ..core.shapes import Shape
from ..runtime.installing.apply import apply_plan
from ..runtime.installing.compiled import runs_compiled
from ..runtime.installing.fingerprint import fingerprint
from ..runtime.installing.verify import check_installed
from ..runtime.measuring.measure import is_out_of_memory, model_device, release_device_memory
from ..runtime.profiling import profile as profiling
from ..runtime.profiling.batch_shape import batch_shape, resize_batch
from .planning import Planner
from .shape_keys import ShapeKeys

PLAN_FOR = ("shape", "largest")
# Nodes of the shape fit (fake profiles) sit on a ladder of this many steps per doubling of the batch
# size and of the sequence length; plans are made at the (finer) buckets between them.
NODE_STEPS = 4
LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class ShapePlanCounts:
    """What following the batch's shape has cost so far.

    Attributes:
        real_profiles: profiles of a real step (each runs the step without recomputation): 0 or 1.
        fake_profiles: profiles on fake tensors (nodes of the shape fit; no memory allocated).
        solves: plans solved (one per bucket met).
        installs: times a plan was installed on the model (the first, and each change of plan).
        steps: batches seen.

    Example:
        >>> ShapePlanCounts().real_profiles
        0
    """

    real_profiles: int = 0
    fake_profiles: int = 0
    solves: int = 0
    installs: int = 0
    steps: int = 0


def _priced(profile: Profile, seconds_per_flop: float) -> Profile:
    """A fake profile's costs in seconds, at the anchor's seconds per FLOP (as ``profile_step``
    prices a fake profile with a GPU's speed)."""
    stages = tuple(replace(stage, forward_seconds=stage.forward_flops * seconds_per_flop,
                           options=tuple(replace(o, cost_seconds=o.cost_flops * seconds_per_flop)
                                         for o in stage.options))
                   for stage in profile.stages)
    return replace(profile, stages=stages, baseline_step_seconds=profile.baseline_step_flops * seconds_per_flop)


def _signature(plan: Plan) -> tuple:
    """What an installed plan changes on the model: two plans with the same actions are one installation."""
    return tuple(plan.actions)


class ShapePlans:
    """The plan for each batch's shape: predicted, solved once per shape bucket, installed when it changes.

    Call ``use(batch)`` before each training step's forward pass (``plan(batch)`` decides without
    installing). The first call profiles that batch for real and plans it on that profile (the only
    real profiling pass of the run, as an integration profiled its first batch before); a batch of
    another shape is planned on a prediction from fake-tensor profiles (``core.shape_fit``), so no
    step runs without recomputation to be profiled and no step after the first runs without a plan.

    Args:
        model: the model, in training mode.
        loss_fn: ``loss_fn(model, batch)`` runs the forward pass on ``batch`` and returns the loss
            (the profiles call it on fake copies of ``model`` and of ``batch`` at other shapes).
        budget: as ``parse_budget``: ``"10GB"``, bytes, ``"80%"``, ``"min"``. Or pass ``config``.
        optimizer: counted in the budget (its state and its step).
        cost: ``"flops"`` (counted FLOPs: the same plans on every run), ``"time"`` or ``"roofline"``.
        candidates: None for automatic stages, or module classes / name patterns.
        fake: profile the first batch on fake tensors too: no real profiling pass at all (costs
            are FLOPs).
        config: a ``RematConfig`` instead of ``budget``, ``cost``, ``candidates`` and ``fake``.
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
        warmup: unmeasured steps before the first batch's real profile (None: the config's).
        verbose: a progress display while the real profile runs longer than a few seconds (rank 0,
            on a terminal); False shows nothing.

    Example:
        >>> import torch
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])
        >>> plans = ShapePlans(net, lambda m, x: m(x).square().mean(), budget="min", per_octave=0)
        >>> [len(plans.use(torch.randn(rows, 16)).checkpointed) > 0 for rows in (64, 256, 64)]
        [True, True, True]
        >>> plans.counts.real_profiles, plans.counts.solves, plans.counts.installs
        (1, 2, 3)
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, budget: int | str | None = None, *,
                 optimizer: torch.optim.Optimizer | None = None, cost: str = "flops", candidates: Any = None,
                 fake: bool = False, config: RematConfig | None = None, plan_for: str | None = None,
                 max_shape: Shape | tuple[int, int] | None = None, per_octave: int = 16,
                 shape_of: Callable[[Any], Shape | None] | None = None,
                 resize: Callable[[Any, Shape], Any] | None = None, adjust: Callable[[Profile], Profile] | None = None,
                 install: Callable[[nn.Module, Plan], Any] | None = None, channel: Any = None, hint: str = "",
                 warmup: int | None = None, verbose: bool = True):
        if config is None:
            if budget is None:
                raise ValueError("ShapePlans needs a budget (or a config)")
            config = RematConfig(budget, cost=cost, profile=ProfileOptions(candidates=candidates, fake=fake))
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
        self.anchor: tuple[Shape, Profile] | None = None  # the first batch's profile, and its shape
        self.fit: ShapeFit | None = None  # fake nodes, from the first shape other than the first batch's
        self.fallback: Plan | None = None  # profiling ran out of memory: every block recomputed, every shape
        self._seconds_per_flop: float | None = None
        self.plans: dict[Shape, Plan] = {}  # bucket -> its plan
        self.sources: dict[Shape, str] = {}  # bucket -> its profile: "profile", "node", "chord", "saved"
        self.installed: Plan | None = None
        self._too_large: set[Shape] = set()  # buckets no plan fits: their batches are planned at their own shape

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
        if key not in self.plans:
            plan = self._shared(lambda: self._plan_at(batch, shape, key))
            key = self._settle(key, shape, plan)
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

    def _shared(self, compute: Callable[[], tuple[Shape, Plan]]) -> tuple[Shape, Plan]:
        """``compute()`` on rank 0, its outcome (or its error) on every rank."""
        if self.channel is None or not self.channel.distributed:
            return compute()
        return self.channel.from_main(compute, action="planning for a batch shape", hint=self.hint)

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
        plan fits the bucket, or the bucket cannot be profiled."""
        try:
            return key, self._solve_at(batch, shape, key)
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
                      UserWarning, stacklevel=5)
        return self._plan_at(batch, shape, shape) if shape not in self.plans else (shape, self.plans[shape])

    def _solve_at(self, batch: Any, shape: Shape, key: Shape) -> Plan:
        """The profile at ``key``: the first batch's own where ``key`` is its shape, else predicted
        (adding the nodes around ``key`` that are missing); solved within the budget."""
        if self.fallback is not None:
            return self.fallback
        if self.anchor is None and self.fit is None and not self.plans:
            self._first(batch)
            if self.fallback is not None:
                return self.fallback
        if self.anchor is not None and key == self.anchor[0]:
            profile, self.sources[key] = self.anchor[1], "profile"
        else:
            self._grow(batch, shape, key)
            profile = self.fit.at(key)
            self.sources[key] = "node" if key in self.fit.nodes else "chord"
        self.counts.solves += 1
        plan = self.planner.solve_profile(self.model, profile)
        # What it was made for: the model's parameters, the batch that asked for it, the shape planned.
        return replace(plan, fingerprint={**plan.fingerprint, **fingerprint(self.model, batch),
                                          "shape": key.to_list()})

    def _first(self, batch: Any) -> None:
        """The first batch: profiled for real (``fake``: on fake tensors), ``adjust`` applied: the
        anchor every prediction is carried from. (A run that starts from saved plans has none: its
        new shapes are profiled on fake tensors only.)"""
        shape = self.shape_of(batch)
        if not self.config.profile.fake:
            real = self._real_profile(batch)
            if real is not None:
                self._seconds_per_flop = real.baseline_step_seconds / max(1, real.baseline_step_flops)
                self.anchor = (shape, real)
                return
        try:
            node = self._fake_profile(batch, shape)
        except Exception as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
            if not is_out_of_memory(error):
                raise
            reason = f"{type(error).__name__}: {_first_line(error)}"
            self.fallback = self.planner.fallback_plan(self.model, reason)
            return
        self.fit = ShapeFit({shape: node}, anchor=(shape, self.adjust(node)) if self.adjust else None)
        self.anchor = self.fit.anchor

    def _grow(self, batch: Any, shape: Shape, key: Shape) -> None:
        """Make the fit bracket ``key``: the fake node at the anchor's shape (its calibration), or a
        first node at ``key``, then the ladder nodes around ``key`` that are missing."""
        if self.fit is None and self.anchor is not None and self.anchor[0].comparable(shape):
            anchor_shape, anchor = self.anchor
            self.fit = ShapeFit({anchor_shape: self._fake_profile(batch, anchor_shape)}, anchor=self.anchor)
        elif self.fit is None:
            # A plan was seeded (a resumed run), nothing was profiled; or this batch cannot be
            # stretched to the first batch's layout (a key appeared), so no fake node can be
            # compared with its real profile: start at ``key``, anchored on its own fake node.
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
                      "on fake-tensor profiles alone.", UserWarning, stacklevel=6)
        return None

    def _fake_profile(self, batch: Any, at: Shape) -> Profile:
        """A node: the step on ``batch`` stretched to ``at``, profiled on fake tensors (priced in
        seconds at the real profile's seconds per FLOP, or FLOPs standing in for them)."""
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
        # No real timing: FLOPs stand in for seconds (an overhead is a ratio, the same in either).
        seconds_per_flop = self._seconds_per_flop or (1e-12 if self.config.cost != "flops" else None)
        return _priced(profile, seconds_per_flop) if seconds_per_flop else profile


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
