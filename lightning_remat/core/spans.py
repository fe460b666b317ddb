"""Multi-stage segments: consecutive stages recomputed as ONE checkpoint (Chen et al.'s sqrt(n) plans).

A *span* ``(first, last)``'s figures derive exactly from the per-stage terms (docs/segments.md): the last
stage's ``"whole"`` stored bytes, a local peak of ``max_k (keep stored of first..k-1 + keep local peak of k)``,
the sum of the ``"whole"`` costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from .memory_model import PeakTerm, Profile, binding_term, peak_terms
from .vocabulary import OPTION_NAMES, OptionKind, cost_of


@dataclass(frozen=True)
class SpanOption:
    """Stages ``first..last`` (inclusive, in the profile's order) recomputed as one segment."""

    first: int
    last: int
    names: tuple[str, ...]
    stored_bytes: int
    local_peak_bytes: int
    cost_seconds: float
    cost_flops: int
    cost_roofline: float = 0.0

    def cost(self, kind: str) -> float:
        return cost_of(kind, self.cost_seconds, self.cost_flops, self.cost_roofline)


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
    return next((o for o in profile.stages[i].options if o.name == OPTION_NAMES[OptionKind.WHOLE]), None)


def _last_term(profile: Profile, k: int, held: int) -> int:
    # The span's last stage runs as it does recomputed alone (its "whole" local peak); the others hold keep bytes.
    return _whole(profile, k).local_peak_bytes + held


def _recompute_end(gap_peak: int, held: int, output: int) -> int:
    # After recomputing its last stage, before that stage's backward: a "whole" run reaches the same
    # moment in the gap after it (whose prefix holds the original output); the span adds ``held``.
    return gap_peak + held + output


def span_option(profile: Profile, first: int, last: int) -> SpanOption:
    """The figures of stages ``first..last`` recomputed as one segment (see the module docstring)."""
    if not 0 <= first < last < len(profile.stages):
        raise ValueError(f"a span needs 0 <= first < last < {len(profile.stages)}, got {first}..{last}")
    wholes = [_whole(profile, k) for k in range(first, last + 1)]
    if any(w is None for w in wholes):
        raise ValueError(f"stages {first}..{last} do not all have a 'whole' option")
    inner: dict[int, int] = {}
    for seg in profile.segments:
        if first < seg.stages_alive <= last + 1:
            inner[seg.stages_alive] = max(inner.get(seg.stages_alive, seg.peak_bytes), seg.peak_bytes)
    local = 0
    held = 0  # "keep" stored bytes of the stages of the span recomputed so far
    for k in range(first, last + 1):
        keep = profile.stages[k].options[0]
        if k in inner:
            local = max(local, inner[k] + held)
        local = max(local, _last_term(profile, k, held) if k == last else keep.local_peak_bytes + held)
        if k == last and last + 1 in inner:
            local = max(local, _recompute_end(inner[last + 1], held, wholes[-1].stored_bytes))
        held += keep.stored_bytes
    return SpanOption(first, last, tuple(s.name for s in profile.stages[first:last + 1]),
                      stored_bytes=wholes[-1].stored_bytes, local_peak_bytes=local,
                      cost_seconds=float(sum(w.cost_seconds for w in wholes)),
                      cost_flops=int(sum(w.cost_flops for w in wholes)),
                      cost_roofline=float(sum(w.cost_roofline for w in wholes)))


def all_spans(profile: Profile, max_length: int | None = None) -> list[SpanOption]:
    """Every span the solver considers: 2 to ``max_length`` stages of one group, and each block's range."""
    names = [s.name for s in profile.stages]
    return [SpanOption(first, last, tuple(names[first:last + 1]), stored, local, seconds, flops, roofline)
            for first, last, stored, local, seconds, flops, roofline in span_rows(profile, max_length)]


def span_rows(profile: Profile, max_length: int | None = None) -> Iterator[tuple[int, int, int, int, float, int, float]]:
    """``all_spans`` as tuples (first, last, stored, local, seconds, flops, roofline), built incrementally."""
    seen = set()
    for row in _group_rows(profile, max_length):
        seen.add(row[:2])
        yield row
    wholes = [_whole(profile, k) for k in range(len(profile.stages))]
    for first, last, _ in block_ranges(profile):
        if (first, last) not in seen and all(w is not None for w in wholes[first:last + 1]):
            seen.add((first, last))
            s = span_option(profile, first, last)
            yield first, last, s.stored_bytes, s.local_peak_bytes, s.cost_seconds, s.cost_flops, s.cost_roofline


def _group_rows(profile: Profile, max_length: int | None) -> Iterator[tuple[int, int, int, int, float, int, float]]:
    limit = max_span_length(len(profile.stages)) if max_length is None else max_length
    wholes = [_whole(profile, k) for k in range(len(profile.stages))]
    inner: dict[int, int] = {}
    for seg in profile.segments:
        inner[seg.stages_alive] = max(inner.get(seg.stages_alive, seg.peak_bytes), seg.peak_bytes)
    for start, end in span_ranges(profile):
        for first in range(start, end):
            if wholes[first] is None:
                continue
            keep = profile.stages[first].options[0]
            local, held = keep.local_peak_bytes, keep.stored_bytes
            seconds, flops = wholes[first].cost_seconds, wholes[first].cost_flops
            roofline = wholes[first].cost_roofline
            for last in range(first + 1, min(end, first + limit)):
                if wholes[last] is None:
                    break
                keep = profile.stages[last].options[0]
                if last in inner:
                    local = max(local, inner[last] + held)
                # "local": the max over the stages so far as kept; the last one's term apart (it runs recomputed alone).
                last_term = _last_term(profile, last, held)
                if last + 1 in inner:
                    last_term = max(last_term, _recompute_end(inner[last + 1], held, wholes[last].stored_bytes))
                span_local = max(local, last_term)
                # As an inner stage of a longer span, "last" is held like a kept stage.
                local = max(local, keep.local_peak_bytes + held)
                held += keep.stored_bytes
                seconds += wholes[last].cost_seconds
                flops += wholes[last].cost_flops
                roofline += wholes[last].cost_roofline
                yield first, last, wholes[last].stored_bytes, span_local, float(seconds), int(flops), float(roofline)


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
    total = sum(span_option(profile, a, b).cost(kind) for a, b in spans)
    return total + sum(s.options[c].cost(kind) for k, (s, c) in enumerate(zip(profile.stages, choices)) if k not in inside)
