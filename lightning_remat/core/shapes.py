"""Batch shapes, and the ladder of a few steps per doubling they are rounded up to (``ShapeBuckets``), so a run
plans few distinct shapes and never one smaller than its batch's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, Iterable

# Markers in a layout's sizes for the batch and sequence dimensions.
BATCH, SEQUENCE = -1, -2
_MARKS = {BATCH: "b", SEQUENCE: "s"}

Entry = tuple[str, tuple[int, ...]]  # a tensor's path in the batch, and its size (with markers)


def _entries(layout: Iterable[Any]) -> tuple[Entry, ...]:
    """``layout`` as sorted ``(path, size)`` tuples (lists, as JSON holds them, accepted), checked."""
    entries = []
    for entry in layout:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[0], str) \
                or not isinstance(entry[1], (list, tuple)):
            raise ValueError(f"a layout entry must be (path, sizes), got {entry!r}")
        path, sizes = entry
        for size in sizes:
            if isinstance(size, bool) or not isinstance(size, int) or (size < 0 and size not in _MARKS):
                raise ValueError(f"a layout size must be an int >= 0, BATCH or SEQUENCE, got {size!r} at {path!r}")
        entries.append((path, tuple(sizes)))
    entries.sort()
    if len({path for path, _ in entries}) != len(entries):
        raise ValueError(f"a layout names a path twice: {[path for path, _ in entries]}")
    # One tensor of batch (and sequence) only, the batch itself: the batch size and sequence say it all.
    if len(entries) == 1 and entries[0] in (("", (BATCH,)), ("", (BATCH, SEQUENCE))):
        return ()
    return tuple(entries)


@dataclass(frozen=True, order=True, repr=False)
class Shape:
    """A batch's shape; ``layout``: every tensor as ``(path, sizes)`` with ``BATCH`` and ``SEQUENCE`` markers, empty
    for a plain ``(b, s)`` tensor. ``covers`` and ``union`` need shapes of the same paths and dimensions.

    Example:
        >>> small = Shape(8, 1, (("image", (BATCH, 3, 32, 32)),))
        >>> large = Shape(8, 1, (("image", (BATCH, 3, 64, 48)),))
        >>> large.covers(small), small.covers(large), small.covers(Shape(8, 1)), large.elements
        (True, False, False, 73728)
    """

    batch_size: int
    seq_len: int = 1
    layout: tuple[Entry, ...] = ()

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"a shape's {name} must be an int >= 1, got {value!r}")
        if not isinstance(self.layout, (list, tuple)):
            raise ValueError(f"a shape's layout must be a tuple of (path, sizes), got {self.layout!r}")
        object.__setattr__(self, "layout", _entries(self.layout))

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def elements(self) -> int:
        """Elements of every tensor the shape describes (``tokens`` without a layout)."""
        if not self.layout:
            return self.tokens
        return sum(math.prod(self.sizes(path)) for path, _ in self.layout)

    @property
    def structure(self) -> tuple:
        """The layout without its sizes: paths, numbers of dimensions, where the markers are."""
        return tuple((path, tuple(size if size < 0 else None for size in sizes)) for path, sizes in self.layout)

    def sizes(self, path: str) -> tuple[int, ...]:
        """The size of the tensor at ``path`` at this shape (markers replaced)."""
        marked = dict(self.layout)[path]
        return tuple({BATCH: self.batch_size, SEQUENCE: self.seq_len}.get(size, size) for size in marked)

    def comparable(self, other: "Shape") -> bool:
        """Whether ``other``'s layout has this one's structure (``covers`` and ``union`` need it)."""
        return self.structure == other.structure

    def covers(self, other: "Shape") -> bool:
        """Whether this shape is comparable with ``other`` and at least ``other`` in every dimension."""
        return (self.batch_size >= other.batch_size and self.seq_len >= other.seq_len and self.comparable(other)
                and all(a >= b for (_, mine), (_, theirs) in zip(self.layout, other.layout)
                        for a, b in zip(mine, theirs)))

    def union(self, other: "Shape") -> "Shape":
        """The smallest shape covering both (comparable shapes only: ``ValueError`` otherwise)."""
        if not self.comparable(other):
            raise ValueError(f"shapes of other layouts have no union: {self} and {other}")
        layout = tuple((path, tuple(max(a, b) for a, b in zip(mine, theirs)))
                       for (path, mine), (_, theirs) in zip(self.layout, other.layout))
        return Shape(max(self.batch_size, other.batch_size), max(self.seq_len, other.seq_len), layout)

    def to_list(self) -> list:
        """As JSON: ``[batch_size, seq_len]``, plus ``[[path, [sizes]], ...]`` when there is a layout."""
        head = [self.batch_size, self.seq_len]
        return [*head, [[path, list(sizes)] for path, sizes in self.layout]] if self.layout else head

    @classmethod
    def from_list(cls, data: Any) -> "Shape":
        """The shape ``to_list`` wrote (``ValueError`` for anything else)."""
        if not isinstance(data, (list, tuple)) or len(data) not in (2, 3):
            raise ValueError(f"a shape must be [batch_size, seq_len] or [batch_size, seq_len, layout], got {data!r}")
        return cls(*data)

    def __str__(self) -> str:
        head = f"{self.batch_size}x{self.seq_len}"
        if not self.layout:
            return head
        parts = ["x".join(_MARKS.get(size, str(size)) for size in sizes) or "scalar" for _, sizes in self.layout]
        return head + " {" + ", ".join(f"{path}: {part}" if path else part
                                       for (path, _), part in zip(self.layout, parts)) + "}"

    def __repr__(self) -> str:
        layout = f", layout={self.layout!r}" if self.layout else ""
        return f"Shape(batch_size={self.batch_size}, seq_len={self.seq_len}{layout})"


def ladder_up(n: int, per_octave: int = 4) -> int:
    """The smallest value of the ladder ``{2**k * (1 + j / per_octave)}`` at or above ``n``."""
    if n <= 2 * per_octave:
        return max(1, n)
    step = 2 ** (n.bit_length() - 1) // per_octave  # the ladder's step within n's octave
    return -(-n // step) * step


def ladder_down(n: int, per_octave: int = 4) -> int:
    """The largest value of the ``ladder_up`` ladder at or below ``n``."""
    if n <= 2 * per_octave:
        return max(1, n)
    step = 2 ** (n.bit_length() - 1) // per_octave
    return n // step * step


@dataclass(frozen=True)
class ShapeBuckets:
    """Shapes rounded up the ladder before planning (``per_octave=0``: not at all), never beyond ``max_shape``."""

    per_octave: int = 4
    max_shape: Shape | None = None

    def up(self, shape: Shape, varying: Collection[tuple[str, int]] | None = None) -> Shape:
        """The shape ``shape``'s plan is made for; ``varying``: the ``(path, dimension)`` to round (None: all)."""
        if self.per_octave <= 0:
            return shape
        layout = tuple((path, tuple(size if size < 0 or (varying is not None and (path, axis) not in varying)
                                    else ladder_up(size, self.per_octave) for axis, size in enumerate(sizes)))
                       for path, sizes in shape.layout)
        rounded = Shape(ladder_up(shape.batch_size, self.per_octave), ladder_up(shape.seq_len, self.per_octave),
                        layout)
        if self.max_shape is not None:
            rounded = self._within(rounded, shape)
        return rounded

    def _within(self, rounded: Shape, shape: Shape) -> Shape:
        """``rounded`` no larger than ``max_shape`` where it rounded beyond it."""
        cap = self.max_shape
        layout = rounded.layout
        if cap.layout and cap.comparable(shape):
            layout = tuple((path, tuple(min(r, max(c, s)) for r, c, s in zip(sizes, limit, own)))
                           for (path, sizes), (_, limit), (_, own) in zip(rounded.layout, cap.layout, shape.layout))
        return Shape(min(rounded.batch_size, max(cap.batch_size, shape.batch_size)),
                     min(rounded.seq_len, max(cap.seq_len, shape.seq_len)), layout)
