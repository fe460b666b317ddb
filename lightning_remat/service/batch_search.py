"""The search behind ``find_remat_batch_size``: fit profiles, predict plans per batch size, confirm with trials; on
an FSDP2 model every rank searches in lockstep (the result is rank 0's, the budget per rank)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from ..core.batch_fit import ProfileFit, largest_batch
from ..core.budget import format_bytes
from ..core.config import RematConfig
from ..core.errors import BatchSizeTooSmallBudgetError, BudgetTooSmallError, PlanningFailedError, RematError
from ..core.memory_model import Profile
from ..core.offload_model import to_host
from ..core.profile_algebra import merge_profiles
from ..core.plan import Plan
from ..core.solve import least_peak, plan_from_choices, solve
from ..runtime.installing.apply import recomputation_of
from ..runtime.measuring.measure import Step, is_out_of_memory, release_device_memory
from ..runtime.profiling import profile as profiling
from ..runtime.measuring.trial import Trial, run_trial
from .channel import Channel
from .planning import Planner, resolve_cost

MakeStep = Callable[[int], Step]


class BatchSearch:
    """The state of one search: the fitted profile, the corrections real trials taught, the plans so far."""

    unit = 1  # sizes are multiples of it (``LengthSearch``: ``multiple_of``)

    def __init__(self, make_step: MakeStep, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 config: RematConfig, budget_bytes: int, max_overhead: float, steps_per_trial: int, mode: str,
                 start: int):
        self.make_step, self.model, self.optimizer = make_step, model, optimizer
        self.budget_bytes, self.max_overhead = budget_bytes, max_overhead
        self.steps_per_trial, self.mode, self.start = steps_per_trial, mode, start
        self.config, cost_note = resolve_cost(config, model)
        self.cost = self.config.cost
        self.passes = self.samples = 0  # profiling passes run, and the samples they took
        self.notes: list[str] = [cost_note] if cost_note else []
        self.trials: list[Trial] = []
        # (batch size, measured - predicted) of failed trials, with and without recomputation.
        self.corrections: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self.plans: dict[tuple[int, bool], Plan | None] = {}
        self.fit: ProfileFit | None = None
        self.host_free: int | None = None  # host memory free for offloading (bytes), read when first needed
        self.verbose = True  # the planning service's progress display while a profile runs long

    def step_at(self, batch_size: int) -> Step:
        """The user's step at ``batch_size`` (``ShardedBatchSearch`` makes it on every rank at once)."""
        return self.make_step(batch_size)

    def _counted(self, step: Step, batch_size: int) -> Step:
        def counted(model: nn.Module) -> torch.Tensor:
            self.passes += 1
            self.samples += batch_size
            return step(model)
        return counted

    # 1. Profiles at two small batch sizes, stepping down on a real out-of-memory error.
    def _profile_at(self, batch_size: int, warmup: int) -> Profile | None:
        options = replace(self.config.profile, warmup=warmup)
        if options.policies is None:
            # No selective-checkpointing options by default: the fit across batch sizes under-predicts them.
            options = replace(options, policies=())
        try:
            with Planner(self.config, verbose=self.verbose).progress(self.model, options.fake):
                return profiling.profile_step(self.model, self._counted(self.step_at(batch_size), batch_size),
                                              optimizer=self.optimizer, options=options)
        except Exception as exception:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
            if not is_out_of_memory(exception):
                raise
        release_device_memory()
        return None

    def fit_profiles(self, max_batch_size: int) -> ProfileFit:
        low_bs = self.start
        low = self._profile_at(low_bs, warmup=1)
        while low is None and low_bs > 1:
            low_bs //= 2
            low = self._profile_at(low_bs, warmup=1)
        if low is None:
            raise BatchSizeTooSmallBudgetError(
                self.budget_bytes, 0, 0, "a training step at batch size 1 ran out of memory while profiling; "
                "no batch size can be trained on this device")
        profiles = [(low_bs, low)]
        for second_bs in (min(2 * low_bs, max_batch_size), low_bs // 2):
            if second_bs < 1 or second_bs == low_bs:
                continue
            second = self._profile_at(second_bs, warmup=0)
            if second is not None:
                profiles.append((second_bs, second))
                break
        self.fit = ProfileFit(profiles)
        if self.cost == "flops" and flops_unattributed(self.fit.profiles[-1]):
            # A step calling a submodule (``self.net(x)``) gives stages no FLOPs; measured time still prices them.
            self.cost = "time"
            self.notes.append("no FLOPs were attributed to the candidate modules (the step does not call the model "
                              "itself); recomputation is priced by measured time instead")
        return self.fit

    # 2. Predictions: which batch sizes fit, with and without recomputation.
    def correction(self, batch_size: int, recompute: bool) -> float:
        """Bytes the model under-predicts at ``batch_size``, as the failed trials taught."""
        assert self.fit is not None
        extra = 0.0
        for failed_bs, error in self.corrections[recompute]:  # ``_trial`` adds them (a ``ProfileFit``'s search)
            # Zero at the profiled sizes, ``error`` at the failed one, along that line between and beyond
            # (a convex peak curve's error stays below the chord).
            top = self.fit.batch_sizes[-1]
            span = max(1, failed_bs - top)
            extra = max(extra, error * max(0, batch_size - top) / span)
        return extra

    def plan_for(self, batch_size: int, recompute: bool) -> Plan | None:
        """The plan at ``batch_size`` within budget and ``max_overhead`` (or keep-all); None if none fits."""
        key = (batch_size, recompute)
        if key not in self.plans:
            assert self.fit is not None
            profile = self.fit.at(batch_size)
            effective = max(1, int(self.budget_bytes - self.correction(batch_size, recompute)))
            plan: Plan | None
            if recompute:
                try:
                    plan = self._solve(profile, effective)
                except BudgetTooSmallError:
                    plan = None
                except RematError as error:  # offload: no plan within the host's free memory
                    plan = None
                    if not any("host memory" in n for n in self.notes):
                        self.notes.append(f"host memory limits offloading from batch size {batch_size} on: {error}")
                if plan is not None and plan.predicted_overhead > self.max_overhead + 1e-12:
                    plan = None
            else:
                plan = plan_from_choices(profile, [0] * len(profile.stages), effective, self.cost)
                if plan.predicted_peak_bytes > effective:
                    plan = None
            if plan is not None:
                plan = replace(plan, budget_bytes=self.budget_bytes, requested_budget=self.config.budget.text)
            self.plans[key] = plan
        return self.plans[key]

    def _solve(self, profile: Profile, budget: int) -> Plan:
        """``solve``; with offload options, within the host's free memory (as ``Planner.solve_profile``)."""
        if not any(to_host(o) for s in profile.stages for o in s.options):
            return solve(profile, budget, cost=self.cost)
        from ..core.offload_model import solve_within_host
        from ..runtime.targets.offload_link import host_limit_bytes

        if self.host_free is None:
            # Read once per search: the same limit for every batch size (and the plans stay cached).
            self.host_free = host_limit_bytes(self.config.profile)
        return solve_within_host(profile, self.host_free, lambda p: solve(p, budget, cost=self.cost))

    def largest(self, recompute: bool, limit: int) -> int:
        """The largest multiple of ``unit`` up to ``limit`` predicted to fit, doubling from ``start`` then bisecting."""
        unit = self.unit
        return unit * largest_batch(lambda k: self.plan_for(k * unit, recompute) is not None, max(1, self.start // unit),
                                    limit // unit, self.mode)

    def run_trial(self, batch_size: int, plan: Plan) -> Trial:
        """Real steps at ``batch_size`` with ``plan`` applied (``ShardedBatchSearch`` runs them on every rank)."""
        return run_trial(self.model, self.step_at(batch_size), self.optimizer, batch_size,
                         plan if plan.offloaded else recomputation_of(plan), self.steps_per_trial, self.budget_bytes,
                         plan.predicted_peak_bytes)

    def _trial(self, batch_size: int, recompute: bool) -> Trial:
        plan = self.plan_for(batch_size, recompute)
        assert plan is not None
        trial = self.run_trial(batch_size, plan)
        self.trials.append(trial)
        if not trial.fits and not trial.out_of_memory and trial.measured_peak_bytes is not None:
            self.corrections[recompute].append((batch_size, trial.measured_peak_bytes - plan.predicted_peak_bytes))
            self.plans.clear()
        return trial

    # 3. Confirmation with real steps.
    def confirm(self, max_batch_size: int, max_trials: int) -> tuple[int, int | None]:
        """(largest batch a real trial passed, its measured peak); an over-budget trial corrects the prediction."""
        assert self.fit is not None
        measured: int | None = None
        confirmed, failed = 0, max_batch_size + 1
        out_of_memory_seen = False
        while len(self.trials) < max_trials:
            predicted = self.largest(True, failed - 1)
            if predicted <= confirmed:
                break
            candidate = predicted
            if out_of_memory_seen:
                base = confirmed if confirmed else min(self.fit.batch_sizes[-1], failed - 1)
                candidate = min(predicted, max(confirmed + 1, (base + failed) // 2))
            trial = self._trial(candidate, True)
            if trial.fits:
                confirmed, measured = candidate, trial.measured_peak_bytes
                continue
            failed = candidate
            if trial.out_of_memory:
                out_of_memory_seen = True
                self.notes.append(f"batch size {candidate} ran out of memory on the device below the budget")
        if confirmed == 0:
            remaining = self.largest(True, failed - 1)
            if remaining == 0:
                raise too_small_at_one(self.fit, self.budget_bytes, self.max_overhead, self.cost)
            self.notes.append(f"no trial passed within max_trials={max_trials}; batch size {remaining} is a prediction")
            confirmed = remaining
        return confirmed, measured

    def largest_without_remat(self, confirmed: int, confirm: bool, max_trials: int) -> int:
        """The same search with nothing recomputed, for the comparison (never above the batch found)."""
        without = self.largest(False, confirmed)
        if not confirm:
            return without
        while len(self.trials) < 2 * max_trials and without > 0:
            if self._trial(without, False).fits:
                break
            self.plans.clear()
            without = self.largest(False, without - 1)
        return without


def flops_unattributed(profile: Profile) -> bool:
    """Whether the step counts FLOPs but none in its recomputing options (it calls a submodule, not the model).

    >>> from lightning_remat.core.memory_model import Costs, StageAction, StageOption, StageProfile
    >>> whole = StageOption("whole", StageAction.recompute("a"), 0, 10, Costs(1.0, 0))
    >>> flops_unattributed(Profile((StageProfile("a", (StageOption("keep", StageAction("a"), 10, 10), whole)),), (),
    ...                            baseline_costs=Costs(1.0, 100)))
    True
    """
    recomputing = [o for s in profile.stages for o in s.options if o.action.modules]
    return bool(recomputing) and profile.baseline_costs.flops > 0 and not any(o.costs.flops for o in recomputing)


def too_small_at_one(fit: ProfileFit, budget_bytes: int, max_overhead: float, cost: str) -> BatchSizeTooSmallBudgetError:
    profile = fit.at(1)
    smallest = least_peak(profile)
    if smallest > budget_bytes:
        message = (f"The budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes) is too small even at batch size 1: "
                   f"the smallest peak any recompute plan reaches at batch size 1 is {format_bytes(smallest)} "
                   f"({smallest} bytes), of which {format_bytes(profile.static_bytes)} is parameters, gradients and "
                   f"optimizer state. Raise the budget to at least that.")
    else:
        cheapest = solve(profile, budget_bytes, cost=cost)
        message = (f"At batch size 1 the cheapest plan within the budget of {format_bytes(budget_bytes)} costs "
                   f"{cheapest.predicted_overhead:.1%} recomputation ({cost}), above max_overhead={max_overhead:.1%}. "
                   f"Raise max_overhead or the budget.")
    return BatchSizeTooSmallBudgetError(budget_bytes, smallest, profile.static_bytes, message)


def combine_trials(trials: list[Trial], budget: int) -> Trial:
    """One trial from every rank's: out of memory if any was, the largest peak.

    >>> t = combine_trials([Trial(4, (), 1, 10, False, True), Trial(4, (), 1, None, True, False)], budget=100)
    >>> t.out_of_memory, t.fits, t.measured_peak_bytes
    (True, False, None)
    """
    first = trials[0]
    oom = any(t.out_of_memory for t in trials)
    peaks = [t.measured_peak_bytes for t in trials]
    peak = None if any(p is None for p in peaks) else max(p for p in peaks if p is not None)
    fits = not oom and peak is not None and peak <= budget
    return Trial(first.batch_size, first.checkpointed, max(t.steps for t in trials), peak, oom, fits,
                 first.predicted_peak_bytes)


class ShardedBatchSearch(BatchSearch):
    """``BatchSearch`` run by every rank of an FSDP2 model in lockstep, talking through ``channel``."""

    def __init__(self, *args: Any, channel: Channel, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.channel = channel
        self.notes.append(f"searched on each of {self.channel.world_size} ranks in lockstep (the model is sharded "
                          "with FSDP2): the budget is per rank, profiles and trial peaks the largest over the ranks")

    def _all(self, compute: Callable[[], Any], action: str) -> list:
        """``compute()`` on every rank, gathered; an error (or an out-of-memory value) on any rank raised on all."""
        return self.channel.on_every_rank(compute, action=action,
                                          ended_early=lambda v: v is None or bool(getattr(v, "out_of_memory", False)))

    def step_at(self, batch_size: int) -> Step:
        # make_step runs no collective: it runs on every rank and they compare notes before any pass,
        # so one rank's error is every rank's and the process group stays usable.
        made: list[Step] = []
        self._all(lambda: made.append(super(ShardedBatchSearch, self).step_at(batch_size)), "making the step")
        return made[0]

    def _profile_at(self, batch_size: int, warmup: int) -> Profile | None:
        profiles = self._all(lambda: super(ShardedBatchSearch, self)._profile_at(batch_size, warmup), "profiling")
        if any(p is None for p in profiles):  # out of memory on some rank: on all
            return None
        return merge_profiles(profiles)

    def run_trial(self, batch_size: int, plan: Plan) -> Trial:
        # The ranks computed their choice from the same figures; check before any collective runs.
        choice = (batch_size, tuple(plan.checkpointed), tuple(tuple(s) for s in plan.segments))
        choices = self.channel.gather(choice)
        if any(c != choices[0] for c in choices):
            raise PlanningFailedError(f"the ranks chose different trials (batch size, plan): {choices}; the "
                                      "batch-size search needs the same model and batch shapes on every rank")
        trials = self._all(lambda: super(ShardedBatchSearch, self).run_trial(batch_size, plan), "running a trial")
        return combine_trials(trials, self.budget_bytes)
