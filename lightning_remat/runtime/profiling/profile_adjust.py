"""Adjustments to a measured profile for what the profile could not see; each says so in the profile's notes."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Sequence

from torch import nn

from ...core.actions import moved
from ...core.memory_model import Profile


def with_always_alive(profile: Profile, nbytes: int, note: str) -> Profile:
    """``nbytes`` more in every term of the model: memory alive through the whole step."""
    if nbytes <= 0:
        return profile
    stages = tuple(replace(s, options=tuple(replace(o, local_peak_bytes=o.local_peak_bytes + nbytes)
                                            for o in s.options)) for s in profile.stages)
    segments = tuple(replace(seg, peak_bytes=seg.peak_bytes + nbytes) for seg in profile.segments)
    return replace(profile, stages=stages, segments=segments, notes=(*profile.notes, note)).with_baseline()


def with_unobserved(profile: Profile, stage_names: Sequence[str], modules: dict[str, nn.Module]) -> Profile:
    """Stages that did not run on the profiled batch (layer drop) put into the chain with a similar stage's figures."""
    observed = {s.name: s for s in profile.stages}
    missing = [n for n in stage_names if n not in observed]
    if not missing:
        return profile
    stages = list(profile.stages)
    origin = list(range(len(stages)))  # each place's index in ``profile`` (-1: a stage put in)
    positions = {s.name: i for i, s in enumerate(stages)}
    for name in missing:
        twin = next((s for s in profile.stages if s.module_type == type(modules[name]).__name__),
                    max(profile.stages, key=lambda s: s.options[0].stored_bytes))
        same_class = twin.module_type == type(modules[name]).__name__
        options = tuple(replace(o, action=moved(o.action, twin.name, name))
                        for o in twin.options if same_class or o.name in ("keep", "whole"))
        before = [n for n in stage_names[:stage_names.index(name)] if n in positions]
        at = positions[before[-1]] + 1 if before else 0
        stages.insert(at, replace(twin, name=name, options=options, module_type=type(modules[name]).__name__, call=0))
        origin.insert(at, -1)
        positions = {s.name: i for i, s in enumerate(stages)}
    first_observed = [origin.index(k) for k in range(len(profile.stages))]

    def alive(k: int) -> int:
        return 0 if k == 0 else (first_observed[k] if k < len(first_observed) else len(stages))

    segments = tuple(replace(seg, stages_alive=alive(seg.stages_alive)) for seg in profile.segments)
    note = (f"{len(missing)} stage(s) did not run on the profiled batch ({', '.join(missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''}): each is planned as if it ran, with the figures of a stage that did")
    return replace(profile, stages=tuple(stages), segments=segments, notes=(*profile.notes, note)).with_baseline()


def with_pooled_timings(profile: Profile) -> Profile:
    """Identical stages (one class, the same FLOPs and roofline) share the median of their seconds, against noise.

    Example:
        >>> from lightning_remat.core.actions import StageAction
        >>> from lightning_remat.core.memory_model import Costs, Profile, Segment, StageOption, StageProfile
        >>> def stage(name, seconds):
        ...     options = (StageOption("keep", StageAction(name), 100, 150),
        ...                StageOption("whole", StageAction.recompute(name), 10, 150, Costs(seconds, 7)))
        ...     return StageProfile(name, options, forward_seconds=seconds, forward_flops=7, module_type="Block")
        >>> p = Profile(tuple(stage(n, s) for n, s in [("a", 1.0), ("b", 3.0), ("c", 2.5)]), (Segment("head", 3, 50),))
        >>> [s.option("whole").costs.time for s in with_pooled_timings(p).stages]
        [2.5, 2.5, 2.5]
    """
    groups: dict[tuple, list[int]] = {}
    for i, stage in enumerate(profile.stages):
        key = (stage.module_type, stage.forward_flops,
               tuple((o.name, o.costs.flops, o.costs.roofline) for o in stage.options))
        groups.setdefault(key, []).append(i)
    stages = list(profile.stages)
    for members in groups.values():
        if len(members) < 2:
            continue
        forward = statistics.median(stages[i].forward_seconds for i in members)
        seconds = [statistics.median(stages[i].options[j].costs.time for i in members)
                   for j in range(len(stages[members[0]].options))]
        for i in members:
            options = tuple(replace(o, costs=replace(o.costs, time=t)) for o, t in zip(stages[i].options, seconds))
            stages[i] = replace(stages[i], forward_seconds=forward, options=options)
    return replace(profile, stages=tuple(stages))
