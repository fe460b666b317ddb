"""The planning service every integration shares: fallback, errors across ranks, metrics."""

import pickle
import warnings

import pytest
import torch
from torch import nn

from lightning_remat import BudgetTooSmallError, Plan, RematConfig, StageAction, plan_remat
from lightning_remat.service.channel import travelling
from lightning_remat.service.run import plan_metrics
from lightning_remat.service.planning import Planner


def _blocks():
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)])


def test_a_bare_memory_error_while_profiling_falls_back_without_crashing():
    model = _blocks()

    def step(m):
        raise MemoryError()  # no message at all

    with pytest.warns(UserWarning, match=r"out of memory while profiling \(MemoryError: MemoryError\)"):
        plan = Planner(RematConfig("min", cost="flops")).decide_or_fall_back(model, step)
    assert plan.fallback and plan.checkpointed == ["0", "1", "2"]
    # "min" was never resolved: no budget of 0 is reported, and nothing predicted is either.
    assert plan_metrics(plan) == {"remat/num_checkpointed": 3.0}


def test_an_error_reaches_other_ranks_with_its_message_hint_and_fields():
    error = BudgetTooSmallError(100, 150, 80)
    error.add_hint("(AutoRemat, budget='100B')")
    travelled = pickle.loads(pickle.dumps(travelling(error, rank=0)))
    with pytest.raises(BudgetTooSmallError) as raised:
        raise travelled
    assert str(raised.value) == str(error) and "of which 80 B" in str(raised.value)
    assert (raised.value.budget_bytes, raised.value.smallest_peak_bytes) == (100, 150)
    other = pickle.loads(pickle.dumps(travelling(TypeError("bad step"), rank=0)))
    with pytest.raises(RuntimeError, match="planning failed on rank 0: TypeError: bad step"):
        raise other


def test_metrics_of_a_plan_and_its_measured_step():
    plan = Plan([StageAction.recompute("h.0")], 1000, 2000, 900, 0.25)
    assert plan_metrics(plan, 950) == {
        "remat/num_checkpointed": 1.0, "remat/budget_bytes": 1000.0, "remat/baseline_peak_bytes": 2000.0,
        "remat/predicted_peak_bytes": 900.0, "remat/predicted_overhead": 0.25, "remat/measured_peak_bytes": 950.0}


def test_a_real_profile_for_another_device_is_refused():
    model = _blocks()
    with pytest.raises(ValueError, match="fake=True"):
        plan_remat(model, lambda m: m(torch.randn(4, 16)).sum(), "min", device="cuda:7")


def test_a_cuda_budget_above_what_the_device_has_left_is_warned_about(monkeypatch):
    from lightning_remat.service import planning

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 * 2**30)
    with pytest.warns(UserWarning, match="above what cuda:0 has available to this process"):
        planning._warn_if_beyond_the_device(80 * 2**30, torch.device("cuda:0"))  # "100%" of an 80 GiB card
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planning._warn_if_beyond_the_device(60 * 2**30, torch.device("cuda:0"))


def test_a_plan_priced_in_measured_seconds_says_its_figures_move_and_points_to_flops():
    from lightning_remat import plan_remat
    from lightning_remat.service.planning import MEASURED_TIME_NOTE

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)])
    x = torch.randn(32, 16)
    timed = plan_remat(net, lambda m: m(x).square().mean(), "min", cost="time", verbose=False)
    assert MEASURED_TIME_NOTE in timed.notes and "cost='flops'" in timed.summary()
    counted = plan_remat(net, lambda m: m(x).square().mean(), "min", cost="flops", verbose=False)
    assert MEASURED_TIME_NOTE not in counted.notes
