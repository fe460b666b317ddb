"""The user's module hooks stand silenced in place during the package's own passes (so torch still builds the
nodes backward hooks need); a hook is the user's unless from ``LIBRARIES`` or marked ``part_of_model``."""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from typing import Any, Callable, Iterator

from torch import nn

# Top-level packages whose hooks are part of what the step computes (not the user's code).
LIBRARIES = frozenset({
    "torch", "torchvision", "torchaudio", "torchao", "torchtune", "torchtitan", "transformers", "peft",
    "accelerate", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_remat", "deepspeed", "trl",
    "bitsandbytes", "optimum", "diffusers", "liger_kernel", "xformers",
})
# The attribute ``part_of_model`` sets on a hook's function.
PART_OF_MODEL = "_lightning_remat_part_of_model"
# The hook dictionaries of an ``nn.Module`` that its ``__call__`` runs.
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def hook_library(hook: Callable[..., Any]) -> str:
    """The top-level package a hook's function is defined in ("" when unknown)."""
    function: Any = hook
    while isinstance(function, functools.partial):
        function = function.func
    function = getattr(function, "__func__", function)  # a bound method: its function
    module = getattr(function, "__module__", None) or type(function).__module__ or ""
    return module.split(".")[0]


def is_user_hook(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is the user's: defined outside ``LIBRARIES`` and not marked ``part_of_model``."""
    function = getattr(hook, "__func__", hook)
    return hook_library(hook) not in LIBRARIES and not getattr(function, PART_OF_MODEL, False)


def part_of_model(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``hook`` as part of the model (it changes the output, or must see every forward); returns it.

    >>> def scale(module, args, output):
    ...     return output * 2
    >>> scale.__module__ = "my_training_script"
    >>> is_user_hook(scale), is_user_hook(part_of_model(scale))
    (True, False)
    """
    setattr(getattr(hook, "__func__", hook), PART_OF_MODEL, True)
    return hook


class _Silenced:
    """Stands in a hook dictionary for a user's hook: torch still sets up what the hook needs, nothing is called."""

    def __init__(self, hook: Callable[..., Any]):
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


@contextlib.contextmanager
def user_hooks_suspended(model: nn.Module) -> Iterator[None]:
    """Within it, the user's hooks on ``model`` and its submodules are not called. Re-entrant."""
    taken: list[tuple[dict, Any, _Silenced]] = []
    for module in model.modules():
        for attribute in HOOK_DICTS:
            hooks = getattr(module, attribute, None)
            for key, hook in list(hooks.items()) if hooks else ():
                if is_user_hook(hook):
                    hooks[key] = _Silenced(hook)
                    taken.append((hooks, key, hooks[key]))
    try:
        yield
    finally:
        for hooks, key, silenced in taken:
            if hooks.get(key) is silenced:
                hooks[key] = silenced.hook


def without_user_hooks(module: nn.Module) -> None:
    """Give ``module`` (a shallow copy) hook dictionaries of its own with the user's hooks silenced and DeepSpeed's
    left out (ZeRO-3's gather the real module's parameters; a twin holds whole ones, ZeRO-2 puts none)."""
    for attribute in HOOK_DICTS:
        hooks = module.__dict__.get(attribute)
        if isinstance(hooks, dict):
            object.__setattr__(module, attribute, OrderedDict(
                (key, _Silenced(hook) if is_user_hook(hook) else hook) for key, hook in hooks.items()
                if hook_library(getattr(hook, "hook", hook)) != "deepspeed"))
