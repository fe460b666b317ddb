"""A stack of identical layers profiled as 4- and 5-layer copies with ballast, for ``core.depth_fit``."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ...core.errors import RematError
from ...core.depth_fit import DEPTHS, extrapolate
from ...core.memory_model import Profile
from ..measuring.optimizers import as_optimizers, optimizer_list
from .candidates import find_stages
from ..targets.fake import _shallow_module_copy

# Fewer layers than this are profiled whole: 4 + 5 layers cost about as much.
MIN_LAYERS = 10
_SIMPLE = (str, bool, int, float, type(None))

ProfileRun = Callable[[nn.Module, "torch.optim.Optimizer | None", "Callable | None"], Profile]


@dataclass(frozen=True)
class RepeatedStack:
    """The model's stages are the ``layers`` interchangeable children of the ``ModuleList`` at ``prefix``."""

    prefix: str
    layers: int


def repeated_stack(model: nn.Module, candidates: Any) -> RepeatedStack | None:
    """The model's stack of at least ``MIN_LAYERS`` layers that differ only in their own index, or None."""
    try:
        names = find_stages(model, candidates)
    except RematError:
        return None
    if len(names) < MIN_LAYERS or "." not in names[0]:
        return None
    prefix = names[0].rsplit(".", 1)[0]
    parent = model.get_submodule(prefix)
    if not isinstance(parent, nn.ModuleList) or names != [f"{prefix}.{i}" for i in range(len(parent))]:
        return None
    layers = list(parent)
    if len({type(layer) for layer in layers}) != 1:
        return None
    signatures = [_signature(layer) for layer in layers]
    if any(s != signatures[0] for s in signatures[1:]):
        return None
    attributes = [_attributes(layer) for layer in layers]
    # A layer's index (layer_idx: which cache slot it writes) is the one attribute allowed to differ.
    own_index = {key for key in attributes[0] if all(a.get(key) == i for i, a in enumerate(attributes))}
    attributes = [{k: v for k, v in a.items() if k not in own_index} for a in attributes]
    if any(a != attributes[0] for a in attributes[1:]):
        return None
    if _config_differs_per_layer(getattr(model, "config", None), len(layers)):
        return None
    return RepeatedStack(prefix, len(layers))


def _signature(layer: nn.Module) -> tuple:
    tensors = [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in layer.named_parameters()]
    tensors += [(n, tuple(t.shape), t.dtype) for n, t in layer.named_buffers()]
    modules = [(n, type(m)) for n, m in layer.named_modules()]
    return tuple(tensors), tuple(modules)


def _attributes(layer: nn.Module) -> dict[tuple[str, str], Any]:
    found = {}
    for name, module in layer.named_modules():
        for key, value in vars(module).items():
            if key.startswith("_") or key == "training":
                continue
            if isinstance(value, _SIMPLE) or (isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value)):
                found[(name, key)] = value
    return found


def _config_differs_per_layer(config: Any, layers: int) -> bool:
    if config is None:
        return False
    for value in _config_items(config).values():
        if isinstance(value, (list, tuple)) and len(value) == layers and len({repr(v) for v in value}) > 1:
            return True
    # Qwen2-style: sliding-window attention in the layers from max_window_layers on.
    window_layers = getattr(config, "max_window_layers", None)
    if getattr(config, "use_sliding_window", False) and isinstance(window_layers, int) and window_layers < layers:
        return True
    return False


def _config_items(config: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


def truncated(model: nn.Module, stack: RepeatedStack, layers: int) -> nn.Module:
    """A shallow copy of ``model`` with the first ``layers`` layers of ``stack`` (and its config cut to match)."""
    twin = _shallow_module_copy(model)
    parent = twin.get_submodule(stack.prefix)
    object.__setattr__(parent, "_modules", {str(i): parent._modules[str(i)] for i in range(layers)})
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):
        short = copy.copy(config)
        for key, value in _config_items(config).items():
            if isinstance(value, (list, tuple)) and len(value) == stack.layers:
                setattr(short, key, type(value)(value[:layers]))
        short.num_hidden_layers = layers
        for module in twin.modules():
            if module.__dict__.get("config") is config:
                module.__dict__["config"] = short
    return twin


