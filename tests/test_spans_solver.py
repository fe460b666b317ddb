"""The solver with multi-stage spans against exhaustive search over every segmentation x option."""

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_remat import BudgetTooSmallError, Costs, Profile, Segment, StageAction, StageOption, StageProfile, solve
from lightning_remat.core.solve import least_peak, solve_segmentation
from lightning_remat.core.spans import (max_span_length, plan_cost_spans, predict_peak_spans, span_option,
                                        span_ranges)
from tests.profile_strategies import random_profiles


def profiles(max_stages=7, max_options=3):
    return random_profiles(max_stages=max_stages, max_options=max_options, span_groups=True)


def allowed_spans(profile):
    limit = max_span_length(len(profile.stages))
    has_whole = [any(o.name == "whole" for o in s.options) for s in profile.stages]
    return {(a, b) for start, end in span_ranges(profile) for a in range(start, end) for b in range(a + 1, end)
            if b - a + 1 <= limit and all(has_whole[a:b + 1])}


def all_plans(profile):
    """Every (choices, spans): each segmentation into single stages and allowed spans, x the options."""
    n = len(profile.stages)
    allowed = allowed_spans(profile)

    def segmentations(i):
        if i == n:
            yield []
            return
        yield from ([None] + rest for rest in segmentations(i + 1))
        for a, b in allowed:
            if a == i:
                yield from ([(a, b)] + rest for rest in segmentations(b + 1))

    for seg in segmentations(0):
        spans = [s for s in seg if s is not None]
        inside = {k for a, b in spans for k in range(a, b + 1)}
        ranges = [[0] if k in inside else range(len(s.options)) for k, s in enumerate(profile.stages)]
        for choices in itertools.product(*ranges):
            yield list(choices), spans


def brute_force(profile, budget, kind):
    best = None
    for choices, spans in all_plans(profile):
        if predict_peak_spans(profile, choices, spans) <= budget:
            cost = plan_cost_spans(profile, choices, kind, spans)
            if best is None or cost < best:
                best = cost
    return best


@settings(max_examples=150, deadline=None)
@given(profiles(), st.floats(0.0, 1.0), st.sampled_from(["flops", "time", "roofline"]))
def test_solve_with_spans_equals_exhaustive_search(profile, fraction, kind):
    peaks = [predict_peak_spans(profile, c, s) for c, s in all_plans(profile)]
    lowest, highest = min(peaks), max(peaks)
    assert least_peak(profile) == lowest
    budget = int(lowest - 1 + fraction * (highest - lowest + 1))
    expected = brute_force(profile, budget, kind)
    if expected is None:
        with pytest.raises(BudgetTooSmallError):
            solve_segmentation(profile, budget, kind)
        return
    found = solve_segmentation(profile, budget, kind)
    assert predict_peak_spans(profile, found.choices, found.spans) <= budget
    assert plan_cost_spans(profile, found.choices, kind, found.spans) == pytest.approx(expected, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(profiles(max_stages=8, max_options=2))
def test_min_with_spans_is_the_least_peak_then_the_least_cost(profile):
    lowest = min(predict_peak_spans(profile, c, s) for c, s in all_plans(profile))
    found = solve_segmentation(profile, "min", "flops")
    assert predict_peak_spans(profile, found.choices, found.spans) == lowest
    assert plan_cost_spans(profile, found.choices, "flops", found.spans) == brute_force(profile, lowest, "flops")


def _mlp_like(n, group=True):
    # Each stage keeps 5 units (its output 1 and 4 inside) or, recomputed, its output only.
    stages = tuple(StageProfile(f"c.{i}", (StageOption("keep", StageAction(f"c.{i}"), 5, 8),
                                           StageOption("whole", StageAction.recompute(f"c.{i}"), 1, 9, Costs(1.0, 10))))
                   for i in range(n))
    groups = (tuple(s.name for s in stages),) if group else ()
    return Profile(stages, (Segment("head", n, 20),), baseline_costs=Costs(time=n, flops=30 * n),
                   span_groups=groups)


def test_spans_reach_below_per_stage_recompute_on_a_chain():
    n = 25
    alone = least_peak(_mlp_like(n, group=False))
    plan = solve(_mlp_like(n), "min", cost="flops")
    assert alone == 20 + n  # every stage recomputed alone: the head plus every output
    assert plan.predicted_peak_bytes < alone
    assert plan.segments and all(len(s) >= 2 for s in plan.segments)
    names = [n for s in plan.segments for n in s]
    assert not set(names) & set(plan.checkpointed)
    assert [c.stage for c in plan.choices] == [s.name for s in _mlp_like(n).stages]
    assert type(plan).from_dict(plan.to_dict()) == plan


def test_span_figures_are_derived_from_keep_and_whole():
    p = _mlp_like(4)
    span = span_option(p, 1, 3)
    # Keep terms: 8 + 5 + 5 (stages 1, 2 recomputed and held while stage 3 runs); the end of the
    # recompute: the gap after stage 3 (the head, 20) + 5 + 5 + the span's output 1.
    assert (span.stored_bytes, span.local_peak_bytes, span.costs.flops) == (1, 31, 30)
    # No segment after stage 1: the last stage runs as recomputed alone (9) while stage 0 holds 5.
    assert span_option(p, 0, 1).local_peak_bytes == 9 + 5
    assert Profile.from_dict(p.to_dict()) == p
    assert Profile.from_dict({k: v for k, v in p.to_dict().items() if k != "span_groups"}).span_groups == ()


def test_solve_with_spans_on_1000_stages_is_fast():
    p = _mlp_like(1000)
    # This process's CPU time, not the wall clock: other processes on a busy machine (CI's 2 cores,
    # a second xdist worker) stretch the wall clock, not the work the solver does.
    start = time.process_time()
    plan = solve(p, "min", cost="flops")
    budget_plan = solve(p, int(plan.predicted_peak_bytes * 1.5), cost="flops")
    seconds = time.process_time() - start
    assert budget_plan.predicted_peak_bytes <= int(plan.predicted_peak_bytes * 1.5)
    assert seconds < 5.0, seconds  # two solves, about 0.6 s each on one core


@settings(max_examples=150, deadline=None)
@given(profiles())
def test_incremental_span_rows_equal_span_option(profile):
    # The solver reads span_rows (built incrementally); predictions read span_option: they must agree.
    from lightning_remat.core.spans import span_rows
    for first, last, *figures in span_rows(profile):
        span = span_option(profile, first, last)
        assert (span.stored_bytes, span.local_peak_bytes, span.costs) == tuple(figures)


def test_spans_are_priced_in_roofline_seconds_under_the_roofline_cost():
    # A span's roofline cost is its stages' "whole" roofline seconds (it was priced in FLOPs).
    stages = tuple(StageProfile(f"c.{i}", (StageOption("keep", StageAction(f"c.{i}"), 5, 8), StageOption(
        "whole", StageAction.recompute(f"c.{i}"), 1, 9, Costs(1.0, 10**6, 0.25)))) for i in range(6))
    p = Profile(stages, (Segment("head", 6, 20),), baseline_costs=Costs(time=6, flops=3 * 10**6, roofline=3.0),
                span_groups=(tuple(s.name for s in stages),))
    assert span_option(p, 0, 2).costs["roofline"] == 0.75
    plan = solve(p, "min", cost="roofline")
    assert plan.segments and plan.predicted_overhead <= 6 * 0.25 / 3.0
