"""Hooks do not fire inside a ``torch.compile`` module, so ``uncompiled`` puts every wrapper's original module in
its place while a model is profiled or a plan applied; DDP and Fabric wrappers are looked through."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel


def _optimized_module() -> type:
    from torch._dynamo.eval_frame import OptimizedModule  # on first use: dynamo takes a while to import

    return OptimizedModule


def runs_compiled(model: nn.Module) -> bool:
    """Whether ``model``'s step runs under torch.compile (a wrapper, ``module.compile()`` or Lightning's compiled steps)."""
    compiled = _optimized_module()
    return any(isinstance(m, compiled) or getattr(m, "_compiled_call_impl", None) is not None
               or getattr(m, "_compiler_ctx", None) for m in model.modules())


def _is_fabric_module(model: nn.Module) -> bool:
    """Whether ``model`` is Lightning Fabric's wrapper, without importing Lightning."""
    return hasattr(model, "_forward_module") and any(c.__name__ == "_FabricModule" for c in type(model).__mro__)


def fabric_forward_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """The forward context (autocast) of Fabric's wrapper around ``model``, for a step run on the module inside."""
    while isinstance(model, _optimized_module()):
        model = model._orig_mod
    if _is_fabric_module(model):
        return model._strategy.precision.forward_context()
    return contextlib.nullcontext()


def without_outer_wrappers(model: nn.Module, ddp: bool = True) -> nn.Module:
    """The module inside ``torch.compile``, Lightning Fabric and (``ddp``) ``DistributedDataParallel`` wrappers."""
    compiled = _optimized_module()
    while True:
        if isinstance(model, compiled):
            model = model._orig_mod
        elif ddp and isinstance(model, DistributedDataParallel):
            model = model.module
        elif _is_fabric_module(model):
            model = model._forward_module
        else:
            return model


def is_data_parallel(model: nn.Module) -> bool:
    """Whether ``model`` is (wrapped) ``DistributedDataParallel``, whose reducer keeps gradient buckets."""
    return isinstance(without_outer_wrappers(model, ddp=False), DistributedDataParallel)


@contextlib.contextmanager
def uncompiled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with each compiled wrapper replaced by its original module for the block."""
    compiled = _optimized_module()
    model = without_outer_wrappers(model)
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        stack = [model]
        while stack:
            parent = stack.pop()
            for name, child in list(parent._modules.items()):
                while isinstance(child, compiled):
                    swapped.append((parent, name, parent._modules[name]))
                    child = child._orig_mod
                    parent._modules[name] = child
                if child is not None:
                    stack.append(child)
        yield model
    finally:
        # Innermost first, so a wrapper of a wrapper comes back whole.
        for parent, name, wrapper in reversed(swapped):
            parent._modules[name] = wrapper
