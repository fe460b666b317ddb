"""The behaviours a plan installs (plug-ins, ``register``), composed in one ``Record`` per module."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

from torch import nn

from ...core.actions import StageAction
from ...core.errors import PlanMismatchError
from .compiled import uncompiled

RECORD = "_remat_installed"  # in a module's __dict__: its Record
SEGMENTS = "_remat_segments"  # in a Sequential's __dict__: [(start, end, runner, names)] (segments.py)


@dataclass
class Record:
    """What the installer did to one module: the forward it had, and per behaviour name its ``(setting, state)``."""

    original: Callable[..., Any]
    had_instance_forward: bool
    behaviours: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    installed: Callable[..., Any] | None = None  # the forward the installer set: the behaviours run while it is


@dataclass
class Target:
    """What a behaviour installs on: the uncompiled model's modules by name, the stages' order, fake or not."""

    modules: dict[str, nn.Module]
    order: tuple[str, ...] | None = None
    measure: bool = False


class Behaviour:
    """One way to treat a module: subclass, override what differs, ``register`` an instance.

    >>> class Counted(Behaviour):
    ...     name = "counted"
    >>> Counted().settings(StageAction("h.0", extra={"counted": True}))
    {'h.0': True}
    """

    name = ""

    def settings(self, action: StageAction) -> dict[str, Any]:
        """Per module ``action`` puts this behaviour on, its setting (empty: not handled)."""
        extra = dict(action.extra)
        return {action.stage: extra[self.name]} if self.name in extra else {}

    def check(self, modules: dict[str, nn.Module], settings: dict[str, Any]) -> None:
        """Raise ValueError where the model cannot take ``settings`` (before anything changes)."""

    def install(self, target: Target, settings: dict[str, Any]) -> None:
        """Put ``settings`` on the modules' records."""
        for name, setting in settings.items():
            record_of(target.modules[name]).behaviours[self.name] = (setting, None)

    def wrap(self, module: nn.Module, setting: Any, state: Any, call: Callable[..., Any]) -> Callable[..., Any]:
        """The call that runs this behaviour around ``call`` (the behaviours after it)."""
        return call

    def checkpoint_options(self, setting: Any, state: Any, options: dict[str, Any]) -> None:
        """Change the options a recompute of the module checkpoints with (``checkpoint``: the function)."""

    def remove(self, setting: Any, state: Any) -> None:
        """Let go of what ``install`` made besides the record (hooks)."""

    def uninstall(self, model: nn.Module) -> None:
        """Take this behaviour off every module of ``model``."""
        for module in list(model.modules()):
            record = module.__dict__.get(RECORD)
            if record is not None and self.name in record.behaviours:
                self.remove(*record.behaviours.pop(self.name))
                settle(module)

    def read(self, modules: Mapping[str, nn.Module], only_running: bool = False) -> dict[str, Any]:
        """Per module of ``modules`` (by name) with this behaviour, its setting (``only_running``: whose record runs)."""
        return {name: record.behaviours[self.name][0] for name, m in modules.items()
                if (record := (running(m) if only_running else m.__dict__.get(RECORD))) is not None
                and record.behaviours.get(self.name, (None,))[0] is not None}

    def fields(self, name: str, setting: Any) -> dict[str, Any]:
        """The fields of module ``name``'s action that ``setting`` says (a snapshot merges them)."""
        return {"extra": {self.name: setting}}


BEHAVIOURS: list[Behaviour] = []  # the composition order, outermost first


def register(behaviour: Behaviour) -> Behaviour:
    """Add ``behaviour`` to the installer, innermost; returns it."""
    unregister(behaviour.name)
    BEHAVIOURS.append(behaviour)
    return behaviour


def unregister(name: str) -> None:
    """Take the behaviour ``name`` out of the installer (uninstall it from models first)."""
    BEHAVIOURS[:] = [b for b in BEHAVIOURS if b.name != name]


