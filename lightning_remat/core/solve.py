"""The exact solver: least recompute cost subject to a predicted peak within the budget.

Pure numbers in, plan out (numpy, no torch). The memory model (``memory_model``) has a prefix
structure: every constraint reads the bytes stored by the stages *before* some point. So a dynamic
programme over stages in execution order, whose state is "bytes stored so far" and whose value is
"least cost so far", is exact; we keep the whole Pareto frontier of (stored bytes, cost) pairs
instead of discretising the state, which keeps it exact without a byte grid. A smaller stored
total never hurts a later constraint, so a pair is dropped only when another has both less (or
equal) stored bytes and less (or equal) cost.

``budget="min"`` solves the memory-only objective of Hong et al. / Feng & Huang with the same
frontier over (stored bytes, peak so far), then the least-cost plan at that peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .budget import MIN_BUDGET, Budget
from .config import check_cost_kind
from .errors import BudgetTooSmallError
from .memory_model import Profile, plan_cost, predict_peak
from .plan import Plan, StageChoice

# Beyond this many Pareto points the frontier is thinned to one point (the cheapest) per band of
# stored bytes, plus the point that stores least. Plans stay feasible (every constraint is checked
# on exact byte counts); optimality is then within one band (1/MAX_FRONTIER of the frontier's
# range of stored bytes). Chains of a few dozen stages, and every test of exactness, stay below it.
MAX_FRONTIER = 1_000


@dataclass
class _Arrays:
    stored: np.ndarray  # [stage, option] bytes, -1 where a stage has fewer options
    local: np.ndarray  # [stage, option] local peak bytes
    cost: np.ndarray  # [stage, option]
    segment_peak: np.ndarray  # [k] the largest segment peak with k stages alive, -inf if none


def _arrays(profile: Profile, kind: str) -> _Arrays:
    n = len(profile.stages)
    width = max((len(s.options) for s in profile.stages), default=1)
    stored = np.full((n, width), -1, dtype=np.int64)
    local = np.zeros((n, width), dtype=np.int64)
    cost = np.zeros((n, width), dtype=np.float64)
    for i, stage in enumerate(profile.stages):
        for j, option in enumerate(stage.options):
            stored[i, j] = option.stored_bytes
            local[i, j] = option.local_peak_bytes
            cost[i, j] = option.cost(kind)
    segment_peak = np.full(n + 1, np.iinfo(np.int64).min, dtype=np.int64)
    for segment in profile.segments:
        if not 0 <= segment.stages_alive <= n:
            raise ValueError(f"segment {segment.name!r} has stages_alive={segment.stages_alive} outside 0..{n}")
        segment_peak[segment.stages_alive] = max(segment_peak[segment.stages_alive], segment.peak_bytes)
    return _Arrays(stored, local, cost, segment_peak)


def _pareto(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Indices of the points not dominated in (first, second), both minimised, sorted by first."""
    order = np.lexsort((second, first))
    sorted_second = second[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], sorted_second[:-1].astype(np.float64))))
    keep = order[sorted_second < best_before]
    if len(keep) > MAX_FRONTIER:
        stored = first[keep].astype(np.float64)
        span = stored[-1] - stored[0]
        band = np.floor((stored - stored[0]) * (MAX_FRONTIER / span)).astype(np.int64) if span > 0 else np.zeros(len(keep), np.int64)
        # Along the frontier the second coordinate falls as the first grows: the last point of a
        # band is its cheapest.
        last_of_band = np.append(band[1:] != band[:-1], True)
        last_of_band[0] = True  # and the point that stores least, which keeps tight budgets feasible
        keep = keep[last_of_band]
    return keep


def _frontier_dp(arrays: _Arrays, budget: int | None) -> list[int] | None:
    """Least-cost choices whose peak is within ``budget``; with ``budget=None`` least peak instead.

    Returns the option index per stage, or None when nothing fits.
    """
    n = arrays.stored.shape[0]
    minimise_peak = budget is None
    stored_so_far = np.zeros(1, dtype=np.int64)
    # The second coordinate: cost so far (budget mode) or peak so far (min mode).
    value = np.array([max(0, int(arrays.segment_peak[0]))], dtype=np.float64) if minimise_peak else np.zeros(1)
    if not minimise_peak and arrays.segment_peak[0] > budget:
        return None
    parents: list[np.ndarray] = []
    options: list[np.ndarray] = []
    for i in range(n):
        cand_stored, cand_value, cand_parent, cand_option = [], [], [], []
        for j in range(arrays.stored.shape[1]):
            if arrays.stored[i, j] < 0:
                continue
            local_peak = arrays.local[i, j] + stored_so_far
            new_stored = stored_so_far + arrays.stored[i, j]
            if minimise_peak:
                new_value = np.maximum(value, local_peak.astype(np.float64))
                mask = np.ones(len(value), dtype=bool)
            else:
                new_value = value + arrays.cost[i, j]
                mask = local_peak <= budget
            segment = arrays.segment_peak[i + 1]
            if minimise_peak:
                new_value = np.maximum(new_value, (segment + new_stored).astype(np.float64))
            else:
                mask &= segment + new_stored <= budget
            idx = np.nonzero(mask)[0]
            cand_stored.append(new_stored[idx])
            cand_value.append(new_value[idx])
            cand_parent.append(idx)
            cand_option.append(np.full(len(idx), j, dtype=np.int64))
        all_stored = np.concatenate(cand_stored)
        if len(all_stored) == 0:
            return None
        all_value = np.concatenate(cand_value)
        keep = _pareto(all_stored, all_value)
        stored_so_far, value = all_stored[keep], all_value[keep]
        parents.append(np.concatenate(cand_parent)[keep])
        options.append(np.concatenate(cand_option)[keep])
    # Least value; among equal values the first (least stored bytes) because of the sort.
    best = int(np.argmin(value))
    choices = [0] * n
    for i in range(n - 1, -1, -1):
        choices[i] = int(options[i][best])
        best = int(parents[i][best])
    return choices


