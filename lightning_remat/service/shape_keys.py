"""Shapes rounded up to buckets, so a run plans few; layout sizes only once they have varied (a bucket beyond a
model's channel count could not run)."""

from __future__ import annotations

import warnings
from typing import Any

from ..core.shapes import Shape, ShapeBuckets


class ShapeKeys:
    """The buckets and shapes met of one run. ``plan_for``: ``"shape"`` or ``"largest"`` (the largest met of its
    structure); ``max_shape``: the rounding limit; ``per_octave``: buckets per doubling (0: every shape its own)."""

    def __init__(self, plan_for: str = "shape", max_shape: Shape | None = None, per_octave: int = 16):
        self.plan_for, self.max_shape = plan_for, max_shape
        self.buckets = ShapeBuckets(per_octave, max_shape)
        self.largest: dict[tuple, Shape] = {}  # plan_for="largest": the largest shape met of each structure
        self._first_of: dict[tuple, Shape] = {}  # each structure's first shape: the sizes that vary from it
        self._varying: dict[tuple, set[tuple[str, int]]] = {}  # are rounded to buckets, the others not

    def meet(self, shape: Shape, channel: Any = None) -> Shape:
        """Remember a batch of ``shape``; return the shape every rank plans (the largest of the ranks')."""
        if channel is not None and channel.distributed:
            shape = self._largest_of_ranks(shape, channel)
        first = self._first_of.setdefault(shape.structure, shape)
        varying = self._varying.setdefault(shape.structure, set())
        for (path, sizes), (_, before) in zip(shape.layout, first.layout):
            varying.update((path, axis) for axis, (now, then) in enumerate(zip(sizes, before)) if now != then)
        if self.plan_for == "largest":
            self.largest[shape.structure] = self.planned(shape)
        return shape

    def planned(self, shape: Shape) -> Shape:
        """The shape a batch is planned at before rounding: itself, or united with the largest met (``"largest"``)."""
        if self.plan_for != "largest":
            return shape
        largest = self.largest.get(shape.structure)
        shape = shape if largest is None else largest.union(shape)
        cap = self.max_shape
        if cap is not None and cap.comparable(shape):
            return cap.union(shape)
        if cap is not None and not cap.layout:  # declared as (batch size, sequence length): every layout's bound
            return Shape(max(cap.batch_size, shape.batch_size), max(cap.seq_len, shape.seq_len), shape.layout)
        return shape

    def bucket(self, shape: Shape) -> Shape:
        """``shape`` rounded up: batch size, sequence length and the layout sizes that have varied."""
        return self.buckets.up(shape, self._varying.get(shape.structure, ()))

    @staticmethod
    def _largest_of_ranks(shape: Shape, channel: Any) -> Shape:
        """The largest batch of any rank, so all run one plan; a layout rank 0's cannot cover is warned about."""
        b, s = int(channel.max(shape.batch_size)), int(channel.max(shape.seq_len))
        layouts = [Shape(b, s, layout) for layout in channel.gather(shape.layout)]
        ours = layouts[0]
        for other in layouts[1:]:
            if ours.comparable(other):
                ours = ours.union(other)
            else:
                warnings.warn(f"lightning-remat: the ranks' batches have other layouts ({ours} and {other}); every "
                              "rank runs the plan for rank 0's.", UserWarning, stacklevel=5)
        return ours
