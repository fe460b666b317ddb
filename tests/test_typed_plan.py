"""The typed plan (one action per stage), its one predictor, the recompute-everything solver, and the
one installer composing recompute, op-level policies, offload and segments on one model."""

import copy
import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from lightning_remat.core.memory_model import Costs, Profile, Segment, StageOption, StageProfile
from lightning_remat.core.plan import Plan, StageAction, StageChoice
from lightning_remat.core.predict import predict
from lightning_remat.core.solve import plan_from_choices, solve, solve_recompute_everything
from lightning_remat.core.vocabulary import Action, CostKind, Policy
from lightning_remat.report.render import plan_renderables, to_text
from lightning_remat.runtime.installing import installer
from lightning_remat.runtime.installing.apply import (applied, apply_plan, remove_remat,
                                                      segmented_modules)
from lightning_remat.runtime.installing.offload import apply_offload, model_offloader, offloaded_modules
from lightning_remat.runtime.installing.records import RECORD, installed_forward
from lightning_remat.service.run import plan_metrics

# What a solved plan with a policy, a child, an offload within a limit and a segment says under the
# names its dict holds for readers (and the figures it predicts).
SOLVED = {
    "checkpointed": ["h.0", "h.1.mlp", "h.5"], "budget_bytes": 650, "predicted_peak_bytes": 390,
    "predicted_overhead": 0.19, "requested_budget": "650", "segments": [["h.3", "h.4"]],
    "policies": {"h.0": "save_matmuls"}, "offloaded": ["h.2"], "host_bytes": 80, "offload_limits": {"h.2": 64}}


def _profile():
    """The synthetic profile SOLVED is made from: six stages with keep, whole, a policy, a child
    and a hidden offload, all in one span group."""
    def stage(n):
        return StageProfile(n, (StageOption("keep", StageAction(n), 100, 150),
                                StageOption("whole", StageAction.recompute(n), 10, 160, Costs(1.0, 5)),
                                StageOption("sac:save_matmuls", StageAction.recompute(n, policy="save_matmuls"), 50,
                                            155, Costs(0.5, 2)),
                                StageOption("mlp", StageAction.recompute(n, (n + ".mlp",)), 60, 155, Costs(0.4, 2)),
                                StageOption("offload:hidden", StageAction.offload(n), 20, 150, host_bytes=80,
                                            offload_limit=64)))

    return Profile(tuple(stage(f"h.{i}") for i in range(6)), (Segment("head", 6, 50),), baseline_peak_bytes=700,
                   baseline_costs=Costs(flops=100), span_groups=(tuple(f"h.{i}" for i in range(6)),))


# ------------------------------------------------------------------------------------ the plan


def test_a_solved_plan_has_one_action_per_stage_and_its_dict_says_the_same_names():
    plan = plan_from_choices(_profile(), [2, 3, 4, 0, 0, 1], 650, "flops", spans=[(3, 4)])
    assert [(a.stage, a.action) for a in plan.actions] == [
        ("h.0", Action.RECOMPUTE), ("h.1", Action.RECOMPUTE), ("h.2", Action.OFFLOAD), ("h.3", Action.SEGMENT),
        ("h.4", Action.SEGMENT), ("h.5", Action.RECOMPUTE)]
    assert plan.actions[0].policy is Policy.SAVE_MATMULS and plan.actions[1].modules == ("h.1.mlp",)
    assert plan.actions[2].offload_limit == 64 and plan.actions[3].segment == ("h.3", "h.4")
    for name, value in SOLVED.items():
        assert getattr(plan, name) == value, name
    assert plan.stage_order == ("h.0", "h.1", "h.2", "h.3", "h.4", "h.5") and plan.fallback is False
    # The dict round-trips, is plain JSON, and says what the actions say under the names.
    data = json.loads(json.dumps(plan.to_dict()))
    assert Plan.from_dict(data) == plan
    assert {k: data[k] for k in ("checkpointed", "segments", "policies", "offloaded", "offload_limits")} == \
        {k: SOLVED[k] for k in ("checkpointed", "segments", "policies", "offloaded", "offload_limits")}
    with pytest.raises(ValueError, match="disagree"):
        Plan.from_dict({**data, "checkpointed": ["h.0"]})
    with pytest.raises(ValueError, match="'actions' must be a list of actions"):
        Plan.from_dict({k: v for k, v in data.items() if k != "actions"})


