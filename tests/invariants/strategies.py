"""Hypothesis strategies for the harness's cases, and its settings profiles.

A case draws a small pool of distinct batch shapes (2-4), each a *move* from the one before (a
longer sequence, a taller image, a dict key that appears, a smaller batch, ...), a sequence of 6-12
steps that uses every shape of the pool (in the pool's order first: so a new shape always comes
after a planned one), a budget fraction (0 is the least peak, 1 the plain peak), whether the budget
is snapped down to the predicted peak of the plan made for it (no slack: a plan predicted low breaks
it), a seed and the integration's variant. Every choice is
``sampled_from`` a list whose first value is an ordinary one: Hypothesis's first example (the CI's)
and the shrinks of a failure are the issue's first row (a shape, one a little larger, back: 8x32 ->
8x34 -> 8x32) at a budget half-way between the least and the plain peak, not degenerate ones
(1 x 1 batches, a budget on the least peak).

Profiles (``settings``, no example database, no deadline: a case runs whole training runs):

- ``CI``: derandomized, one example, no shrinking (what ``tests/test_invariants.py`` runs: the run
  must stay bounded, and a known failure there is marked ``xfail``);
- ``long(examples)``: for ``benchmarks/fuzz.py`` (seeded there), which shrinks failures with
  ``shrink.shrink_case``: a case costs whole training runs, and Hypothesis's shrinker, made for cheap
  tests, found nothing smaller in 5 minutes where ``shrink_case`` needs 3-12 runs.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from .harness import Case, integrations_for
from .runners import VARIANTS
from .zoo import ZOO

SIZES = [4, 2, 3, 1]
LENGTHS = [32, 24, 40, 16, 48, 12, 20, 8]
IMAGE_SIDES = [16, 12, 24, 8, 32, 20]
FRACTIONS = [0.5, 0.3, 0.7, 0.15, 0.85, 0.05, 0.95, 0.0, 1.0, 0.4, 0.6, 0.2, 0.8]
# How a shape of the pool follows the one before it. The first move is the first row: a shape a
# little larger in the dimension that matters (8x32 -> 8x34; an image 8 pixels taller and wider; a
# dict batch whose ``extra`` key appears).
SEQUENCE_MOVES = [(0, 2), (0, -8), (-1, 0), (0, 16), (1, 0), (0, -4), (0, 8), (-2, 8), (0, 1)]
IMAGE_MOVES = [(0, 8, 8), (0, -4, -4), (0, 8, 0), (0, 0, 8), (-1, 0, 0), (0, 16, 16), (1, -4, 0)]
DICT_MOVES = ["extra", "seq+2", "mask", "no extra", "seq-8", "batch-1", "extra+8", "seq+16"]
BOUNDS = {"batch": (1, 4), "sequence": (8, 56), "side": (8, 40)}

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
if hasattr(HealthCheck, "differing_executors"):
    _QUIET.append(HealthCheck.differing_executors)

CI = settings(max_examples=1, deadline=None, database=None, derandomize=True, print_blob=False,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=_QUIET)


def long(examples: int) -> settings:
    """The long run's settings: ``examples`` cases per (model, integration), not derandomized (pass
    ``hypothesis.seed``); failures are shrunk by ``shrink.shrink_case``, not by Hypothesis."""
    return settings(max_examples=examples, deadline=None, database=None, derandomize=False, print_blob=False,
                    phases=(Phase.explicit, Phase.generate), suppress_health_check=_QUIET)


def _clamp(value: int, bounds: str) -> int:
    low, high = BOUNDS[bounds]
    return max(low, min(high, value))


def first_shape(model: str) -> st.SearchStrategy[tuple[int, ...]]:
    """The pool's first shape (``zoo.ModelSpec.fields``)."""
    size, length, side = st.sampled_from(SIZES), st.sampled_from(LENGTHS), st.sampled_from(IMAGE_SIDES)
    if model == "cnn":
        return st.tuples(size, side, side)
    if model == "dict":
        return st.tuples(size, length, st.sampled_from([0, 16, 8]), st.sampled_from([0, 1]))
    return st.tuples(size, length)


def moved(model: str, shape: tuple[int, ...], move: Any) -> tuple[int, ...]:
    """``shape`` after ``move`` (one of the model's moves), within ``BOUNDS``."""
    if model == "cnn":
        return tuple(_clamp(v + d, k) for v, d, k in zip(shape, move, ("batch", "side", "side")))
    if model != "dict":
        return (_clamp(shape[0] + move[0], "batch"), _clamp(shape[1] + move[1], "sequence"))
    b, s, prefix, mask = shape
    changes = {"extra": (b, s, prefix or 16, mask), "extra+8": (b, s, prefix + 8, mask), "no extra": (b, s, 0, mask),
               "mask": (b, s, prefix, 1 - mask), "seq+2": (b, s + 2, prefix, mask), "seq-8": (b, s - 8, prefix, mask),
               "seq+16": (b, s + 16, prefix, mask), "batch-1": (b - 1, s, prefix, mask)}
    b, s, prefix, mask = changes[move]
    return (_clamp(b, "batch"), _clamp(s, "sequence"), prefix, mask)


def moves_of(model: str) -> st.SearchStrategy[Any]:
    return st.sampled_from({"cnn": IMAGE_MOVES, "dict": DICT_MOVES}.get(model, SEQUENCE_MOVES))


@st.composite
def shape_sequences(draw: Any, model: str, min_steps: int = 6, max_steps: int = 12, max_pool: int = 4,
                    min_pool: int = 2) -> tuple:
    """``min_steps..max_steps`` shapes: a pool of ``min_pool..max_pool`` distinct shapes, each a move
    from the one before, in order, then steps drawn from the pool."""
    pool = [draw(first_shape(model))]
    for move in draw(st.lists(moves_of(model), min_size=max(0, min_pool - 1), max_size=max_pool - 1)):
        shape = moved(model, pool[-1], move)
        if shape not in pool:
            pool.append(shape)
    rest = draw(st.lists(st.sampled_from(range(len(pool))), min_size=max(0, min_steps - len(pool)),
                         max_size=max(0, max_steps - len(pool))))
    return tuple(pool) + tuple(pool[i] for i in rest)


@st.composite
def cases(draw: Any, model: str | None = None, integration: str | None = None, min_steps: int = 6,
          max_steps: int = 12, max_pool: int = 4, min_pool: int = 2) -> Case:
    """A case: ``model`` and ``integration`` as given (else drawn), shapes, budget fraction, seed, variant."""
    model = model or draw(st.sampled_from(sorted(ZOO)))
    integration = integration or draw(st.sampled_from(integrations_for(model)))
    shapes = draw(shape_sequences(model, min_steps, max_steps, max_pool, min_pool))
    fraction = draw(st.sampled_from(FRACTIONS))
    seed = draw(st.sampled_from([0, 1, 2]))
    variant = draw(st.sampled_from(VARIANTS[integration]))
    snap = draw(st.sampled_from([False, True]))
    return Case(model, integration, shapes, fraction, seed, variant, snap)
