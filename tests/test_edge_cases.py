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

