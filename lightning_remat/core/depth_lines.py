"""The line fits of the depth fit (``core.depth_fit``): a middle layer's number is a line in ``N`` and ``d``
(layers after it), checked on five points; the rest are lines in ``N``. Misfits raise ``NoFit``.

Example:
    >>> fit = Fit(12)
    >>> fit.line(10, 13), fit.line(Pair(10, 5), Pair(13, 5)), pair_figures(99 + 7, 3, 99)
    (34, 34, Pair(forward=7, backward=None))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .profile_algebra import Term

# The two depths profiled: five points on the middle layers (two, then three) check the three-term linear form.
DEPTHS = (4, 5)


class NoFit(Exception):
    """The profiles do not fit the linear form: the caller profiles the whole model."""


@dataclass(frozen=True)
class Pair:
    """A peak's forward and backward figures."""

    forward: int | None
    backward: int | None


class Fit:
    """Fits every number of the profile on the two depths.

    A middle layer's number is ``α + β N + γ d``: ``β`` static memory per layer, ``γ`` a later layer's
    gradients. Figures are not clamped (FSDP2 makes some negative), so every line is exact.
    """

    def __init__(self, layers: int):
        self.layers = layers

    def middle(self, points: dict[tuple[int, int], Any]) -> Callable[[int], Any]:
        """``points[(N, d)]`` for the measured middle layers; returns ``d -> value`` at ``self.layers``."""
        if isinstance(next(iter(points.values())), Pair):
            figures = [self._figure({k: getattr(pair, phase) for k, pair in points.items()})
                       for phase in ("forward", "backward")]
            present = [f for f in figures if f is not None]
            if not present:
                raise NoFit
            return lambda d: max(f(d) for f in present)
        a, b = DEPTHS
        beta = points[(b, 1)] - points[(a, 1)]
        gamma = points[(a, 2)] - points[(a, 1)]
        base = points[(a, 1)]
        for (n, d), value in points.items():
            expected = base + beta * (n - a) + gamma * (d - 1)
            # Bytes and FLOPs must fit exactly; seconds (a real profile's timings) to rounding.
            if value != expected and not (isinstance(value, float) and math.isclose(value, expected, rel_tol=1e-6,
                                                                                      abs_tol=1e-12)):
                raise NoFit
        return lambda d: base + beta * (self.layers - a) + gamma * (d - 1)

    def line(self, small: Any, large: Any) -> Any:
        """A number of the first layer, the last, a gap or the whole profile: linear in ``N``."""
        if isinstance(small, Pair):
            figures = []
            for phase in ("forward", "backward"):
                v, w = getattr(small, phase), getattr(large, phase)
                if (v is None) != (w is None):
                    raise NoFit  # a pass visits the region at one depth and not at the other
                if v is not None:
                    figures.append(self.line(v, w))
            if not figures:
                raise NoFit
            return max(figures)
        return small + (large - small) * (self.layers - DEPTHS[0])

    def boundary(self, term: Term, values: Sequence[Any]) -> Any:
        """``line`` as a combiner of the profile algebra, on the (small, large) values of ``term``."""
        return self.line(*values)

    def middles(self, points: Sequence[tuple[int, int]]) -> Callable[[Term, Sequence[Any]], Callable[[int], Any]]:
        """``middle`` as a combiner, on values measured at ``points``: each term becomes ``d -> value``."""
        return lambda term, values: self.middle(dict(zip(points, values)))

    def _figure(self, points: dict[tuple[int, int], int | None]) -> Callable[[int], int] | None:
        """One phase's figure of a middle peak: None where that pass visits no measured region, else a line."""
        missing = [k for k, v in points.items() if v is None]
        if len(missing) == len(points):
            return None
        if missing:
            raise NoFit
        return self.middle(points)


def pair_figures(up: int, down: int, ballast: int) -> Pair:
    """A peak's figures from its forward- and backward-ballast values, less the ballast: None where not lifted
    (that pass never visited the region); lifted in neither run (the optimizer step), both kept.
    """

    def lifted(value: int) -> int | None:
        # Half the ballast: a lifted figure sits below it where the region's own figure is negative (FSDP2).
        return value - ballast if value >= ballast // 2 else None

    forward, backward = lifted(up), lifted(down)
    if forward is None and backward is None:
        return Pair(up, down)
    # FSDP2 leaves no moment between two late layers in backward: that figure does not exist.
    return Pair(forward, backward)
