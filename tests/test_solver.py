"""The solver against exhaustive search on random synthetic profiles."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_remat import BudgetTooSmallError, Costs, Profile, Segment, StageAction, StageOption, StageProfile, solve
from lightning_remat.core.memory_model import predict_peak
from lightning_remat.core.spans import plan_cost_spans
from lightning_remat.core.solve import least_peak, plan_from_choices, solve_segmentation
from tests.profile_strategies import random_profiles


def profiles(max_stages=8, max_options=3):
    return random_profiles(max_stages=max_stages, max_options=max_options, policies=True)


def all_plans(profile):
    return itertools.product(*[range(len(s.options)) for s in profile.stages])


def brute_force(profile, budget, kind):
    """(least cost, its peak) among plans within budget, or None."""
    best = None
    for choices in all_plans(profile):
        peak = predict_peak(profile, choices)
        if peak <= budget:
            cost = plan_cost_spans(profile, choices, kind)
            if best is None or cost < best[0]:
                best = (cost, peak)
    return best


def brute_least_peak(profile):
    return min(predict_peak(profile, c) for c in all_plans(profile))


@settings(max_examples=150, deadline=None)
@given(profiles(), st.floats(0.0, 1.0), st.sampled_from(["flops", "time", "roofline"]))
def test_solve_equals_exhaustive_search(profile, fraction, kind):
    lowest = brute_least_peak(profile)
    highest = max(predict_peak(profile, c) for c in all_plans(profile))
    # Budgets across the feasible range, and just below it.
    budget = int(lowest - 1 + fraction * (highest - lowest + 1))
    expected = brute_force(profile, budget, kind)
    if expected is None:
        with pytest.raises(BudgetTooSmallError) as err:
            solve_segmentation(profile, budget, kind).choices
        assert err.value.smallest_peak_bytes == lowest
        return
    choices = solve_segmentation(profile, budget, kind).choices
    assert predict_peak(profile, choices) <= budget
    assert plan_cost_spans(profile, choices, kind) == pytest.approx(expected[0], abs=1e-9)
    # (plan_from_choices, as solve builds it: a zero-byte budget of a degenerate profile is not a
    # budget solve accepts from a user)
    plan = plan_from_choices(profile, choices, budget, kind)
    # The plan carries the policy of every module an option with a policy recomputes.
    chosen = [s.option(c.option) for s, c in zip(profile.stages, plan.choices)]
    assert plan.policies == {m: o.action.policy for o in chosen if o.action.policy for m in o.action.modules}


@settings(max_examples=150, deadline=None)
@given(profiles(max_stages=12, max_options=2))
def test_min_is_the_least_peak_then_the_least_cost(profile):
    lowest = brute_least_peak(profile)
    assert least_peak(profile) == lowest
    choices = solve_segmentation(profile, "min", "flops").choices
    assert predict_peak(profile, choices) == lowest
    cheapest_at_lowest = brute_force(profile, lowest, "flops")[0]
    assert plan_cost_spans(profile, choices, "flops") == cheapest_at_lowest


def _chain(n=5):
    stages = tuple(StageProfile(f"h.{i}", (StageOption("keep", StageAction(f"h.{i}"), 100, 400), StageOption(
        "whole", StageAction.recompute(f"h.{i}"), 10, 420, Costs(1.0 + i, 10 + i)))) for i in range(n))
    return Profile(stages, (Segment("head", n, 300), Segment("optimizer step", 0, 350)), parameter_bytes=200,
                   baseline_peak_bytes=800, baseline_costs=Costs(time=20.0, flops=200), device="cpu")


def test_plan_fields_and_round_trip():
    profile = _chain()
    plan = solve(profile, 650, cost="flops")
    assert plan.predicted_peak_bytes <= plan.budget_bytes == 650
    best_cost, _ = brute_force(profile, 650, "flops")
    assert plan.predicted_overhead == pytest.approx(best_cost / 200)
    # The peak (800) must drop by 150; each recomputed stage frees 90, so two must go, and the
    # two cheapest are the first two.
    assert plan.checkpointed == ["h.0", "h.1"]
    assert [c.option for c in plan.choices] == ["whole"] * 2 + ["keep"] * 3
    assert plan.predicted_peak_bytes == 620
    assert plan.baseline_peak_bytes == 800
    assert type(plan).from_dict(plan.to_dict()) == plan
    text = plan.summary()
    assert "h.0" in text and "whole" in text and "overhead" in text


def test_budget_below_the_smallest_peak_says_that_peak():
    profile = _chain()
    lowest = least_peak(profile)
    with pytest.raises(BudgetTooSmallError, match="smallest reachable peak") as err:
        solve(profile, lowest - 1)
    assert err.value.smallest_peak_bytes == lowest
    assert str(lowest) in str(err.value)


def test_min_budget_and_string_budgets():
    profile = _chain()
    plan = solve(profile, "min")
    assert plan.predicted_peak_bytes == least_peak(profile) == plan.budget_bytes
    assert solve(profile, "1GB").checkpointed == []  # everything fits: nothing recomputed


def test_profile_round_trip_and_no_stage_error():
    profile = _chain()
    assert Profile.from_dict(profile.to_dict()) == profile
    with pytest.raises(ValueError, match="no candidate stages"):
        solve(Profile((), ()), 100)
    with pytest.raises(ValueError, match="cost must be one of"):
        solve(profile, 700, cost="joules")


def test_a_stage_whose_stored_bytes_are_below_zero_is_solved():
    """A sharded (FSDP2) stage may store less than nothing (it frees the unsharded parameters an
    earlier figure counted): a real figure, not a missing option. The solver used -1 as padding for
    stages with fewer options and dropped such options, and with every option of a stage below zero
    failed ("need at least one array to concatenate")."""
    from lightning_remat.core.memory_model import Profile, Segment, StageOption, StageProfile, predict_peak
    from lightning_remat.core.solve import least_peak, solve

    first = StageProfile("a", (StageOption("keep", StageAction("a"), -50, 100),
                               StageOption("whole", StageAction.recompute("a"), -60, 110, Costs(1.0, 5))))
    second = StageProfile("b", (StageOption("keep", StageAction("b"), 40, 120),))
    profile = Profile((first, second), (Segment("head", 2, 200),))
    # keep, keep: max(100, -50 + 120, -10 + 200) = 190; whole, keep: max(110, -60 + 120, -20 + 200) = 180
    assert [predict_peak(profile, c) for c in ([0, 0], [1, 0])] == [190, 180]
    assert least_peak(profile) == 180 and solve(profile, 185, "flops").checkpointed == ["a"]
