"""Multi-stage segments: consecutive stages recomputed as ONE checkpoint (Chen et al.'s sqrt(n) plans).

A *span* ``(first, last)``'s figures derive exactly from the per-stage terms (docs/segments.md): the last
stage's ``"whole"`` stored bytes, a local peak of ``max_k (keep stored of first..k-1 + keep local peak of k)``,
the sum of the ``"whole"`` costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from .memory_model import Costs, PeakTerm, Profile, binding_term, peak_terms, segment_peaks


@dataclass(frozen=True)
class SpanOption:
    """Stages ``first..last`` (inclusive, in the profile's order) recomputed as one segment."""

    first: int
    last: int
    names: tuple[str, ...]
    stored_bytes: int
    local_peak_bytes: int
    costs: Costs


def max_span_length(n_stages: int) -> int:
    """The longest span the solver considers: ``2 * ceil(sqrt(n))`` stages (at least 2): memory-optimal chain
    plans use segments of about sqrt(n), twice that allows uneven stages at O(sqrt(n)) transitions per stage.
    """
    return max(2, 2 * math.ceil(math.sqrt(max(1, n_stages))))


def span_ranges(profile: Profile) -> list[tuple[int, int]]:
    """Index ranges ``(start, end)`` (end exclusive) of the span groups, split where they are not contiguous."""
    position = {s.name: i for i, s in enumerate(profile.stages)}
    ranges = []
    for group in profile.span_groups:
        indices = [position[n] for n in group if n in position]
        start = 0
        for k in range(1, len(indices) + 1):
            if k == len(indices) or indices[k] != indices[k - 1] + 1:
                if k - start >= 2:
                    ranges.append((indices[start], indices[k - 1] + 1))
                start = k
    return sorted(ranges)


def block_ranges(profile: Profile) -> list[tuple[int, int, str]]:
    """``(first, last, module)`` of each of ``Profile.blocks`` whose two or more stages are contiguous, in order."""
    position = {s.name: i for i, s in enumerate(profile.stages)}
    found = []
    for module, names in profile.blocks:
        indices = [position.get(n, -1) for n in names]
        if len(indices) >= 2 and indices[0] >= 0 and indices == list(range(indices[0], indices[0] + len(indices))):
            found.append((indices[0], indices[-1], module))
    return sorted(found)


def _whole(profile: Profile, i: int):
    return next((o for o in profile.stages[i].options if o.name == "whole"), None)


Row = tuple[int, int, int, int, Costs]  # first, last, stored, local, costs


def _rows_from(profile: Profile, first: int, end: int, wholes: list, inner: dict[int, int]) -> Iterator[Row]:
    """The spans ``first..last`` for each ``last`` before ``end``, built incrementally (the module docstring)."""
    keep = profile.stages[first].options[0]
    local, held = keep.local_peak_bytes, keep.stored_bytes
    costs = wholes[first].costs
    for last in range(first + 1, end):
        if wholes[last] is None:
            break
        keep = profile.stages[last].options[0]
        if last in inner:
            local = max(local, inner[last] + held)
        # "local": the max over the stages so far as kept; the last one runs as it does recomputed alone.
        last_term = wholes[last].local_peak_bytes + held
        if last + 1 in inner:
            # After recomputing the last stage, before its backward: a "whole" run reaches the same moment
            # in the gap after it (whose prefix holds the original output); the span adds ``held``.
            last_term = max(last_term, inner[last + 1] + held + wholes[last].stored_bytes)
        span_local = max(local, last_term)
        # As an inner stage of a longer span, "last" is held like a kept stage.
        local = max(local, keep.local_peak_bytes + held)
        held += keep.stored_bytes
        costs += wholes[last].costs
        yield first, last, wholes[last].stored_bytes, span_local, costs


def span_option(profile: Profile, first: int, last: int) -> SpanOption:
    """The figures of stages ``first..last`` recomputed as one segment (see the module docstring)."""
    if not 0 <= first < last < len(profile.stages):
        raise ValueError(f"a span needs 0 <= first < last < {len(profile.stages)}, got {first}..{last}")
    wholes = [_whole(profile, k) for k in range(len(profile.stages))]
    if any(w is None for w in wholes[first:last + 1]):
        raise ValueError(f"stages {first}..{last} do not all have a 'whole' option")
    *_, row = _rows_from(profile, first, last + 1, wholes, segment_peaks(profile))
    return SpanOption(first, last, tuple(s.name for s in profile.stages[first:last + 1]), *row[2:])


def span_rows(profile: Profile) -> Iterator[Row]:
    """Every span the solver considers as a ``Row``: 2 to ``max_span_length`` stages of one group, and each block's
    range."""
    limit = max_span_length(len(profile.stages))
    wholes = [_whole(profile, k) for k in range(len(profile.stages))]
    inner = segment_peaks(profile)
    seen = set()
    for start, end in span_ranges(profile):
        for first in range(start, end):
            if wholes[first] is None:
                continue
            for row in _rows_from(profile, first, min(end, first + limit), wholes, inner):
                seen.add(row[:2])
                yield row
    for first, last, _ in block_ranges(profile):
        if (first, last) not in seen and all(w is not None for w in wholes[first:last + 1]):
            seen.add((first, last))
            *_, row = _rows_from(profile, first, last + 1, wholes, inner)
            yield row


def _check_spans(n: int, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    ordered = sorted((int(a), int(b)) for a, b in spans)
    end = -1
    for first, last in ordered:
        if not 0 <= first < last < n or first <= end:
            raise ValueError(f"spans {ordered} must be disjoint ranges first < last within 0..{n - 1}")
        end = last
    return ordered


def predict_peak_spans(profile: Profile, choices: Sequence[int], spans: Sequence[tuple[int, int]] = ()) -> int:
    """``predict_peak`` where each span ``(first, last)`` is recomputed as one segment (choices inside it ignored)."""
    term = binding_term(peak_terms_spans(profile, choices, spans))
    return 0 if term is None else term.bytes


def peak_terms_spans(profile: Profile, choices: Sequence[int], spans: Sequence[tuple[int, int]] = ()) -> list[PeakTerm]:
    """Every term of ``predict_peak_spans``: stages and spans in order, then the segments not inside a span."""
    spans = _check_spans(len(profile.stages), spans)
    if not spans:
        return peak_terms(profile, choices)
    if len(choices) != len(profile.stages):
        raise ValueError(f"{len(choices)} choices for {len(profile.stages)} stages")
    starting = {first: last for first, last in spans}
    inside: set[int] = set()
    prefix = {0: 0}
    terms: list[PeakTerm] = []
    stored, i = 0, 0
    while i < len(profile.stages):
        if i in starting:
            span = span_option(profile, i, starting[i])
            terms.append(PeakTerm("span", i, f"{span.names[0]}..{span.names[-1]}", span.local_peak_bytes, stored))
            stored += span.stored_bytes
            inside.update(range(i + 1, span.last + 1))
            i = span.last + 1
        else:
            option = profile.stages[i].options[choices[i]]
            terms.append(PeakTerm("stage", i, profile.stages[i].name, option.local_peak_bytes, stored))
            stored += option.stored_bytes
            i += 1
        prefix[i] = stored
    terms.extend(PeakTerm("segment", k, segment.name, segment.peak_bytes, prefix[segment.stages_alive])
                 for k, segment in enumerate(profile.segments) if segment.stages_alive not in inside)
    return terms


def plan_cost_spans(profile: Profile, choices: Sequence[int], kind: str, spans: Sequence[tuple[int, int]] = ()) -> float:
    """Total recompute cost of ``choices`` with ``spans`` (stages inside a span priced by the span)."""
    spans = _check_spans(len(profile.stages), spans)
    inside = {k for first, last in spans for k in range(first, last + 1)}
    total = sum(span_option(profile, a, b).costs[kind] for a, b in spans)
    return total + sum(s.options[c].costs[kind] for k, (s, c) in enumerate(zip(profile.stages, choices)) if k not in inside)
