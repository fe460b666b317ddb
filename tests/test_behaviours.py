"""Behaviours are plug-ins (issue 30): one registered from outside the package, with its own setting on
a plan's actions (``StageAction.extra``) and its own cross-action rule, is installed, composed with the
built-in ones, checked, snapshotted, restored and taken off by the installer, which does not know it; one
that offers an option (``stage_options.OFFERS``) is measured, priced, planned and predicted by the profiler
and the solver, which do not know it either."""

import copy
import functools

import pytest
import torch
from torch import nn

from lightning_remat import Costs, measure_step, profile_step
from lightning_remat.core.actions import RULES, add_rule
from lightning_remat.core.errors import InvalidPlanError
from lightning_remat.core.plan import Plan, StageAction
from lightning_remat.core.vocabulary import Action
from lightning_remat.runtime.installing.installer import install, restore, snapshot, uninstall
from lightning_remat.runtime.installing.records import RECORD, Behaviour, record_of, register, unregister
from lightning_remat.runtime.installing.installer import installed_actions, planned_actions
from lightning_remat.core.solve import plan_from_choices
from lightning_remat.runtime.profiling.stage_options import OFFERS


def _counted_call(calls, call, *args, **kwargs):
    calls.append(torch.is_grad_enabled())
    return call(*args, **kwargs)


class Counted(Behaviour):
    """A toy: counts the calls of a module's forward (its state), touching nothing they compute."""

    name = "counted"  # its setting: the one a plan's action holds in ``extra["counted"]``

    def install(self, target, settings):
        for name, setting in settings.items():
            record_of(target.modules[name]).behaviours[self.name] = (setting, [])

    def wrap(self, module, setting, calls, call):
        return functools.partial(_counted_call, calls, call)


def _not_offloaded(actions):
    """The toy's own rule: an offloaded stage is not counted."""
    bad = [a.stage for a in actions if a.action is Action.OFFLOAD and "counted" in dict(a.extra)]
    if bad:
        raise InvalidPlanError(f"counted stages are not offloaded: {bad}")


@pytest.fixture
def counted():
    behaviour = register(Counted())  # innermost: inside a recompute's checkpoint, so it runs again there
    add_rule(_not_offloaded)
    yield behaviour
    unregister(behaviour.name)
    RULES.remove(_not_offloaded)


def _chain():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.Tanh()) for _ in range(3)])


def _grads(model, x):
    torch.manual_seed(1)
    model(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


def test_a_behaviour_registered_from_a_test_installs_composes_round_trips_and_comes_off(counted):
    plain, model = _chain(), _chain()
    plan = Plan([StageAction("0", extra={"counted": "alone"}),
                 StageAction("1", Action.RECOMPUTE, policy="save_matmuls", extra={"counted": "recomputed"})])
    install(model, plan)
    assert installed_actions(model) == planned_actions(plan)
    assert installed_actions(model)["counted"] == {"0": "alone", "1": "recomputed"}
    x = torch.randn(4, 8)
    for ours, theirs in zip(_grads(model, x), _grads(plain, x)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # Stage 0 ran once; stage 1 once in forward and once more, inside its checkpoint, in backward.
    calls = {n: model[int(n)].__dict__[RECORD].behaviours["counted"][1] for n in ("0", "1")}
    assert calls == {"0": [True], "1": [True, True]}
    # The installed plan is the snapshot, and restoring it installs it again.
    taken = snapshot(model)
    assert taken == plan
    restore(uninstall(model), taken)
    assert snapshot(model) == plan and installed_actions(model) == planned_actions(plan)
    for ours, theirs in zip(_grads(model, x), _grads(plain, x)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # Off again: every module has exactly the forward it had.
    uninstall(model)
    assert all("forward" not in m.__dict__ and RECORD not in m.__dict__ for m in model.modules())
    torch.manual_seed(2)
    out = model(x)
    torch.manual_seed(2)
    assert torch.equal(out, plain(x))


def test_a_registered_behaviours_rule_refuses_a_plan_before_anything_changes(counted):
    model = _chain()
    before = copy.copy(model.__dict__), [dict(m.__dict__) for m in model.modules()]
    with pytest.raises(InvalidPlanError, match=r"counted stages are not offloaded: \['2'\]"):
        install(model, Plan([StageAction("2", Action.OFFLOAD, extra={"counted": 1})]))
    assert (copy.copy(model.__dict__), [dict(m.__dict__) for m in model.modules()]) == before


def test_extra_settings_round_trip_through_the_plans_dict():
    plan = Plan([StageAction("h.0", extra={"counted": "alone"}), StageAction.recompute("h.1")])
    data = plan.to_dict()
    assert data["actions"][0]["extra"] == {"counted": "alone"} and "extra" not in data["actions"][1]
    assert Plan.from_dict(data) == plan


def _held_call(held, call, *args, **kwargs):
    out = call(*args, **kwargs)
    held.append(out.detach().clone())
    return out


class Held(Behaviour):
    """A toy with a memory cost: keeps a copy of each output of its module (its state) until it comes off."""

    name = "held"

    def install(self, target, settings):
        for name, setting in settings.items():
            record_of(target.modules[name]).behaviours[self.name] = (setting, [])

    def wrap(self, module, setting, held, call):
        return functools.partial(_held_call, held, call)


@pytest.fixture
def held():
    behaviour = register(Held())
    OFFERS["held"] = lambda order, observed, modules: {"held": {n: StageAction(n, extra={"held": True}) for n in order}}
    yield behaviour
    del OFFERS["held"]
    unregister(behaviour.name)


def test_a_behaviour_offered_from_a_test_is_measured_priced_and_planned(held):
    model, x = _chain(), torch.randn(4, 8)
    step = lambda m: m(x).square().sum()  # noqa: E731
    profile = profile_step(model, step)
    for stage in profile.stages:
        keep, option = stage.option("keep"), stage.option("held")
        assert option.action == StageAction(stage.name, extra={"held": True})
        # Measured with the behaviour installed: each stage stores its output's copy (4 x 8 float32) more than keep;
        # priced as running nothing again.
        assert option.stored_bytes == keep.stored_bytes + 4 * 8 * 4 and option.costs == Costs()
    plan = plan_from_choices(profile, [[o.name for o in s.options].index("held") for s in profile.stages], 10**9)
    assert plan.actions == tuple(StageAction(s.name, extra={"held": True}) for s in profile.stages)
    install(model, plan)
    measured = measure_step(model, step).peak_bytes
    assert [len(m.__dict__[RECORD].behaviours["held"][1]) for m in model] == [1, 1, 1]
    assert measured == plan.predicted_peak_bytes  # the model reproduces the measured runs
