"""A module's forward under a non-reentrant checkpoint (RNG state kept, BatchNorm statistics put back)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from ...core.actions import StageAction
from ...core.vocabulary import Action
from .records import BEHAVIOURS, RECORD, Behaviour


def _norms(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats]


@contextlib.contextmanager
def _restore_norm_statistics(module: nn.Module) -> Iterator[None]:
    """Run a recompute without updating running statistics a second time."""
    norms = _norms(module)
    saved = [{k: b.clone() for k, b in m.named_buffers(recurse=False) if b is not None} for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved):
                for k, value in buffers.items():
                    getattr(m, k).copy_(value)


def _needs_graph(args: tuple, kwargs: dict, module: nn.Module) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(p.requires_grad for p in module.parameters()):
        return True
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


def recomputing() -> bool:
    """Whether the forward running now is a recompute in backward rather than the step's own forward.

    Guard Python side effects of a module's forward with it (a counter, activations collected in a list).

    >>> calls = []
    >>> class Counted(nn.Linear):
    ...     def forward(self, x):
    ...         if not recomputing():
    ...             calls.append(1)
    ...         return super().forward(x)
    >>> from lightning_remat import apply_plan
    >>> net = apply_plan(nn.Sequential(Counted(2, 2)), ["0"])
    >>> net(torch.randn(1, 2, requires_grad=True)).sum().backward()
    >>> len(calls)  # the recompute in backward did not count
    1
    """
    return torch._C._current_graph_task_id() != -1


def _run(module: nn.Module, call: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    # A compiled backward does not apply buffer updates a second time; only an eager recompute (no compile,
    # or a graph break) updates them again, and is undone here.
    if torch.compiler.is_compiling() or not recomputing() or not _norms(module):
        return call(*args, **kwargs)
    # The copies are made outside the dispatch modes: selective checkpointing's cache replays the
    # forward's ops by count during the recompute, and these ops are not the forward's.
    restore = _restore_norm_statistics(module)
    with _disable_current_modes():
        restore.__enter__()
    try:
        return call(*args, **kwargs)
    finally:
        with _disable_current_modes():
            restore.__exit__(None, None, None)


_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")  # one thing, named per model


def _is_cache(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face KV cache (``transformers.Cache`` or a subclass; nothing imported)."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def _without_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments as ``GradientCheckpointingLayer`` checkpoints a layer: in training, ``use_cache=False``
    and no KV cache (unless ``_can_checkpoint_with_cache``), since a recompute writing the cache would append
    the keys and values a second time. Only the call changes, not the config or the cache.

    >>> import transformers
    >>> layer = nn.Linear(2, 2)
    >>> cache = transformers.DynamicCache()
    >>> _without_cache(layer, (1,), {"cache": cache, "use_cache": True})[1]
    {'cache': None, 'use_cache': False}
    >>> _without_cache(layer, (1,), {"cache": {}, "use_cache": True})[1]  # not Hugging Face's
    {'cache': {}, 'use_cache': True}
    """
    hf = type(module).__module__.startswith("transformers.")
    leaves = [*args, *kwargs.values()]
    if not module.training or not (hf or any(_is_cache(v) for v in leaves)):
        return args, kwargs
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    if getattr(module, "_can_checkpoint_with_cache", False):
        return args, kwargs
    for name in _CACHE_NAMES:
        if kwargs.get(name) is not None and (hf or _is_cache(kwargs[name])):
            kwargs[name] = None
    return tuple(None if _is_cache(a) else a for a in args), kwargs


def _recomputed_call(module: nn.Module, call: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    if not _needs_graph(args, kwargs, module):
        return call(*args, **kwargs)
    args, kwargs = _without_cache(module, args, kwargs)
    record = module.__dict__[RECORD]
    options: dict[str, Any] = {"checkpoint": checkpoint, "preserve_rng_state": True}
    for b in BEHAVIOURS:
        if b.name in record.behaviours:
            b.checkpoint_options(*record.behaviours[b.name], options)
    run = options.pop("checkpoint")
    return run(functools.partial(_run, module, call), *args, use_reentrant=False, **options, **kwargs)


class Recompute(Behaviour):
    """A ``RECOMPUTE`` action's modules (the stage, or some of its children) run again in backward."""

    name = "recompute"

    def settings(self, action: StageAction) -> dict[str, Any]:
        return {m: True for m in action.modules} if action.action is Action.RECOMPUTE else {}

    def wrap(self, module: nn.Module, setting: Any, state: Any, call: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(_recomputed_call, module, call)

    def fields(self, name: str, setting: Any) -> dict[str, Any]:
        return {"action": Action.RECOMPUTE}


RECOMPUTE = Recompute()
