"""Shrinking a failing case to a smaller one that still breaks the same invariant.

Hypothesis draws the cases; a case costs whole training runs (5-20 CPU-seconds), so its generic
shrinker, which starts over from a new random case and tries many candidates, finds little in a few
minutes. This one starts from the failing case itself and knows its structure, each candidate run
once (``evaluate`` memoizes), each kept only if the invariant still breaks (with ``later``, at a step
after the first: a first step over the budget is one defect, a later step over it another, and the
first would otherwise stand in for every other once the steps before are dropped):

1. cut the steps after the first that breaks it (what follows cannot matter);
2. drop each earlier step, first to last (the shapes that do not matter);
3. the budget not snapped, half-way between the least and the plain peak, seed 0, the integration's
   first variant.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from .harness import Case, Outcome
from .runners import VARIANTS


def first_breaking_step(outcome: Outcome, invariant: str, later: bool = False) -> int | None:
    """The index in ``outcome.case.shapes`` of the last batch of the first step that breaks
    ``invariant`` (with ``later``: the first after step 0)."""
    steps = [v.step for v in outcome.violations if v.invariant == invariant and v.step is not None
             and (v.step > 0 or not later)]
    if not steps or outcome.reference is None or not outcome.reference.steps:
        return None
    per_step = max(1, len(outcome.case.shapes) // len(outcome.reference.steps))  # micro-batches per step
    return min(len(outcome.case.shapes) - 1, (min(steps) + 1) * per_step - 1)


def breaks_later(outcome: Outcome, invariant: str) -> bool:
    """Whether ``invariant`` breaks at a step after the first (a defect of following shapes or plans,
    not of the first step's planning)."""
    return any(v.invariant == invariant and v.step for v in outcome.violations)


def shrink_case(case: Case, invariant: str, evaluate: Callable[[Case], Outcome], seconds: float,
                later: bool = False) -> Case:
    """A case no larger than ``case`` that still breaks ``invariant`` (with ``later``: at a step
    after the first, so that a first-step failure does not stand in for another) (``case`` itself
    when nothing smaller does, or time runs out)."""
    deadline = time.monotonic() + seconds
    best = case

    def keep(candidate: Case) -> bool:
        nonlocal best
        if candidate == best or not candidate.shapes or time.monotonic() > deadline:
            return False
        outcome = evaluate(candidate)
        if invariant not in outcome.broken or (later and not breaks_later(outcome, invariant)):
            return False
        best = candidate
        return True

    last = first_breaking_step(evaluate(best), invariant, later)
    if last is not None:
        keep(replace(best, shapes=best.shapes[: last + 1]))
    i = 0
    while i < len(best.shapes) - 1 and time.monotonic() < deadline:
        if not keep(replace(best, shapes=best.shapes[:i] + best.shapes[i + 1:])):
            i += 1
    for change in (dict(snap=False), dict(fraction=0.5), dict(seed=0), dict(variant=VARIANTS[case.integration][0])):
        keep(replace(best, **change))
    return best
