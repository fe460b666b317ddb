"""What a module's forward saves for backward goes to host memory and comes back bit for bit."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch
from torch import nn

from ...core.actions import StageAction, check_actions
from ...core.vocabulary import Action
from .offloader import Offloader, offloaded_call, release_after_next
from .records import Behaviour, Target, check_names, record_of, state_of


# An offloaded module's state: the model's offloader, the module's name in it, and the forward hook
# on the next stage that releases its device tensors (None without an order).
Offloading = NamedTuple("Offloading", [("offloader", Offloader), ("name", str), ("hook", Any)])


class Offload(Behaviour):
    """An ``OFFLOAD`` action, outermost on its module (around a recompute's checkpoint too); its setting: its limit."""

    name = "offload"

    def settings(self, action: StageAction) -> dict[str, Any]:
        return {action.stage: action.offload_limit or 0} if action.action is Action.OFFLOAD else {}

    def install(self, target: Target, settings: dict[str, Any]) -> None:
        offloader = Offloader(measure=target.measure, limits={n: v for n, v in settings.items() if v},
                              order=target.order)
        position = {n: i for i, n in enumerate(target.order or ())}
        for name, limit in settings.items():
            i, hook = position.get(name), None
            if i is not None and i + 1 < len(position):
                # The next stage's forward ran: this stage's copies are done, its device tensors may go.
                nxt = target.modules[target.order[i + 1]]  # type: ignore[index]
                hook = nxt.register_forward_hook(release_after_next(offloader, name))
            record_of(target.modules[name]).behaviours[self.name] = (limit, Offloading(offloader, name, hook))

    def wrap(self, module: nn.Module, setting: Any, state: Any, call: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(offloaded_call, state.offloader, state.name, module, state.hook is not None, call)

    def remove(self, setting: Any, state: Any) -> None:
        if state.hook is not None:
            state.hook.remove()

    def fields(self, name: str, setting: Any) -> dict[str, Any]:
        return {"action": Action.OFFLOAD, "offload_limit": setting or None}


OFFLOAD = Offload()


def offloaded_modules(model: nn.Module) -> list[str]:
    return list(OFFLOAD.read(dict(model.named_modules())))


def model_offloader(model: nn.Module) -> Offloader | None:
    state = state_of(model, OFFLOAD.name)
    return state.offloader if state is not None else None


def apply_offload(model: nn.Module, names: Iterable[str], order: Sequence[str] | None = None,
                  measure: bool = False, limits: dict[str, int] | None = None) -> nn.Module:
    """Offload, in place, what the named modules save for backward (docs/offload.md). ``order``: every stage in
    execution order (a stage's tensors leave once the next one ran); ``limits``: bytes per module and call.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    >>> offloaded_modules(apply_offload(net, ["0"]))
    ['0']
    """
    names, limits = list(names), dict(limits or {})
    modules = dict(model.named_modules())
    check_names(model, modules, names, "offload")
    check_actions([StageAction.offload(n, limits.get(n)) for n in names])
    OFFLOAD.uninstall(model)
    OFFLOAD.install(Target(modules, tuple(order) if order is not None else None, measure),
                    {n: limits.get(n) or 0 for n in names})
    return model
