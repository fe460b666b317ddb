"""The gradient check the planning tests share (tests/grads.py) fails where one gradient differs."""

import copy

import pytest
import torch
from torch import nn

from tests.grads import assert_equal_gradients


def test_the_gradient_check_passes_on_a_copy_with_dropout_and_names_the_first_gradient_that_differs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 1))
    step = lambda m: m(torch.ones(8, 4)).sum()  # noqa: E731
    assert_equal_gradients(model, copy.deepcopy(model), step)  # the same seed: dropout's masks alike
    other = copy.deepcopy(model)
    with torch.no_grad():
        other[2].weight.add_(1.0)  # the last layer's weight: the first layer's gradient changes with it
    with pytest.raises(AssertionError, match="0.weight"):
        assert_equal_gradients(model, other, step)
