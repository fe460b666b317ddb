"""The optimizers of a step: none, one or several, each looked through Lightning's, Fabric's, Accelerate's wrapper."""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

# The classes that only hold the user's optimizer (at ``.optimizer`` or ``._optimizer``).
WRAPPERS = ("LightningOptimizer", "_FabricOptimizer", "AcceleratedOptimizer")

Optimizers = Union[None, torch.optim.Optimizer, tuple]


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer inside Lightning's, Fabric's and Accelerate's wrappers (itself if unwrapped)."""
    while any(cls.__name__ in WRAPPERS for cls in type(optimizer).__mro__):
        inner = optimizer.__dict__.get("_optimizer", getattr(optimizer, "optimizer", None))
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer (or a list of them), got {type(optimizer).__name__}")
    return optimizer


def as_optimizers(optimizer: Any) -> Optimizers:
    """None, one torch optimizer, or a tuple of several (duplicates once), each looked through its wrapper."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, (list, tuple)):
        return torch_optimizer(optimizer)
    found = tuple({id(inner): inner for inner in map(torch_optimizer, optimizer)}.values())
    return None if not found else found[0] if len(found) == 1 else found


def optimizer_list(optimizer: Any) -> list[torch.optim.Optimizer]:
    """Every torch optimizer in ``optimizer`` (None, one, a list or tuple, wrapped or not), in order."""
    found = as_optimizers(optimizer)
    return [] if found is None else list(found) if isinstance(found, tuple) else [found]


def map_optimizers(optimizer: Any, fn: Callable[[torch.optim.Optimizer], Any]) -> Any:
    """``fn`` of each optimizer, in the shape given: None, one result, or a tuple of them."""
    found = as_optimizers(optimizer)
    if found is None:
        return None
    return tuple(fn(o) for o in found) if isinstance(found, tuple) else fn(found)
