"""How an ``nn.Sequential`` runs segments: which Sequentials qualify, where a segment's items are,
and the class swap that makes one yield a runner in place of a segment's items when iterated
(Python looks ``__iter__`` up on the type, so an instance attribute cannot do it).

Example:
    >>> net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    >>> segment_positions(dict(net.named_modules()), ["1", "2"])
    ('', [1, 2])
    >>> type(net).__name__ == segmented_class(type(net)).__name__, segmented_class(type(net)) is not type(net)
    (True, True)
"""

from __future__ import annotations

from typing import Iterator, Sequence

from torch import nn

SEGMENTS = "_remat_segments"  # in a Sequential's __dict__: [(start, end, runner, names)]
_CLASSES: dict[type, type] = {}


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
    """Whether ``container``'s items can form segments: an ``nn.Sequential`` iterated as Sequential
    iterates (its own ``__iter__``), with no forward of its own set on the instance.

    Example:
        >>> qualifies(nn.Sequential(nn.Linear(2, 2))), qualifies(nn.ModuleList([nn.Linear(2, 2)]))
        (True, False)
    """
    base = type(container).__mro__[1] if getattr(type(container), "_remat_segmented", False) else type(container)
    return (isinstance(container, nn.Sequential) and base.__iter__ is nn.Sequential.__iter__
            and "forward" not in container.__dict__)


def segment_positions(modules: dict[str, nn.Module], names: Sequence[str]) -> tuple[str, list[int]]:
    """The Sequential holding a segment and the positions of its items, or a ValueError saying why
    the names are not a run of consecutive items of one qualifying Sequential."""
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
