"""The exact solver: a dynamic programme over stages keeping the Pareto frontier of (bytes stored, cost so far),
exact since fewer stored bytes never hurt a later term; ``budget="min"`` uses (stored bytes, peak so far)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from .binding import OPTIMIZER, describe, optimizer_advice
from .budget import MIN_BUDGET, Budget
from .calls import tied_dp
from .errors import BudgetTooSmallError, ShardedBudgetTooSmallError
from .memory_model import Profile
from .shared_held import exact_peak, slack
from .spans import block_ranges, span_rows
from .plan import Plan, StageAction, StageChoice
from .predict import actions_of, predict
from .vocabulary import CostKind

# Beyond this many Pareto points the frontier keeps the cheapest point per band of stored bytes (and the
# one that stores least): plans stay feasible, optimal within one band (1/MAX_FRONTIER of the range).
MAX_FRONTIER = 1_000


@dataclass
class _Arrays:
    stored: np.ndarray  # [stage, option] bytes (below zero where a sharded stage frees more than it keeps)
    local: np.ndarray  # [stage, option] local peak bytes
    cost: np.ndarray  # [stage, option]
    segment_peak: np.ndarray  # [k] the largest segment peak with k stages alive, -inf if none
    # [stage] how many options it has: the rows beyond are padding (not marked by -1: a sharded stage's real figure).
    options: np.ndarray
    # [stage] whether nothing stored before it is alive when it runs (``StageProfile.fresh``)
    fresh: np.ndarray


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
            cost[i, j] = option.costs[kind]
    # "No segment here": far below any figure, yet far enough from int64's least that no sum wraps around.
    segment_peak = np.full(n + 1, -(2**62), dtype=np.int64)
    for segment in profile.segments:
        if not 0 <= segment.stages_alive <= n:
            raise ValueError(f"segment {segment.name!r} has stages_alive={segment.stages_alive} outside 0..{n}")
        segment_peak[segment.stages_alive] = max(segment_peak[segment.stages_alive], segment.peak_bytes)
    return _Arrays(stored, local, cost, segment_peak,
                   np.array([len(s.options) for s in profile.stages], dtype=np.int64),
                   np.array([s.fresh for s in profile.stages], dtype=bool))


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
        # Along the frontier the second coordinate falls as the first grows: a band's last point is its cheapest.
        last_of_band = np.append(band[1:] != band[:-1], True)
        last_of_band[0] = True  # and the point that stores least, which keeps tight budgets feasible
        keep = keep[last_of_band]
    return keep


def _span_transitions(profile: Profile, kind: str) -> list[np.ndarray]:
    """Per end position ``p``, the spans ending there as float64 rows (first, stored, local, cost)."""
    ends: list[list[tuple[float, ...]]] = [[] for _ in range(len(profile.stages) + 1)]
    # No span in a step that runs backward more than once (``StageProfile.fresh``): its figures assume one.
    for first, last, stored, local, costs in [] if any(s.fresh for s in profile.stages) else span_rows(profile):
        ends[last + 1].append((first, stored, local, costs[kind]))
    return [np.array(rows, dtype=np.float64).reshape(-1, 4) for rows in ends]


def _frontier_dp(arrays: _Arrays, budget: int | None,
                 spans: list[np.ndarray] | None = None) -> tuple[list[int], list[tuple[int, int]]] | None:
    """Option per stage and spans of the least-cost plan within ``budget`` (None: least peak), or None."""
    n = arrays.stored.shape[0]
    minimise_peak = budget is None
    # The second coordinate: cost so far (budget mode) or peak so far (min mode).
    value = np.array([max(0, int(arrays.segment_peak[0]))], dtype=np.float64) if minimise_peak else np.zeros(1)
    if not minimise_peak and arrays.segment_peak[0] > budget:
        return None
    frontiers: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(1, dtype=np.int64), value)]
    # Per position: the position and index of each point's parent, and the option taken (-1: a span).
    back: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = [(np.zeros(0, np.int64),) * 3]
    for p in range(1, n + 1):
        i = p - 1
        width = int(arrays.options[i])
        origin, t_option = np.full(width, i, dtype=np.int64), np.arange(width, dtype=np.int64)
        t_stored, t_local, t_cost = arrays.stored[i, :width], arrays.local[i, :width], arrays.cost[i, :width]
        if spans is not None and len(spans[p]):
            table = spans[p]
            origin = np.concatenate((origin, table[:, 0].astype(np.int64)))
            t_stored = np.concatenate((t_stored, table[:, 1].astype(np.int64)))
            t_local = np.concatenate((t_local, table[:, 2].astype(np.int64)))
            t_cost = np.concatenate((t_cost, table[:, 3]))
            t_option = np.concatenate((t_option, np.full(len(table), -1, dtype=np.int64)))
        sizes = np.array([len(frontiers[o][0]) for o in origin], dtype=np.int64)
        src_stored = np.concatenate([frontiers[o][0] for o in origin])
        if arrays.fresh[i]:
            src_stored = np.zeros_like(src_stored)  # the stages before it were done with (backward ran)
        src_value = np.concatenate([frontiers[o][1] for o in origin])
        which = np.repeat(np.arange(len(origin)), sizes)
        src_index = np.arange(len(src_stored)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        local_peak = t_local[which] + src_stored
        new_stored = src_stored + t_stored[which]
        segment = arrays.segment_peak[p]
        if minimise_peak:
            new_value = np.maximum(np.maximum(src_value, local_peak.astype(np.float64)),
                                   (segment + new_stored).astype(np.float64))
            idx = np.arange(len(new_value))
        else:
            new_value = src_value + t_cost[which]
            idx = np.nonzero((local_peak <= budget) & (segment + new_stored <= budget))[0]
        if len(idx) == 0:
            return None
        keep = idx[_pareto(new_stored[idx], new_value[idx])]
        frontiers.append((new_stored[keep], new_value[keep]))
        back.append((origin[which[keep]], src_index[keep], t_option[which[keep]]))
    # Least value; among equal values the first (least stored bytes) because of the sort.
    best = int(np.argmin(frontiers[n][1]))
    choices = [0] * n
    taken: list[tuple[int, int]] = []
    p = n
    while p > 0:
        origin_p, parent, option = (int(a[best]) for a in back[p])
        if option >= 0:
            choices[p - 1] = option
        else:
            taken.append((origin_p, p - 1))
        p, best = origin_p, parent
    return choices, sorted(taken)


@dataclass
class Solution:
    """Option index per stage and the spans ``(first, last)`` recomputed as one segment each."""

    choices: list[int]
    spans: list[tuple[int, int]]


def _dp(profile: Profile, cost: str) -> Callable[[int | None], tuple | None]:
    """Budget -> the option per stage and the spans of the least-cost plan within it, or None (budget None: of the
    least peak): the chain's DP, or ``core.calls``' where a module stands at several places (no spans)."""
    if any(s.call for s in profile.stages):
        def tied(budget: int | None) -> tuple | None:
            choices = tied_dp(profile, budget, cost)
            return None if choices is None else (choices, [])
        return tied
    arrays, spans = _arrays(profile, cost), _span_transitions(profile, cost)
    return lambda budget: _frontier_dp(arrays, budget, spans)


def least_peak(profile: Profile) -> int:
    """The smallest peak any plan reaches under the memory model."""
    return exact_peak(profile, *_dp(profile, "flops")(None))


def solve_segmentation(profile: Profile, budget: int | str, cost: str = "time") -> Solution:
    """The least-cost plan within ``budget`` (bytes or ``"min"``), or BudgetTooSmallError. The DP bounds the peak
    counting shared inputs in every holder: where that over-counts (``slack``) it searches within budget plus slack."""
    CostKind.check(cost)
    dp, exact = _dp(profile, cost), lambda found: exact_peak(profile, *found)
    if not profile.stages:
        raise ValueError("the profile has no candidate stages to recompute")
    least = dp(None) if budget == MIN_BUDGET else None
    budget = exact(least) if least is not None else int(budget)
    found = dp(budget)
    if found is None and slack(profile):
        wider = dp(budget + slack(profile))
        least = least or dp(None)
        found = next((f for f in (wider, least) if f is not None and exact(f) <= budget), None)
    if found is None:
        raise BudgetTooSmallError(budget, exact(least or dp(None)), profile.static_bytes)
    return Solution(*found)


def plan_from_choices(profile: Profile, choices: Sequence[int], budget_bytes: int, cost: str = "time",
                      requested_budget: str = "", spans: Sequence[tuple[int, int]] = ()) -> Plan:
    """The Plan for given option indices and spans."""
    kind = CostKind.check(cost)
    actions = actions_of(profile, choices, spans)
    predicted = predict(profile, actions, kind)
    stage_choices = []
    in_span = {k: (first, last) for first, last in spans for k in range(first, last + 1)}
    blocks = {(first, last): module for first, last, module in block_ranges(profile)}
    for k, (stage, c) in enumerate(zip(profile.stages, choices)):
        if k in in_span:
            first, last = in_span[k]
            option = stage.option("whole")
            # The span's stored bytes are its last stage's "whole" ones (core.spans); its cost, the sum of its stages'.
            stored = option.stored_bytes if k == last else 0
            label = (f"block {blocks[first, last]} whole" if (first, last) in blocks
                     else f"segment {profile.stages[first].name}..{profile.stages[last].name}")
        else:
            option = stage.options[c]
            label, stored = option.name, option.stored_bytes
        choice = StageChoice(stage.name, label, stage.options[0].stored_bytes, stored, float(option.costs[kind]))
        if stage.call and k not in in_span:  # a later place of a module (core.calls): one choice, its places summed
            at = next(j for j in range(len(stage_choices) - 1, -1, -1) if stage_choices[j].stage == stage.name)
            first = stage_choices[at]
            stage_choices[at] = replace(
                first, baseline_stored_bytes=first.baseline_stored_bytes + choice.baseline_stored_bytes,
                stored_bytes=first.stored_bytes + choice.stored_bytes, cost=first.cost + choice.cost)
        else:
            stage_choices.append(choice)
    return Plan(
        actions=actions,
        budget_bytes=int(budget_bytes),
        baseline_peak_bytes=int(profile.baseline_peak_bytes),
        predicted_peak_bytes=predicted.peak_bytes,
        predicted_overhead=predicted.overhead,
        cost_kind=kind,
        requested_budget=requested_budget or str(budget_bytes),
        choices=stage_choices,
        parameter_bytes=profile.parameter_bytes,
        gradient_bytes=profile.gradient_bytes,
        optimizer_state_bytes=profile.optimizer_state_bytes,
        notes=profile.notes,
        sharding=profile.sharding,
        host_bytes=predicted.host_bytes,
        binding=_binding(profile, predicted.binding),
        fingerprint=profile.fingerprint,  # the profiled model's shapes: apply_plan refuses other ones
    )


def _binding(profile: Profile, term: Any) -> dict[str, Any] | None:
    """What binds the plan's peak, with optimizer advice when the optimizer step binds."""
    if term is None:
        return None
    found = describe(profile, term)
    if found.term == OPTIMIZER:
        found = replace(found, advice=optimizer_advice(profile, least_peak))
    return found.to_dict()


