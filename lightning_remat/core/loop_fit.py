"""The peak of a loop that does not train (validation, test) as a line in its batch size."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ForwardFit:
    """Working memory of a forward without gradients above what is alive at its start:
    ``base_bytes + per_sample_bytes * batch``.

    Example:
        >>> fit = ForwardFit.through([(1, 1_300), (2, 2_300)])
        >>> fit.peak_at(8, alive_bytes=10_000), fit.largest_batch(budget_bytes=15_000, alive_bytes=10_000)
        (18300, 4)
    """

    base_bytes: float
    per_sample_bytes: float

    @classmethod
    def through(cls, points: Sequence[tuple[int, int]]) -> "ForwardFit":
        """The line through one or two ``(batch size, working bytes)`` points (one: through zero); a falling line is
        taken as flat at its larger point.
        """
        ordered = sorted(points)
        if not 1 <= len(ordered) <= 2 or ordered[0][0] < 1:
            raise ValueError(f"ForwardFit takes one or two (batch size >= 1, bytes) points, got {points!r}")
        if len(ordered) == 1 or ordered[0][0] == ordered[1][0]:
            batch, working = ordered[-1]
            return cls(0.0, max(0.0, working / batch))
        (b1, w1), (b2, w2) = ordered
        slope = (w2 - w1) / (b2 - b1)
        if slope < 0:
            return cls(float(max(w1, w2)), 0.0)
        base = w1 - slope * b1
        if base < 0:  # through zero at the larger point: the smaller is then over-estimated
            return cls(0.0, w2 / b2)
        return cls(float(base), float(slope))

    def peak_at(self, batch_size: int, alive_bytes: int) -> int:
        """The peak of a batch of ``batch_size`` with ``alive_bytes`` alive when it starts."""
        return int(math.ceil(alive_bytes + self.base_bytes + self.per_sample_bytes * batch_size))

    def largest_batch(self, budget_bytes: int, alive_bytes: int) -> int:
        """The largest batch whose predicted peak is within the budget (0: not even one sample)."""
        room = budget_bytes - alive_bytes - self.base_bytes
        if room < self.per_sample_bytes:
            return 0
        if self.per_sample_bytes <= 0:
            return 2**31 - 1
        batch = int(room // self.per_sample_bytes)
        while batch > 0 and self.peak_at(batch, alive_bytes) > budget_bytes:  # rounding at the boundary
            batch -= 1
        return batch
