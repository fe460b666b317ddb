"""Inputs several recomputed stages hold (``position_ids``): the additive model counts them in every holder,
``exact_peak`` once; ``slack`` bounds the over-count so the solver can search within budget plus slack."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from .memory_model import Profile, episode_starts
from .spans import predict_peak_spans


def has_shared(profile: Profile) -> bool:
    """Whether any option of ``profile`` holds an input other stages may hold too."""
    return any(o.shared_held for s in profile.stages for o in s.options)


def exact_peak(profile: Profile, choices: Sequence[int], spans: Sequence[tuple[int, int]] = ()) -> int:
    """The predicted peak of ``choices`` with each shared input counted once (with spans: the additive figure)."""
    additive = predict_peak_spans(profile, choices, spans)
    if spans or not has_shared(profile):
        return additive
    held: set[str] = set()
    held_after = [frozenset()]  # the labels held by the stages before each point
    prefix = [0]
    starts = episode_starts(profile)  # a fresh stage: nothing before it is alive (memory_model)
    peak = 0
    for i, (stage, choice) in enumerate(zip(profile.stages, choices)):
        option = stage.options[choice]
        held = set() if stage.fresh else held
        counted = sum(nbytes for label, nbytes in option.held_before if label in held)
        peak = max(peak, option.local_peak_bytes - counted + prefix[-1] - prefix[starts[i]])
        again = sum(nbytes for label, nbytes in option.shared_held if label in held)
        prefix.append(prefix[-1] + option.stored_bytes - again)
        held.update(label for label, _ in option.shared_held)
        held_after.append(frozenset(held))
    for segment in profile.segments:
        k = segment.stages_alive
        saving = segment.shared_saving if segment.shared_labels and set(segment.shared_labels) <= held_after[k] else 0
        peak = max(peak, segment.peak_bytes - saving + (prefix[k] - prefix[starts[k - 1]] if k else 0))
    return min(peak, additive)


def slack(profile: Profile) -> int:
    """An upper bound on how far ``predict_peak`` can be above ``exact_peak`` for any plan."""
    stored = sum(max((sum(b for _, b in o.shared_held) for o in s.options), default=0) for s in profile.stages)
    local = max((sum(b for _, b in o.held_before) for s in profile.stages for o in s.options), default=0)
    segment = max((seg.shared_saving for seg in profile.segments), default=0)
    return stored + max(local, segment)


def without_shared(profile: Profile) -> Profile:
    """``profile`` with every shared input counted in each holder (what the fits start from)."""
    if not has_shared(profile) and not any(seg.shared_saving for seg in profile.segments):
        return profile
    stages = tuple(replace(s, options=tuple(replace(o, shared_held=(), held_before=()) for o in s.options))
                   for s in profile.stages)
    segments = tuple(replace(seg, shared_saving=0, shared_labels=()) for seg in profile.segments)
    # Each gap's figure per run (which the depth fit reads) is the additive model's: kept.
    return replace(profile, stages=stages, segments=segments).with_gap_figures(profile.gap_figures)
