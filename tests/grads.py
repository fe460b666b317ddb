"""Gradients of a planned model against the plain one's: the tests' one check that recomputation changed nothing."""

from __future__ import annotations

from typing import Any, Callable

import torch


def assert_equal_gradients(plain: torch.nn.Module, planned: torch.nn.Module, step: Callable[[Any], torch.Tensor],
                           seed: int = 0) -> None:
    """One backward of ``step`` on each model from the same random state (dropout's masks alike); every parameter's
    gradient bit-equal, parameter by parameter under the same names (the plan renames nothing)."""
    for model in (plain, planned):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        step(model).backward()
    for (name, a), (other, b) in zip(plain.named_parameters(), planned.named_parameters(), strict=True):
        assert name == other, (name, other)
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), name
