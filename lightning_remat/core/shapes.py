"""Batch shapes and the ladder they are rounded to: what a plan that follows the batch's shape is made for.

A batch is read as a ``Shape`` (batch size, sequence length). ``ladder_up``/``ladder_down`` round
a size to a ladder of a few steps per doubling; ``ShapeBuckets`` rounds a shape up on it, so a run
sees few distinct shapes to plan and a plan is never made for a smaller shape than its batch's. No
torch.

Example:
    >>> ShapeBuckets(per_octave=4).up(Shape(4, 100))
    Shape(batch_size=4, seq_len=112)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Shape:
    """A batch's shape as the fit sees it: the batch size and the sequence length (1 for a batch
    without one, such as images).

    Example:
        >>> Shape(4, 128).tokens, Shape(4, 128).covers(Shape(2, 128)), str(Shape(4, 128))
        (512, True, '4x128')
    """

    batch_size: int
    seq_len: int = 1

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"a shape's {name} must be an int >= 1, got {value!r}")

    @property
    def tokens(self) -> int:
        """Batch size times sequence length."""
        return self.batch_size * self.seq_len

    def covers(self, other: "Shape") -> bool:
        """Whether this shape is at least ``other`` in both dimensions."""
        return self.batch_size >= other.batch_size and self.seq_len >= other.seq_len

    def union(self, other: "Shape") -> "Shape":
        """The smallest shape covering both."""
        return Shape(max(self.batch_size, other.batch_size), max(self.seq_len, other.seq_len))

    def __str__(self) -> str:
        return f"{self.batch_size}x{self.seq_len}"


def ladder_up(n: int, per_octave: int = 4) -> int:
    """The smallest value of the ladder ``{2**k * (1 + j / per_octave)}`` at or above ``n``: every
    integer up to ``2 * per_octave``, then ``per_octave`` steps per doubling (at most ``1 /
    per_octave`` above ``n``).

    Example:
        >>> [ladder_up(n) for n in (1, 7, 9, 33, 100, 128, 129)]
        [1, 7, 10, 40, 112, 128, 160]
    """
    if n <= 2 * per_octave:
        return max(1, n)
    step = 2 ** (n.bit_length() - 1) // per_octave  # the ladder's step within n's octave
    return -(-n // step) * step


def ladder_down(n: int, per_octave: int = 4) -> int:
    """The largest value of the ``ladder_up`` ladder at or below ``n``.

    Example:
        >>> [ladder_down(n) for n in (1, 7, 9, 33, 100, 128, 129)]
        [1, 7, 8, 32, 96, 128, 128]
    """
    if n <= 2 * per_octave:
        return max(1, n)
    step = 2 ** (n.bit_length() - 1) // per_octave
    return n // step * step


@dataclass(frozen=True)
class ShapeBuckets:
    """How shapes are rounded up before they are planned: each dimension up the ``ladder_up``
    ladder (``per_octave`` steps per doubling; 0: not rounded), never beyond ``max_shape`` when one
    is declared (a batch beyond it is planned at its own shape).

    Rounding up bounds the number of distinct plans (about ``per_octave`` per doubling of each
    dimension) and makes every plan one for a shape at least as large as its batch's.

    Example:
        >>> ShapeBuckets().up(Shape(3, 100)), ShapeBuckets(max_shape=Shape(8, 100)).up(Shape(3, 97))
        (Shape(batch_size=3, seq_len=112), Shape(batch_size=3, seq_len=100))
        >>> ShapeBuckets(per_octave=0).up(Shape(3, 100))
        Shape(batch_size=3, seq_len=100)
    """

    per_octave: int = 4
    max_shape: Shape | None = None

    def up(self, shape: Shape) -> Shape:
        """The bucket of ``shape``: the shape its plan is made for (covers ``shape``)."""
        if self.per_octave <= 0:
            return shape
        rounded = Shape(ladder_up(shape.batch_size, self.per_octave), ladder_up(shape.seq_len, self.per_octave))
        if self.max_shape is not None:
            rounded = Shape(min(rounded.batch_size, max(self.max_shape.batch_size, shape.batch_size)),
                            min(rounded.seq_len, max(self.max_shape.seq_len, shape.seq_len)))
        return rounded
