"""The user's module hooks do not see the package's own passes (profiling, fake twins, trials, predictions).

A forward hook a user puts on a block (to collect activations, log statistics, count calls) must see
the training forwards, and only them: the profile runs the step several times on the same batch, the
fake twin runs it on fake tensors (a hook that reads a value would stop it), and the trials and
loop predictions run it again. During those passes each of the user's hooks stands silenced at its
place in its module's hook dictionary and is put back afterwards (``user_hooks_suspended``); a fake
twin gets hook dictionaries of its own with them silenced (``without_user_hooks``). Silenced, not
taken out: torch still builds what a hook of its kind needs (a backward hook's autograd nodes hold
memory), so the passes measure the step's memory as training runs it. A hook that changes what its
module returns is not called either: the passes see the module's own output.

Which hooks are the user's: those whose function is defined outside the libraries in ``LIBRARIES``
(torch, transformers, PEFT, Accelerate, Lightning, DeepSpeed, TRL, this package, ...), read from the
function's ``__module__`` (through ``functools.partial`` and bound methods), unless the user marked
it ``part_of_model`` (a hook that changes what its module returns). Library hooks keep running,
since the step does not compute what it trains without them: FSDP2's ``fully_shard``
gathers parameters in its hooks, transformers' ``enable_input_require_grads`` makes the embedding's
output require gradients. Forward pre- and post-hooks (with or without kwargs) and backward hooks
are suspended; global hooks (``register_module_forward_hook``) are left alone. What still differs
from a run without the package is listed in docs/limitations.md (a recomputed block's forward, and
its children's hooks, run again in backward).

Example:
    >>> import torch
    >>> net = torch.nn.Linear(2, 2)
    >>> seen = []
    >>> def count(module, args, output):
    ...     seen.append(output.shape)
    >>> count.__module__ = "my_training_script"   # as a hook defined in the user's own code
    >>> handle = net.register_forward_hook(count)
    >>> with user_hooks_suspended(net):
    ...     _ = net(torch.ones(1, 2))
    >>> _ = net(torch.ones(3, 2))
    >>> seen
    [torch.Size([3, 2])]
"""

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
    """The top-level package a hook's function is defined in ("" when unknown).

    Example:
        >>> from torch.distributed.fsdp import FSDPModule
        >>> hook_library(FSDPModule.reshard), hook_library(functools.partial(str.upper))
        ('torch', 'builtins')
    """
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
    """Mark ``hook`` (a function or a bound method) as part of what the model computes, so it runs in
    the package's passes too, as libraries' hooks do: a hook that changes what its module returns, or
    one that must see every forward (profiling's included). Returns ``hook``.

    Example:
        >>> def scale(module, args, output):
        ...     return output * 2
        >>> scale.__module__ = "my_training_script"
        >>> is_user_hook(scale), is_user_hook(part_of_model(scale))
        (True, False)
    """
    setattr(getattr(hook, "__func__", hook), PART_OF_MODEL, True)
    return hook


class _Silenced:
    """Stands in a module's hook dictionary for a user's hook during a package pass: torch still sets up
    what a hook of its kind needs (a backward hook's autograd nodes, which hold memory), so the pass
    measures the step as training runs it, but the user's function is not called."""

    def __init__(self, hook: Callable[..., Any]):
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


@contextlib.contextmanager
def user_hooks_suspended(model: nn.Module) -> Iterator[None]:
    """Within it, the user's module hooks on ``model`` and its submodules are not called (each stands
    silenced at its place); afterwards they are back. Re-entrant; a hook added or removed meanwhile
    stays added or removed."""
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
    """Give ``module`` (a shallow copy: a fake twin) hook dictionaries of its own with the user's hooks
    silenced; the module it was copied from keeps its own untouched."""
    for attribute in HOOK_DICTS:
        hooks = module.__dict__.get(attribute)
        if isinstance(hooks, dict):
            object.__setattr__(module, attribute, OrderedDict(
                (key, _Silenced(hook) if is_user_hook(hook) else hook) for key, hook in hooks.items()))
