"""Smaller defects of issue 29, each where two features meet: a step that differentiates inside itself
(a gradient penalty), a plan naming what the model lacks, a plan from ``solve`` on another model,
planning while another thread runs the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_remat import Plan, StageAction, apply_plan, plan_remat, profile_step, remove_remat, solve
from lightning_remat.core.errors import PlanMismatchError, UnsupportedSetupError
from lightning_remat.runtime.installing.apply import checkpointed_modules


def _chain(width=16, blocks=4):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
                           for _ in range(blocks)])


def _penalised(x, leaf=False):
    """A step with a gradient penalty: ``torch.autograd.grad(create_graph=True)`` inside the step."""
    def step(model):
        inputs = x.clone().requires_grad_(True)
        inputs = inputs if leaf else inputs * 1
        out = model(inputs)
        grad, = torch.autograd.grad(out.sum(), inputs, create_graph=True)
        return out.square().mean() + grad.square().mean()
    return step


def _grads(model, step):
    model.zero_grad(set_to_none=True)
    step(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_step_with_a_gradient_penalty_is_planned_and_recomputes_with_the_same_gradients():
    """Before: the package's own probe of the step (under ``torch.no_grad``, to find chained
    ``nn.Sequential`` items) raised torch's raw "element 0 of tensors does not require grad"."""
    model, x = _chain(), torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    step = _penalised(x)
    expected = _grads(model, step)
    plan = plan_remat(model, step, "min", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert plan.predicted_peak_bytes <= plan.baseline_peak_bytes
    apply_plan(model, ["0", "1", "2"])  # recomputed under the double backward: the same gradients
    grads = _grads(model, step)
    remove_remat(model)
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n], msg=n)


def test_a_gradient_penalty_on_a_leaf_input_is_refused_naming_the_cause():
    """torch's module trackers (FlopCounterMode, MemTracker) cannot run ``autograd.grad`` where a
    module's input is a leaf: an error that says so and how to write the step, not torch's raw one."""
    model, x = _chain(), torch.randn(8, 16)
    with pytest.raises(UnsupportedSetupError, match=r"autograd\.grad.*leaf.*\* 1"):
        plan_remat(model, _penalised(x, leaf=True), "min")


@pytest.mark.parametrize("plan", [["0", "7"], Plan(actions=[StageAction.recompute("9")])])
def test_a_plan_naming_a_module_the_model_lacks_is_a_plan_mismatch(plan):
    """docs/plans.md promises ``PlanMismatchError`` (before: a plain ``ValueError``); still a ValueError."""
    model = _chain()
    with pytest.raises(PlanMismatchError, match="does not have"):
        apply_plan(model, plan)
    assert issubclass(PlanMismatchError, ValueError) and "forward" not in model[0].__dict__


def test_a_plan_from_solve_records_the_profiled_model_and_is_refused_on_other_shapes():
    """Before: ``solve(profile_step(...))`` made a plan that recorded nothing; applied to blocks 4x wider
    it ran at 3.82x its budget, silently. Now the profile records the model's parameter shapes and
    the plan carries them (the batch's shape is not the solver's to know)."""
    model, x = _chain(width=16), torch.randn(32, 16)
    plan = solve(profile_step(model, lambda m: m(x).square().mean(), warmup=0), "min", cost="flops")
    assert plan.fingerprint["module_parameters"]["0"]["0.weight"] == [[32, 16], "float32"]
    assert set(plan.fingerprint["module_parameters"]) == {"0", "1", "2", "3"}
    assert Plan.from_dict(plan.to_dict()).fingerprint == plan.fingerprint
    wide = nn.Sequential(*[nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 16)) for _ in range(4)])
    with pytest.raises(PlanMismatchError, match=r"module '0' parameter '0.weight' has shape \(128, 16\)"):
        apply_plan(wide, plan)
    assert checkpointed_modules(apply_plan(_chain(width=16), plan)) == plan.checkpointed  # its own shapes: applied


class _Counted(nn.Module):
    """A block whose forward counts its calls in Python, guarded or not by ``recomputing()``."""

    def __init__(self, guarded):
        super().__init__()
        self.linear, self.guarded, self.calls = nn.Linear(8, 8), guarded, 0

    def forward(self, x):
        from lightning_remat import recomputing

        if not (self.guarded and recomputing()):
            self.calls += 1
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("guarded, counted", [(False, 2), (True, 1)])
def test_a_python_counter_in_a_recomputed_forward_counts_the_recompute_unless_guarded(guarded, counted):
    """The documented behaviour (docs/limitations.md) and its workaround, ``lightning_remat.recomputing()``."""
    model = nn.Sequential(_Counted(guarded), nn.Linear(8, 1))
    apply_plan(model, ["0"])
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert model[0].calls == counted
    with torch.no_grad():  # nothing is recomputed without gradients
        model(torch.randn(4, 8))
    assert model[0].calls == counted + 1
