"""Runs of consecutive ``nn.Sequential`` items recomputed as one checkpoint: the Sequential yields a runner in
their place when iterated (``__iter__`` is looked up on the type, hence the swapped class)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from ...core.actions import StageAction
from ...core.vocabulary import Action
from ..measuring.exclusive import planning_runs_here
from .records import SEGMENTS, Behaviour, Target, record_of, running

_CLASSES: dict[type, type] = {}  # a Sequential class -> its segmented subclass


def _segmented_iter(self: nn.Sequential) -> Iterator[nn.Module]:
    items = list(self._modules.values())
    position = 0
    for start, end, runner, _ in self.__dict__.get(SEGMENTS, ()):
        yield from items[position:start]
        yield runner
        position = end
    yield from items[position:]


def segmented_class(cls: type) -> type:
    """The subclass of ``cls`` (same name) whose instances yield their segments' runners when iterated."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls,), {"__iter__": _segmented_iter, "__module__": cls.__module__,
                                                     "__qualname__": cls.__qualname__, "_remat_segmented": True})
    return _CLASSES[cls]


def qualifies(container: nn.Module) -> bool:
    """Whether ``container``'s items can form segments: an ``nn.Sequential`` with Sequential's own ``__iter__`` and forward."""
    base = type(container).__mro__[1] if getattr(type(container), "_remat_segmented", False) else type(container)
    return (isinstance(container, nn.Sequential) and base.__iter__ is nn.Sequential.__iter__
            and "forward" not in container.__dict__)


def segment_positions(modules: dict[str, nn.Module], names: Sequence[str]) -> tuple[str, list[int]]:
    """The Sequential holding a segment and its items' positions, or a ValueError saying why the names are not one."""
    if len(names) < 2:
        raise ValueError(f"a segment names two or more consecutive modules, got {list(names)}")
    parents = {n.rpartition(".")[0] for n in names}
    if len(parents) != 1:
        raise ValueError(f"a segment's modules must be items of one nn.Sequential, got {list(names)}")
    parent = parents.pop()
    container = modules.get(parent)
    if container is None or not qualifies(container):
        raise ValueError(f"segment {list(names)}: {parent or 'the model'!r} is not an nn.Sequential that iterates its items")
    keys = list(container._modules)  # every name is the model's: installer.install checked them first
    positions = [keys.index(n.rpartition(".")[2]) for n in names]
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise ValueError(f"segment {list(names)} is not a run of consecutive items of {parent!r}")
    return parent, positions


class Segment(Behaviour):
    """A ``SEGMENT`` action: its items run as one checkpoint, by a runner the Sequential yields in their place."""

    name = "segment"

    def settings(self, action: StageAction) -> dict[str, Any]:
        return {action.stage: action.segment} if action.action is Action.SEGMENT else {}

    def check(self, modules: dict[str, nn.Module], settings: dict[str, Any]) -> None:
        for names in dict.fromkeys(settings.values()):
            segment_positions(modules, names)

    def install(self, target: Target, settings: dict[str, Any]) -> None:
        by_parent: dict[str, list] = {}
        for names in dict.fromkeys(settings.values()):
            parent, positions = segment_positions(target.modules, names)
            runner = nn.Sequential(*[target.modules[n] for n in names])
            record_of(runner).behaviours["recompute"] = (True, None)
            by_parent.setdefault(parent, []).append((positions[0], positions[-1] + 1, runner, list(names)))
        for parent, entries in by_parent.items():
            container = target.modules[parent]
            container.__dict__[SEGMENTS] = sorted(entries, key=lambda e: e[0])
            if not getattr(type(container), "_remat_segmented", False):
                container.__class__ = segmented_class(type(container))

    def uninstall(self, model: nn.Module) -> None:
        """Every Sequential gets back its class and iterates its items again."""
        for module in model.modules():
            if SEGMENTS in module.__dict__:
                del module.__dict__[SEGMENTS]
                if getattr(type(module), "_remat_segmented", False):
                    module.__class__ = type(module).__mro__[1]

    def read(self, modules: Mapping[str, nn.Module], only_running: bool = False) -> dict[str, Any]:
        """``only_running``: the segments of Sequentials whose class still runs them, by runners that recompute."""
        found = {}
        for m in modules.values():
            if SEGMENTS in m.__dict__ and (not only_running or getattr(type(m), "_remat_segmented", False)):
                found.update({n: tuple(names) for _, _, runner, names in m.__dict__[SEGMENTS] if not only_running
                              or ((record := running(runner)) is not None and "recompute" in record.behaviours)
                              for n in names})
        return found

    def fields(self, name: str, setting: Any) -> dict[str, Any]:
        return {"action": Action.SEGMENT, "segment": setting}