def test_the_fallback_plan_predicts_nothing_and_round_trips():
    plan = solve_recompute_everything(["h.0", "h.1"], "min", "flops", "min", "oom")
    assert plan.fallback and plan.checkpointed == ["h.0", "h.1"]
    assert (plan.budget_bytes, plan.baseline_peak_bytes, plan.predicted_peak_bytes, plan.predicted_overhead) == \
        (None, None, None, None)
    assert plan_metrics(plan) == {"remat/num_checkpointed": 2.0}
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_a_plan_is_immutable_and_changed_by_replace():
    plan = solve(_profile(), 650, cost="flops")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.requested_budget = "650B"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.actions = ()
    assert isinstance(plan.notes, tuple) and isinstance(plan.choices, tuple) and isinstance(plan.actions, tuple)
    renamed = dataclasses.replace(plan, requested_budget="650B", fingerprint={"batch_elements": 3})
    assert renamed.requested_budget == "650B" and renamed.actions == plan.actions and plan.requested_budget == "650"
    assert renamed.fingerprint == {"batch_elements": 3} and plan.fingerprint == {}
    # A derived list is a copy: changing it changes nothing.
    plan.checkpointed.append("h.9")
    assert "h.9" not in plan.checkpointed
    with pytest.raises(TypeError, match="'checkpointed'"):  # a plan holds actions only
        dataclasses.replace(plan, checkpointed=["h.0"])


def test_the_recompute_everything_solver_predicts_nothing_and_nothing_prints_nan():
    plan = solve_recompute_everything(["h.0", "h.1", "h.2"], 10**9, "time", "1GB", "out of memory while profiling")
    assert isinstance(plan, Plan) and plan.fallback and plan.checkpointed == ["h.0", "h.1", "h.2"]
    assert [a.action for a in plan.actions] == [Action.RECOMPUTE] * 3
    assert (plan.baseline_peak_bytes, plan.predicted_peak_bytes, plan.predicted_overhead) == (None, None, None)
    metrics = plan_metrics(plan, measured_peak_bytes=123)
    assert metrics == {"remat/num_checkpointed": 3.0, "remat/budget_bytes": 1e9, "remat/measured_peak_bytes": 123.0}
    assert not any(math.isnan(v) for v in metrics.values())
    for text in (plan.summary(), to_text(plan_renderables(plan))):
        assert "nan" not in text.lower() and "peak not predicted" in text and "budget 1GB" in text
        assert "out of memory while profiling" in text and "memory: parameters" not in text


def test_vocabularies_take_strings_and_keep_their_messages():
    plan = Plan([StageAction.recompute("h.0", policy="save_attention")], 1, 2, 1, 0.5, cost_kind="roofline")
    assert plan.cost_kind is CostKind.ROOFLINE and plan.cost_kind == "roofline" and f"{plan.cost_kind}" == "roofline"
    assert plan.to_dict()["cost_kind"] == "roofline" and type(plan.to_dict()["cost_kind"]) is str
    with pytest.raises(ValueError, match=r"cost must be one of \('time', 'flops', 'roofline'\), got 'seconds'"):
        Plan(cost_kind="seconds")
    with pytest.raises(ValueError, match="unknown selective-checkpointing policy 'save_all'"):
        StageAction.recompute("h.0", policy="save_all")
    with pytest.raises(ValueError, match="only a recomputed stage has a policy"):
        StageAction("h.0", Action.OFFLOAD, policy="save_matmuls")