def _sub_optimizer(optimizer: Any, model: nn.Module) -> Any:
    """Optimizers of the same classes, settings and state over the parameters ``model`` still has."""
    kept, subs = {id(p) for p in model.parameters()}, []
    for o in optimizer_list(optimizer):
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [p for p in g["params"] if id(p) in kept]}
                  for g in o.param_groups]
        groups = [g for g in groups if g["params"]]
        if groups:  # else every parameter it steps is in the layers the copy leaves out
            sub = type(o)(groups, **{k: v for k, v in o.defaults.items() if k not in groups[0]})
            sub.state.update({p: o.state[p] for g in groups for p in g["params"] if p in o.state})
            subs.append(sub)
    return as_optimizers(subs)


def repeated_profile(model: nn.Module, stack: RepeatedStack | None, optimizer: torch.optim.Optimizer | None,
                     run: ProfileRun) -> Profile | None:
    """The profile extrapolated from ``run(model, optimizer, wrap)`` on 4- and 5-layer copies, or None (no stack)."""
    if stack is None:
        return None
    shorts = [truncated(model, stack, layers) for layers in DEPTHS]
    # One optimizer per depth, given to both phases' runs: its step (which no ballast touches) is measured once.
    optimizers = [_sub_optimizer(optimizer, short) for short in shorts]
    lifted = {phase: tuple(run(short, sub, lambda step, phase=phase: with_ballast(step, phase))
                           for short, sub in zip(shorts, optimizers))
              for phase in ("forward", "backward")}
    return extrapolate(lifted["forward"], lifted["backward"], BALLAST, stack.prefix, stack.layers)


def alternatives_in_depth(model: nn.Module, stack: RepeatedStack | None, optimizer: Any,
                          measure: Callable[[Any], dict[str, int]]) -> dict[str, int] | None:
    """``measure(optimizer)`` of the whole stack on a line through its 1- and 2-layer copies' (None: no stack).

    Example:
        >>> import transformers
        >>> from lightning_remat.runtime.profiling.optimizer_step import optimizer_step_alternatives
        >>> config = transformers.LlamaConfig(num_hidden_layers=12, hidden_size=32, intermediate_size=64,
        ...                                   num_attention_heads=4, vocab_size=64)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> adamw = torch.optim.AdamW(model.parameters())
        >>> measure = lambda o: optimizer_step_alternatives(o, "cuda")
        >>> alternatives_in_depth(model, repeated_stack(model, None), adamw, measure) == measure(adamw)
        True
    """
    if stack is None or optimizer is None:
        return None
    # A step works per parameter, or on lists of them all: nothing in it depends on a layer's place, so
    # its figures are on a line from one layer on (the model's own are not: DEPTHS).
    (a, at_a), (b, at_b) = ((n, measure(_sub_optimizer(optimizer, truncated(model, stack, n)))) for n in (1, 2))
    if set(at_a) != set(at_b):
        return None
    return {k: int(at_a[k] + (stack.layers - a) * (at_b[k] - at_a[k]) // (b - a)) for k in at_a}


# Above any figure a profile measures (a pebibyte); fake tensors allocate nothing.
BALLAST = 2**50


def _ballast_tensor(nbytes: int, device: torch.device | None) -> torch.Tensor:
    """A storage of ``nbytes`` in a tensor of two elements, so the roofline does not price it as moved."""
    return torch.empty_strided((2,), (nbytes - 1,), dtype=torch.uint8, device=device)


class _Ballast(torch.autograd.Function):
    """Identity on the loss that holds ballast through forward (``held``) or allocates ``nbytes`` through backward."""

    @staticmethod
    def forward(ctx, loss, held, nbytes):  # type: ignore[no-untyped-def, override]
        ctx.held, ctx.nbytes = held, nbytes
        return loss.view_as(loss)  # a view: no storage of its own

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        ctx.held = None
        if ctx.nbytes:
            held = [_ballast_tensor(ctx.nbytes, grad.device)]
            torch.autograd.Variable._execution_engine.queue_callback(held.clear)
        return grad, None, None


def with_ballast(step: Callable, phase: str) -> Callable:
    """``step`` whose ``phase`` pass (forward or backward) holds ``BALLAST`` more, to tell a peak's figures apart."""

    def lifted(model: nn.Module) -> torch.Tensor:
        held = _ballast_tensor(BALLAST, None) if phase == "forward" else None
        loss = step(model)
        return _Ballast.apply(loss, held, BALLAST if phase == "backward" else 0)

    return lifted

