"""Residual blocks in torchvision's layout run as checkpointed parts (issue 31, least peak through the bottleneck).

A two-bottleneck net at tiny width: the least peak with the twins is below what whole-or-kept bottlenecks reach,
its plan runs a bottleneck through its parts, holds its budget as predicted, gives the plain model's gradients
and BatchNorm statistics, and ``remove_remat`` puts the block's own forward back. A block whose forward is
not torchvision's gets no twin.
"""

import copy
import warnings
from unittest import mock

import pytest
import torch
from torch import nn

from lightning_remat import BudgetTooSmallError, solve
from lightning_remat.core.solve import least_peak
from lightning_remat.models import Bottleneck
from lightning_remat.runtime.installing.apply import apply_plan, remove_remat
from lightning_remat.runtime.measuring.measure import measure_step
from lightning_remat.runtime.profiling.profile import profile_step
from lightning_remat.runtime.profiling.residual_twins import twin_stages
from tests.grads import assert_equal_gradients


class TwoBottlenecks(nn.Module):
    """torchvision's layout at tiny width: a loose stem, ``layer1`` of two bottlenecks (the first downsamples), a head."""

    def __init__(self, block=Bottleneck):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        downsample = nn.Sequential(nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16))
        self.layer1 = nn.Sequential(block(8, 4, downsample=downsample), block(16, 4))
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.layer1(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


class Scaled(Bottleneck):
    """A residual scaled by half: the same modules, another forward, so the twin is not it."""

    def forward(self, x):
        return super().forward(x) * 0.5


images, labels = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0)), torch.arange(8)


def step(model):
    return nn.functional.cross_entropy(model(images), labels)


def _profile(model, twins=True):
    with warnings.catch_warnings(), mock.patch("lightning_remat.runtime.profiling.profile.twin_stages",
                                               twin_stages if twins else (lambda *a: [])):
        warnings.simplefilter("ignore")
        return profile_step(copy.deepcopy(model), step)


def test_a_bottleneck_through_its_parts_lowers_the_least_peak_holds_and_gives_equal_gradients():
    torch.manual_seed(0)
    model = TwoBottlenecks().train()
    before, after = _profile(model, twins=False), _profile(model)
    assert [o.name for o in after.stages[-2].options][-2:] == ["parts", "whole+parts"]
    budget = least_peak(before) - 1
    with pytest.raises(BudgetTooSmallError):
        solve(before, budget, cost="flops")
    plan = solve(after, budget, cost="flops")
    assert any(dict(a.extra).get("residual_parts") for a in plan.actions)  # a boundary inside a bottleneck

    planned = copy.deepcopy(model)
    apply_plan(planned, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = measure_step(planned, step, None).peak_bytes
    assert measured <= budget
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes

    plain, planned = copy.deepcopy(model), apply_plan(copy.deepcopy(model), plan)  # one step each from the same state
    assert_equal_gradients(plain, planned, step)
    for (name, a), (_, b) in zip(plain.state_dict().items(), planned.state_dict().items()):
        assert torch.equal(a, b), name  # BatchNorm statistics updated once, recomputes and all
    remove_remat(planned)
    assert all("forward" not in m.__dict__ for m in planned.modules())  # each class's own forward again
    assert list(planned.state_dict()) == list(model.state_dict())


def test_a_block_whose_forward_is_not_torchvisions_gets_no_twin():
    torch.manual_seed(0)
    assert twin_stages(TwoBottlenecks().train(), step, ["layer1.0", "layer1.1"]) == ["layer1.0", "layer1.1"]
    assert twin_stages(TwoBottlenecks(Scaled).train(), step, ["layer1.0", "layer1.1"]) == []


def test_the_twin_runs_the_blocks_children_in_the_models_own_order():
    # What user hooks see does not change: a forward hook on every child fires in torchvision's order.
    from lightning_remat.runtime.installing.residual_parts import twin_forward

    downsample = nn.Sequential(nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16))
    block, x = Bottleneck(8, 4, downsample=downsample).eval(), torch.randn(1, 8, 4, 4)
    seen = []
    for name, child in block.named_children():
        child.register_forward_hook(lambda *_, name=name: seen.append(name))
    block(x)
    plain, seen[:] = list(seen), []
    twin_forward(block, x, checkpointed=False)
    assert seen == plain and plain.index("downsample") > plain.index("bn3")
