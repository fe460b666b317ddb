"""The budget holds on real model definitions, and the model agrees with measurement: a sweep over
five models, run with pytest (about 5 minutes on 2 CPU cores; ResNet-50's profile alone is a minute):

    python -m pytest -q benchmarks/model_sweep.py

For GPT-2, BERT, ViT, ResNet-50 and a small Llama (transformers configs, random weights):
profile once, solve for budgets of static memory + 30%, 50% and 70% of the baseline's activation
memory and "min", apply each plan to a fresh copy and measure a steady-state training step (the
second, after Adam has created its state) with torch's MemTracker. ``REMAT_RESULTS=path`` appends
each model's figures to that file as JSON lines. The test suite runs the same checks on one small
GPT-2 (tests/test_models.py); this sweep was the suite's slowest module.
"""

import copy
import json
import os

import pytest
import torch

from lightning_remat import BudgetTooSmallError, apply_plan, profile_step, solve
from lightning_remat.runtime.measuring.measure import count_step_flops, measure_step
from lightning_remat.models import build
from lightning_remat.core.solve import least_peak

MODELS = {
    "gpt2": dict(layers=4, hidden=96, seq_len=96, batch_size=4),
    "bert": dict(layers=3, hidden=96, seq_len=96, batch_size=4),
    "vit": dict(layers=3, hidden=96, image_size=64, batch_size=8),
    "resnet50": dict(batch_size=4, image_size=64, width=2),
    "llama": dict(layers=3, hidden=96, seq_len=96, batch_size=4),
}
FRACTIONS = (0.3, 0.5, 0.7, "min")
TOLERANCE = 0.05
RESULTS: dict = {}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module", params=list(MODELS))
def profiled(request):
    case = build(request.param, **MODELS[request.param])
    optimizer = torch.optim.Adam(case.model.parameters())
    profile = profile_step(case.model, case.step, optimizer=optimizer)
    assert not optimizer.state, "profiling must not create optimizer state"
    yield case, profile
    if os.environ.get("REMAT_RESULTS"):
        with open(os.environ["REMAT_RESULTS"], "a") as f:
            f.write(json.dumps({request.param: RESULTS.get(request.param, {})}) + "\n")


def steady_state_peak(model, step):
    """Peak of the second training step (Adam's state exists from the first step on)."""
    optimizer = torch.optim.Adam(model.parameters())
    measure_step(model, step, optimizer)
    return measure_step(model, step, optimizer)


def budget_for(profile, fraction):
    if fraction == "min":
        return "min"
    return int(profile.static_bytes + fraction * profile.baseline_activation_bytes)


def test_the_baseline_prediction_matches_measurement(profiled):
    case, profile = profiled
    measured = steady_state_peak(copy.deepcopy(case.model), case.step).peak_bytes
    assert abs(profile.baseline_peak_bytes - measured) <= TOLERANCE * measured


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_the_budget_holds_and_the_prediction_is_within_five_percent(profiled, fraction):
    case, profile = profiled
    budget = budget_for(profile, fraction)
    try:
        plan = solve(profile, budget, cost="flops")
    except BudgetTooSmallError as err:
        # Below the smallest reachable peak the clear error is the expected result.
        assert err.smallest_peak_bytes == least_peak(profile) > budget
        RESULTS.setdefault(case.name, {})[str(fraction)] = {"infeasible": True, "least_peak": err.smallest_peak_bytes}
        return
    model = apply_plan(copy.deepcopy(case.model), plan)
    measured = steady_state_peak(model, case.step)
    error = (plan.predicted_peak_bytes - measured.peak_bytes) / measured.peak_bytes
    RESULTS.setdefault(case.name, {})[str(fraction)] = {
        "budget": plan.budget_bytes, "predicted": plan.predicted_peak_bytes, "measured": measured.peak_bytes,
        "error": error, "overhead": plan.predicted_overhead, "checkpointed": len(plan.checkpointed)}
    assert measured.peak_bytes <= plan.budget_bytes
    assert abs(error) <= TOLERANCE
    if fraction != "min":
        assert plan.predicted_peak_bytes < profile.baseline_peak_bytes


def test_no_more_overhead_than_hugging_face_at_its_own_peak(profiled):
    case, profile = profiled
    hf_model = copy.deepcopy(case.model)
    if not case.supports_hf_checkpointing:
        # transformers' ResNet has no checkpointing of its own: there is no peer to compare with,
        # and our plans are its only way to recompute.
        with pytest.raises(ValueError, match="does not support"):
            hf_model.gradient_checkpointing_enable()
        return
    hf_model.gradient_checkpointing_enable()
    hf_peak = steady_state_peak(hf_model, case.step).peak_bytes
    baseline_flops = count_step_flops(copy.deepcopy(case.model), case.step)
    hf_overhead = count_step_flops(hf_model, case.step) / baseline_flops - 1
    plan = solve(profile, hf_peak, cost="flops")
    ours = apply_plan(copy.deepcopy(case.model), plan)
    our_overhead = count_step_flops(ours, case.step) / baseline_flops - 1
    our_peak = steady_state_peak(ours, case.step).peak_bytes
    RESULTS.setdefault(case.name, {})["vs_hf"] = {
        "hf_peak": hf_peak, "hf_overhead": hf_overhead, "our_peak": our_peak, "our_overhead": our_overhead}
    assert our_peak <= hf_peak
    assert our_overhead <= hf_overhead + 1e-9