# ------------------------------------------------------------------------------- the installer


class _Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(torch.relu(self.norm(self.lin(x))))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(*[_Block() for _ in range(6)], nn.Linear(8, 1)).train()


def _steps(model, steps=2):
    torch.manual_seed(3)
    x = torch.randn(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(steps):
        model(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


def _assert_bit_equal(plain, other):
    for a, b in zip(_steps(plain), _steps(other)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for (name, a), (_, b) in zip(plain.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name  # BatchNorm statistics: updated once per step


def test_one_installer_composes_policy_recompute_offload_and_segments_bit_equal_and_restores_exactly():
    plain, model = _net(), _net()
    before = {n: (type(m), dict(m.__dict__).keys(), dict(m._forward_hooks)) for n, m in model.named_modules()}
    keys = list(model.state_dict())
    stages = [str(i) for i in range(6)]
    plan = Plan(actions=[StageAction.recompute("0", policy="save_matmuls"), StageAction.offload("1"),
                         StageAction.recompute("2"), StageAction.in_segment("3", ["3", "4"]),
                         StageAction.in_segment("4", ["3", "4"]), StageAction.offload("5", limit=16 * 8 * 4)],
                choices=[StageChoice(s, "-", 0, 0, 0.0) for s in stages])
    apply_plan(model, plan)
    assert installer.recomputed(model) == {"0": "save_matmuls", "2": ""}
    assert offloaded_modules(model) == ["1", "5"] and segmented_modules(model) == [["3", "4"]]
    assert model_offloader(model).order == tuple(stages) and model_offloader(model).limits == {"5": 512}
    assert list(model.state_dict()) == keys
    _assert_bit_equal(plain, model)
    assert set(model_offloader(model).host_bytes) == {"1", "5"}
    remove_remat(model)
    after = {n: (type(m), dict(m.__dict__).keys(), dict(m._forward_hooks)) for n, m in model.named_modules()}
    assert after == before


def test_recompute_and_offload_on_one_module_compose_in_one_forward():
    plain, model = _net(), _net()
    apply_plan(model, Plan([StageAction.recompute("1"), StageAction.recompute("2", policy="save_matmuls")]))
    apply_offload(model, ["1", "3"], order=[str(i) for i in range(6)])  # around the checkpoint of "1"
    record = model[1].__dict__[RECORD]
    assert set(record.behaviours) == {"recompute", "offload"}  # one record, one patched forward
    assert model[1].forward.func is installed_forward
    _assert_bit_equal(plain, model)
    apply_plan(model, ["2"])  # replaces the plan: no double wrapping, nothing left behind
    assert installer.recomputed(model) == {"2": ""} and offloaded_modules(model) == []
    remove_remat(model)
    assert all("forward" not in m.__dict__ and RECORD not in m.__dict__ for m in model.modules())


def test_applied_puts_back_offloading_with_its_order_and_limits():
    model = _net()
    order = [str(i) for i in range(6)]
    apply_plan(model, ["0"])
    apply_offload(model, ["2"], order=order, limits={"2": 64})
    with applied(model, Plan([StageAction.recompute("4")])):
        assert installer.recomputed(model) == {"4": ""} and offloaded_modules(model) == []
    offloader = model_offloader(model)
    assert installer.recomputed(model) == {"0": ""} and offloaded_modules(model) == ["2"]
    assert offloader.order == tuple(order) and offloader.limits == {"2": 64}
    assert model[3]._forward_hooks  # the next stage releases and prefetches stage 2 again


def test_a_deep_copy_of_an_installed_model_trains_as_the_original():
    model = _net()
    apply_plan(model, Plan([StageAction.recompute("0"), StageAction.recompute("2"),
                            *(StageAction.in_segment(s, ["3", "4"]) for s in ("3", "4"))]))
    twin = copy.deepcopy(model)
    _assert_bit_equal(model, twin)