def solve_recompute_everything(stages: Sequence[str], budget: int | str, cost: str = "time",
                               requested_budget: str = "", note: str = "") -> Plan:
    """The plan made without a profile (profiling ran out of memory): every stage recomputed whole."""
    return Plan(actions=[StageAction.recompute(s) for s in stages],
                budget_bytes=budget if isinstance(budget, int) and not isinstance(budget, bool) else None,
                baseline_peak_bytes=None, predicted_peak_bytes=None, predicted_overhead=None,
                cost_kind=CostKind.check(cost), requested_budget=requested_budget or str(budget),
                notes=[note] if note else [])


def solve(profile: Profile, budget: int | str, cost: str = "time") -> Plan:
    """The least-cost recompute plan whose predicted peak is within ``budget``.

    Args:
        budget: anything ``parse_budget`` accepts; ``"min"``: the least peak, then the least cost.
        cost: ``"time"``, ``"flops"`` or ``"roofline"``.

    Raises:
        BudgetTooSmallError: no plan fits; it names the smallest reachable peak.

    Example:
        >>> from lightning_remat.core.memory_model import Costs, StageAction, StageOption, StageProfile, Segment
        >>> def stage(name, cost):
        ...     whole = StageOption("whole", StageAction.recompute(name), 10, 160, cost)
        ...     return StageProfile(name, (StageOption("keep", StageAction(name), 100, 150), whole))
        >>> a, b = stage("a", Costs(1.0, 5)), stage("b", Costs(2.0, 9))
        >>> profile = Profile((a, b), (Segment("head", 2, 50),), baseline_peak_bytes=250, baseline_costs=Costs(10.0))
        >>> solve(profile, 200).checkpointed   # recomputing "a" is cheaper and enough
        ['a']
    """
    # A size is taken as given (the integrations check it against the device): synthetic profiles, remote devices.
    given = Budget.parse(budget)
    parsed = given.resolve(device=profile.device) if given.fraction is not None else (given.nbytes or MIN_BUDGET)
    found = solve_segmentation(profile, parsed, cost)
    budget_bytes = exact_peak(profile, found.choices, found.spans) if parsed == MIN_BUDGET else parsed
    return plan_from_choices(profile, found.choices, budget_bytes, cost, requested_budget=str(budget), spans=found.spans)