def installed_forward(module: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
    """The forward of a module with a record: its behaviours around its original forward."""
    record = module.__dict__[RECORD]
    call = record.original
    for b in reversed(BEHAVIOURS):
        if b.name in record.behaviours:
            call = b.wrap(module, *record.behaviours[b.name], call)
    return call(*args, **kwargs)


def check_names(model: nn.Module, modules: dict[str, nn.Module], names: Collection[str], what: str = "plan") -> None:
    """Raise ``PlanMismatchError`` (a plan for another model, docs/plans.md) for names ``model`` lacks."""
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise PlanMismatchError(f"{what} names module(s) {unknown} that {type(model).__name__} does not have")


def record_of(module: nn.Module) -> Record:
    """The module's record, made on first use; a module that refuses the new forward is left without one."""
    if RECORD not in module.__dict__:
        record = Record(module.forward, "forward" in module.__dict__)
        module.forward = functools.partial(installed_forward, module)  # type: ignore[method-assign]
        record.installed = module.__dict__["forward"]
        module.__dict__[RECORD] = record
    return module.__dict__[RECORD]


def settle(module: nn.Module) -> None:
    """Give a module without behaviours its own forward back exactly."""
    record = module.__dict__.get(RECORD)
    if record is None or record.behaviours:
        return
    del module.__dict__[RECORD]
    if record.had_instance_forward:
        module.forward = record.original  # type: ignore[method-assign]
    else:
        del module.forward


def running(module: nn.Module) -> Record | None:
    """``module``'s record if its behaviours run: its ``forward`` is the installer's, or wraps it (``__wrapped__``)."""
    record = module.__dict__.get(RECORD)
    forward = module.__dict__.get("forward")
    for _ in range(8):  # a few wrappers deep
        if record is None or forward is None:
            return None
        if forward is record.installed:
            return record
        forward = getattr(forward, "__wrapped__", None)
    return None


def state_of(model: nn.Module, name: str) -> Any:
    """The state of behaviour ``name`` on the first module of ``model`` that has it (None without)."""
    return next((r.behaviours[name][1] for m in model.modules()
                 if (r := m.__dict__.get(RECORD)) is not None and name in r.behaviours), None)


def recomputed(model: nn.Module) -> dict[str, str]:
    """Per module of ``model`` recomputed alone (names of the uncompiled model), its policy ("" for none)."""
    with uncompiled(model) as plain:
        return {name: record.behaviours.get("policy", ("",))[0] for name, m in plain.named_modules()
                if (record := m.__dict__.get(RECORD)) is not None and "recompute" in record.behaviours}


def installed_segments(model: nn.Module) -> list[list[str]]:
    return [list(names) for _, module in model.named_modules() for _, _, _, names in module.__dict__.get(SEGMENTS, ())]


def installed_hooks(model: nn.Module) -> set[int]:
    """Ids of the hooks the installer registered on ``model``'s modules (a behaviour's state ``hook``)."""
    return {hook.id for m in model.modules() if (record := m.__dict__.get(RECORD)) is not None
            for _, state in record.behaviours.values() if (hook := getattr(state, "hook", None)) is not None}


def without_installation(module: nn.Module, hooks: Collection[int] = ()) -> tuple[type, dict[str, Any]]:
    """The class and ``__dict__`` of a copy of ``module`` without what the installer put on it or ``hooks``."""
    state = {key: value for key, value in module.__dict__.items() if key not in (RECORD, SEGMENTS)}
    record = module.__dict__.get(RECORD)
    if record is not None:
        if record.had_instance_forward:
            state["forward"] = record.original
        else:
            state.pop("forward", None)
    for key, value in state.items():
        if "hooks" in key and isinstance(value, dict):
            state[key] = type(value)((k, v) for k, v in value.items() if k not in hooks)
    cls = type(module).__mro__[1] if getattr(type(module), "_remat_segmented", False) else type(module)
    return cls, state