SEGMENT = Segment()


def recorded_calls(model: nn.Module, step: Any, names: Sequence[str]) -> dict[str, list]:
    """Each named module's calls ``(args, kwargs, output, versions)`` in one forward of ``step(model)``, under no_grad.

    ``versions`` (of the tensor arguments as the call began, of the output as it ended) tell an in-place change.
    """
    modules = dict(model.named_modules())
    calls: dict[str, list] = {n: [] for n in names}

    began: dict[str, list] = {n: [] for n in names}

    def pre_hook(name: str):
        def record(module: nn.Module, args: tuple) -> None:
            if not planning_runs_here():  # another thread's forward of the same model
                return
            began[name].append(tuple(a._version if isinstance(a, torch.Tensor) else None for a in args))
        return record

    def hook(name: str):
        def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not planning_runs_here():
                return
            ended = output._version if isinstance(output, torch.Tensor) else None
            calls[name].append((args, kwargs, output, (began[name].pop(), ended)))
        return record

    with contextlib.ExitStack() as hooks:
        for n in calls:
            hooks.enter_context(modules[n].register_forward_pre_hook(pre_hook(n)))
            hooks.enter_context(modules[n].register_forward_hook(hook(n), with_kwargs=True))
        # Under no_grad: no graph, no activations held. A step that differentiates inside itself (a gradient
        # penalty) cannot: it runs once more with its graph (the caller restores generators and buffers).
        try:
            with torch.no_grad():
                step(model)
            return calls
        except RuntimeError as error:
            if "does not require grad" not in str(error):
                raise
        for seen in (*calls.values(), *began.values()):
            seen.clear()
        step(model)
    return calls


def chained_groups(groups: Sequence[Sequence[str]], calls: dict[str, list]) -> list[list[str]]:
    """Split ``groups`` into the runs a forward chains, each item fed only the one before (``calls``: its record)."""

    def simple(name: str) -> bool:  # called once, on one tensor, returning one
        seen = calls[name]
        return len(seen) == 1 and len(seen[0][0]) == 1 and not seen[0][1] and isinstance(seen[0][2], torch.Tensor)

    return [run for group in groups for run in _runs(
        group, simple, lambda before, name: simple(name) and calls[name][0][0][0] is calls[before][0][2])]


def sequential_groups(model: nn.Module, stages: Sequence[str]) -> list[list[str]]:
    """Runs of stages that are consecutive items of one qualifying ``nn.Sequential``."""
    stage_set = set(stages)
    return [run for parent, container in model.named_modules() if qualifies(container)
            for run in _runs([f"{parent}.{key}" if parent else key for key in container._modules],
                             stage_set.__contains__, lambda before, name: name in stage_set)]


def _runs(names: Sequence[str], starts: Any, follows: Any) -> list[list[str]]:
    """The runs of two or more ``names``, each from a name ``starts`` accepts on while ``follows(previous, name)``."""
    runs, run = [], []
    for name in names:
        if run and follows(run[-1], name):
            run.append(name)
            continue
        runs.append(run)
        run = [name] if starts(name) else []
    return [r for r in [*runs, run] if len(r) >= 2]
