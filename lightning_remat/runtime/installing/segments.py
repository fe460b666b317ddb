"""Recompute runs of consecutive items of an ``nn.Sequential`` as ONE checkpoint segment each.

A plan's ``segments`` (``core.spans``) name consecutive children of one ``nn.Sequential``. Their
Sequential yields, while the plan is applied, one *runner* per segment in place of the segment's
items when iterated: ``nn.Sequential.forward`` (``for module in self``) and code that loops over a
Sequential itself (transformers' ``ResNetStage``: ``for layer in self.layers``) then call the
runner, which runs the items in order under a single non-reentrant checkpoint. The runner is a
plain ``nn.Sequential`` of the same items, recomputed through ``apply``'s own wrapper (so dropout
masks are replayed and BatchNorm statistics updated once, exactly as for a single module).

How: the Sequential's class is swapped for a subclass of the same name that overrides only
``__iter__`` (Python looks dunder methods up on the type, so an instance attribute cannot do
it). Nothing else changes: the runner is kept in the instance ``__dict__``, not registered as a
child, so ``named_modules``, parameter names and ``state_dict`` keys are those of the model, and
``remove_segments`` puts the original class back. Indexing and ``len`` are unchanged.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)])
    >>> apply_segments(net, [["0", "1", "2"]])
    >>> segmented_modules(net), len(list(net)), type(net).__name__
    ([['0', '1', '2']], 2, 'Sequential')
    >>> net(torch.randn(2, 4, requires_grad=True)).sum().backward()
    >>> remove_segments(net); type(net) is nn.Sequential and len(list(net)) == 4
    True
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
from torch import nn

_SEGMENTS = "_remat_segments"  # in the Sequential's __dict__: [(start, end, runner, names)]
_CLASSES: dict[type, type] = {}


def _segmented_iter(self: nn.Sequential) -> Iterator[nn.Module]:
    items = list(self._modules.values())
    position = 0
    for start, end, runner, _ in self.__dict__.get(_SEGMENTS, ()):
        yield from items[position:start]
        yield runner
        position = end
    yield from items[position:]


def _segmented_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls,), {"__iter__": _segmented_iter, "__module__": cls.__module__,
                                                     "__qualname__": cls.__qualname__, "_remat_segmented": True})
    return _CLASSES[cls]


def qualifies(container: nn.Module) -> bool:
    """Whether ``container``'s items can form segments: an ``nn.Sequential`` iterated as Sequential
    iterates (its own ``__iter__``), with no forward of its own set on the instance.

    Example:
        >>> qualifies(nn.Sequential(nn.Linear(2, 2))), qualifies(nn.ModuleList([nn.Linear(2, 2)]))
        (True, False)
    """
    base = type(container).__mro__[1] if getattr(type(container), "_remat_segmented", False) else type(container)
    return (isinstance(container, nn.Sequential) and base.__iter__ is nn.Sequential.__iter__
            and "forward" not in container.__dict__)


def _parent_and_positions(modules: dict[str, nn.Module], names: Sequence[str]) -> tuple[str, list[int]]:
    if len(names) < 2:
        raise ValueError(f"a segment names two or more consecutive modules, got {list(names)}")
    parents = {n.rpartition(".")[0] for n in names}
    if len(parents) != 1:
        raise ValueError(f"a segment's modules must be items of one nn.Sequential, got {list(names)}")
    parent = parents.pop()
    container = modules.get(parent)
    if container is None or not qualifies(container):
        raise ValueError(f"segment {list(names)}: {parent or 'the model'!r} is not an nn.Sequential that iterates its items")
    keys = list(container._modules)
    missing = [n for n in names if n.rpartition(".")[2] not in keys]
    if missing:
        raise ValueError(f"plan names module(s) {missing} that the model does not have")
    positions = [keys.index(n.rpartition(".")[2]) for n in names]
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise ValueError(f"segment {list(names)} is not a run of consecutive items of {parent!r}")
    return parent, positions


def check_segments(modules: dict[str, nn.Module], segments: Sequence[Sequence[str]], checkpointed: Sequence[str]) -> None:
    """Raise ValueError unless every segment is a run of consecutive items of one qualifying Sequential,
    segments do not overlap, and no module recomputed alone lies inside, around or in a segment."""
    taken: set[str] = set()
    for names in segments:
        _parent_and_positions(modules, names)
        overlap = taken & set(names)
        if overlap:
            raise ValueError(f"plan names module(s) {sorted(overlap)} in two segments")
        taken.update(names)
    for name in checkpointed:
        if any(name == t or name.startswith(t + ".") or t.startswith(name + ".") for t in taken):
            raise ValueError(f"plan recomputes {name!r} alone and as part of a segment")


def apply_segments(model: nn.Module, segments: Sequence[Sequence[str]]) -> None:
    """Recompute each run of names as one checkpoint (names as ``model.named_modules()`` gives them).
    Call ``remove_segments`` first to replace a previous set."""
    from .apply import _wrap  # apply imports this module; the recompute wrapper is apply's own

    modules = dict(model.named_modules())
    check_segments(modules, segments, ())
    by_parent: dict[str, list] = {}
    for names in segments:
        parent, positions = _parent_and_positions(modules, names)
        runner = nn.Sequential(*[modules[n] for n in names])
        _wrap(runner)
        by_parent.setdefault(parent, []).append((positions[0], positions[-1] + 1, runner, list(names)))
    for parent, entries in by_parent.items():
        container = modules[parent]
        container.__dict__[_SEGMENTS] = sorted(entries, key=lambda e: e[0])
        if not getattr(type(container), "_remat_segmented", False):
            container.__class__ = _segmented_class(type(container))


def remove_segments(model: nn.Module) -> None:
    """Undo ``apply_segments``: every Sequential gets back its class and iterates its items again."""
    for module in model.modules():
        if _SEGMENTS in module.__dict__:
            del module.__dict__[_SEGMENTS]
            if getattr(type(module), "_remat_segmented", False):
                module.__class__ = type(module).__mro__[1]


def segmented_modules(model: nn.Module) -> list[list[str]]:
    """The segments currently applied to ``model``, as lists of module names (a sibling of
    ``checkpointed_modules``)."""
    found = []
    for name, module in model.named_modules():
        for _, _, _, names in module.__dict__.get(_SEGMENTS, ()):
            found.append(list(names))
    return found


def chained_groups(model: nn.Module, step: Any, groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """Split ``groups`` (runs of consecutive items of one Sequential) into the runs that one forward of
    ``step(model)`` really chains: each item called once with a single tensor, the output of the
    item before it, and nothing else. Runs ``step`` once under ``torch.no_grad()`` (the caller
    replays random generators and restores buffers)."""
    modules = dict(model.named_modules())
    calls: dict[str, list] = {n: [] for g in groups for n in g}

    def hook(name: str):
        def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            calls[name].append((args, kwargs, output))
        return record

    handles = [modules[n].register_forward_hook(hook(n), with_kwargs=True) for n in calls]
    try:
        with torch.no_grad():
            step(model)
    finally:
        for h in handles:
            h.remove()
    chained = []
    for group in groups:
        run: list[str] = []
        for name in group:
            seen = calls[name]
            simple = len(seen) == 1 and len(seen[0][0]) == 1 and not seen[0][1] and isinstance(seen[0][2], torch.Tensor)
            linked = simple and bool(run) and seen[0][0][0] is calls[run[-1]][0][2]
            if linked:
                run.append(name)
                continue
            if len(run) >= 2:
                chained.append(run)
            run = [name] if simple else []
        if len(run) >= 2:
            chained.append(run)
    return chained


def sequential_groups(model: nn.Module, stages: Sequence[str]) -> list[list[str]]:
    """Runs of stages that are consecutive items of one qualifying ``nn.Sequential``.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.Tanh()) for _ in range(3)])
        >>> sequential_groups(net, ["0", "1", "2"])
        [['0', '1', '2']]
    """
    modules = dict(model.named_modules())
    stage_set = set(stages)
    groups = []
    for parent, container in modules.items():
        if not qualifies(container):
            continue
        run: list[str] = []
        for key in container._modules:
            name = f"{parent}.{key}" if parent else key
            if name in stage_set:
                run.append(name)
                continue
            if len(run) >= 2:
                groups.append(run)
            run = []
        if len(run) >= 2:
            groups.append(run)
    return groups