def smallest_world_size(least_peak: int, sharded_static: int, world_size: int, budget: int) -> int | None:
    """The least world size at which the least peak fits ``budget``, or None (only ``sharded_static`` shrinks)."""
    room = budget - (least_peak - sharded_static)
    if room <= 0:
        return None
    return max(world_size, math.ceil(sharded_static * world_size / room))


def solve_sharded(profile: Profile, budget: int | str, cost: str) -> Plan:
    """``solve``, raising ``ShardedBudgetTooSmallError`` (naming a world size) on a sharded (FSDP2) profile."""
    try:
        return solve(profile, budget, cost=cost)
    except BudgetTooSmallError as error:
        world_size = int((profile.sharding or {}).get("world_size", 1))
        if world_size <= 1 or not isinstance(error.budget_bytes, int):
            raise
        sharded = profile.parameter_bytes + profile.gradient_bytes + profile.optimizer_state_bytes
        # Only parameters and optimizer state surely shrink (gradients may not exist yet): errs towards more GPUs.
        shrinking = profile.parameter_bytes + profile.optimizer_state_bytes
        raise ShardedBudgetTooSmallError(
            error.budget_bytes, error.smallest_peak_bytes, sharded, world_size,
            smallest_world_size(error.smallest_peak_bytes, shrinking, world_size, error.budget_bytes)) from None
