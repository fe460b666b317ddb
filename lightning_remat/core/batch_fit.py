"""The batch-size fit: every term is ``a + b * batch`` (activations grow, static memory does not). ``ProfileFit``
fits it through profiles at two batch sizes, ``ForwardFit`` for a loop that does not train; ``largest_batch``
searches it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from .config import check_int
from .memory_model import Profile
from .profile_algebra import Growth, Term, check_same_stages, combine

SEARCH_MODES = ("binsearch", "power")
DEFAULT_MAX_BATCH_SIZE = 8192  # Lightning's BatchSizeFinder max_val
# Far beyond any real search, so that a typo fails at once.
MAX_BATCH_SIZE = 2**24
MAX_TRIAL_STEPS = 1_000
MAX_TRIALS = 10_000


class BatchLine:
    """Every term at ``batch_size``: the line through two values, or one value scaled beyond its static part."""

    def __init__(self, batch_sizes: Sequence[int], batch_size: int, static_bytes: int):
        self.batch_sizes = tuple(batch_sizes)
        self.batch_size = batch_size
        self.static_bytes = static_bytes

    def __call__(self, term: Term, values: Sequence[float | None]) -> float:
        kind = term.quantity
        if kind.growth is Growth.STATIC:
            return values[0]
        if len(values) == 2 and None not in values:  # two batch sizes (ProfileFit keeps one of equal ones)
            (low, high), (low_bs, high_bs) = values, self.batch_sizes
            return kind.coerce(low + (high - low) * (self.batch_size - low_bs) / (high_bs - low_bs))
        (bs, value), = [(bs, v) for bs, v in zip(self.batch_sizes, values) if v is not None]
        # Proportional beyond the part that does not grow.
        offset = self.static_bytes if kind.growth is Growth.PEAK else 0.0
        return kind.coerce(offset + (value - offset) * self.batch_size / bs)


class ProfileFit:
    """Profiles measured at one or two batch sizes, extended to any batch size (options only one has are dropped)."""

    def __init__(self, profiles: Sequence[tuple[int, Profile]]):
        if not 1 <= len(profiles) <= 2:
            raise ValueError(f"ProfileFit takes one or two (batch size, profile) pairs, got {len(profiles)}")
        ordered: dict[int, Profile] = {}
        for batch_size, profile in sorted(profiles, key=lambda item: item[0]):
            ordered.setdefault(batch_size, profile)  # of two equal batch sizes, the first
        check_same_stages(ordered)
        self.batch_sizes = tuple(ordered)
        self.profiles = tuple(ordered.values())

    @property
    def static_bytes(self) -> int:
        return self.profiles[-1].static_bytes

    def at(self, batch_size: int) -> Profile:
        profile = combine(self.profiles, BatchLine(self.batch_sizes, batch_size, self.profiles[0].static_bytes))
        return replace(profile, notes=tuple(dict.fromkeys(note for p in self.profiles for note in p.notes)))


def largest_batch(fits: Callable[[int], bool], start: int, high_limit: int, mode: str) -> int:
    """Largest batch in [1, high_limit] with ``fits`` (assumed monotone), 0 when even 1 does not fit: doubling
    from ``start``, then bisection (``"binsearch"``), or the largest ``start * 2**k`` (``"power"``).
    """
    if high_limit < 1:
        return 0
    size = min(start, high_limit)
    if not fits(size):
        # Halve down to a size that fits, then (binsearch) bisect up to the failure.
        failed = size
        while size > 1:
            size //= 2
            if fits(size):
                break
        else:
            if not fits(1):
                return 0
            size = 1
        if mode == "power":
            return size
        low, high = size, failed
    else:
        low = size
        while True:
            if mode == "power" and low * 2 > high_limit:
                return low  # only start * 2**k: never the limit itself
            nxt = min(low * 2, high_limit)
            if nxt == low:
                return low
            if not fits(nxt):
                high = nxt
                break
            low = nxt
        if mode == "power":
            return low
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


def validate_search(max_overhead: float, margin: float, steps_per_trial: int, init_val: int, max_val: int,
              mode: str, max_trials: int) -> None:
    if not isinstance(max_overhead, (int, float)) or isinstance(max_overhead, bool) or not max_overhead >= 0:
        raise ValueError(f"max_overhead must be a number >= 0 (a share of the step's cost, 0.35 = 35%), got {max_overhead!r}")
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1) (the share the found batch size is reduced by), got {margin!r}")
    for name, value, high in (("steps_per_trial", steps_per_trial, MAX_TRIAL_STEPS), ("init_val", init_val, MAX_BATCH_SIZE),
                              ("max_val", max_val, MAX_BATCH_SIZE), ("max_trials", max_trials, MAX_TRIALS)):
        check_int(name, value, 1, high)
    if init_val > max_val:
        raise ValueError(f"init_val ({init_val}) must not exceed max_val ({max_val})")
    if mode not in SEARCH_MODES:
        raise ValueError(f"mode must be one of {SEARCH_MODES}, got {mode!r}")


@dataclass(frozen=True)
class ForwardFit:
    """Working memory of a forward without gradients above what is alive at its start, linear in the batch.

    Example:
        >>> fit = ForwardFit.through([(1, 1_300), (2, 2_300)])
        >>> fit.peak_at(8, alive_bytes=10_000), fit.largest_batch(budget_bytes=15_000, alive_bytes=10_000)
        (18300, 4)
    """

    base_bytes: float
    per_sample_bytes: float

    @classmethod
    def through(cls, points: Sequence[tuple[int, int]]) -> "ForwardFit":
        """The line through one or two ``(batch size, bytes)`` points (one: through zero); falling taken as flat."""
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