def least_peak(profile: Profile) -> int:
    """The smallest peak any plan reaches under the memory model.

    Example:
        >>> from lightning_remat.core.memory_model import StageOption, StageProfile, Segment
        >>> keep = StageOption("keep", (), 100, 150, 0.0, 0)
        >>> whole = StageOption("whole", ("a",), 10, 160, 1.0, 5)
        >>> least_peak(Profile((StageProfile("a", (keep, whole)),) * 2, (Segment("head", 2, 50),)))
        160
    """
    choices = _frontier_dp(_arrays(profile, "flops"), None)
    return predict_peak(profile, choices)


def solve_choices(profile: Profile, budget: int | str, cost: str = "time") -> list[int]:
    """Option index per stage for the least-cost plan within ``budget`` (bytes or ``"min"``).

    Raises BudgetTooSmallError when nothing fits.
    """
    check_cost_kind(cost)
    arrays = _arrays(profile, cost)
    if not profile.stages:
        raise ValueError("the profile has no candidate stages to recompute")
    if budget == MIN_BUDGET:
        budget = predict_peak(profile, _frontier_dp(arrays, None))
    choices = _frontier_dp(arrays, int(budget))
    if choices is None:
        raise BudgetTooSmallError(int(budget), least_peak(profile), profile.static_bytes)
    return choices


def plan_from_choices(profile: Profile, choices: Sequence[int], budget_bytes: int, cost: str = "time",
                      requested_budget: str = "") -> Plan:
    """Build the Plan for given option indices (used by ``solve`` and by tests and benchmarks).

    Example:
        >>> from lightning_remat.core.memory_model import StageOption, StageProfile
        >>> keep = StageOption("keep", (), 100, 150, 0.0, 0)
        >>> whole = StageOption("whole", ("a",), 10, 160, 1.0, 5)
        >>> p = Profile((StageProfile("a", (keep, whole)),), (), baseline_peak_bytes=150, baseline_step_seconds=10.0)
        >>> plan_from_choices(p, [1], 200).checkpointed
        ['a']
    """
    baseline_cost = profile.baseline_cost(cost)
    extra = plan_cost(profile, choices, cost)
    stage_choices = []
    checkpointed: list[str] = []
    policies: dict[str, str] = {}
    for stage, c in zip(profile.stages, choices):
        option = stage.options[c]
        checkpointed.extend(option.checkpointed)
        if option.policy:
            policies.update({name: option.policy for name in option.checkpointed})
        stage_choices.append(
            StageChoice(stage.name, option.name, stage.options[0].stored_bytes, option.stored_bytes, float(option.cost(cost)))
        )
    return Plan(
        checkpointed=checkpointed,
        budget_bytes=int(budget_bytes),
        baseline_peak_bytes=int(profile.baseline_peak_bytes),
        predicted_peak_bytes=int(predict_peak(profile, choices)),
        predicted_overhead=float(extra / baseline_cost) if baseline_cost else 0.0,
        cost_kind=cost,
        requested_budget=requested_budget or str(budget_bytes),
        choices=stage_choices,
        parameter_bytes=profile.parameter_bytes,
        gradient_bytes=profile.gradient_bytes,
        optimizer_state_bytes=profile.optimizer_state_bytes,
        notes=list(profile.notes),
        sharding=dict(profile.sharding),
        policies=policies,
    )


def solve(profile: Profile, budget: int | str, cost: str = "time") -> Plan:
    """The least-cost recompute plan whose predicted peak is within ``budget``.

    Args:
        profile: from ``profile_step`` (or built by hand: the solver needs only numbers).
        budget: anything ``parse_budget`` accepts; ``"min"`` gives the plan of least peak and,
            among those, the least cost.
        cost: ``"time"`` prices recomputation by measured forward seconds, ``"flops"`` by counted
            FLOPs (deterministic).

    Raises:
        BudgetTooSmallError: (a ValueError) when no plan fits; it names the smallest reachable peak.

    Example:
        >>> from lightning_remat.core.memory_model import StageOption, StageProfile, Segment
        >>> keep = StageOption("keep", (), 100, 150, 0.0, 0)
        >>> whole = StageOption("whole", ("a",), 10, 160, 1.0, 5)
        >>> b = StageProfile("b", (keep, StageOption("whole", ("b",), 10, 160, 2.0, 9)))
        >>> profile = Profile((StageProfile("a", (keep, whole)), b), (Segment("head", 2, 50),),
        ...                   baseline_peak_bytes=250, baseline_step_seconds=10.0)
        >>> solve(profile, 200).checkpointed   # recomputing "a" is cheaper and enough
        ['a']
        >>> solve(profile, "min").predicted_peak_bytes
        160
    """
    # A percentage needs the device's memory; a size is taken as given (the integrations check it
    # against the device: the solver also serves synthetic profiles and devices that are not here).
    given = Budget.parse(budget)
    parsed = given.resolve(device=profile.device) if given.fraction is not None else (given.nbytes or MIN_BUDGET)
    choices = solve_choices(profile, parsed, cost)
    budget_bytes = predict_peak(profile, choices) if parsed == MIN_BUDGET else parsed
    return plan_from_choices(profile, choices, budget_bytes, cost, requested_budget=str(budget))
