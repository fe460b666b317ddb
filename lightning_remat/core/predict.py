"""The one predictor: a plan's peak, recompute cost and host bytes, each action matched to the profile's option
that does it; ``actions_of`` goes the other way, from the solver's option indices and spans."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from .memory_model import PeakTerm, Profile, StageOption, binding_term
from .actions import StageAction
from .calls import check_tied, owners
from .shared_held import exact_peak
from .spans import block_ranges, peak_terms_spans, plan_cost_spans
from .vocabulary import Action, CostKind


@dataclass(frozen=True)
class Prediction:
    """``cost`` includes unhidden transfers; ``overhead`` is it over a plain step's (0.0 if unknown)."""

    peak_bytes: int
    cost: float
    overhead: float
    host_bytes: int
    binding: PeakTerm | None = field(default=None, repr=False, compare=False)


def installed(option: StageOption) -> StageAction:
    """The action ``option`` installs on its stage, an offload's limit (a figure: ``StageOption.offload_limit``) set."""
    if option.offload_limit and option.action.action is Action.OFFLOAD:
        return replace(option.action, offload_limit=option.offload_limit)
    return option.action


def schedule(profile: Profile, actions: Sequence[StageAction]) -> tuple[list[int], list[tuple[int, int]]]:
    """The option index of each stage (no action: kept) and the spans ``(first, last)`` for ``actions``."""
    names = [s.name for s in profile.stages]
    # A block recomputed whole (``Profile.blocks``) is one action naming the block: its stages' span.
    blocks = {module: (first, last) for first, last, module in block_ranges(profile)}
    whole_blocks = [a for a in actions if a.stage in blocks and a.stage not in names
                    and a.action is Action.RECOMPUTE and a.modules == (a.stage,) and a.policy is None]
    actions = [a for a in actions if not any(a is b for b in whole_blocks)]
    if [a.stage for a in actions] == names:
        positions = list(range(len(names)))
    else:
        position = {name: i for i, name in enumerate(names)}
        unknown = [a.stage for a in actions if a.stage not in position]
        if unknown:
            raise ValueError(f"the plan has actions for {unknown}, which are not stages of the profile")
        positions = [position[a.stage] for a in actions]
    owner = owners(profile)  # a module at several places (core.calls): its action is every place's
    choices = [0] * len(names)
    starts: dict[tuple[str, ...], list[int]] = {}
    for i, action in zip(positions, actions):
        if action.action is Action.SEGMENT:
            starts.setdefault(action.segment, []).append(i)
        else:
            for k in (k for k in range(len(names)) if owner[k] == owner[i]):
                stage = profile.stages[k]
                choices[k] = next((j for j, option in enumerate(stage.options) if installed(option) == action), -1)
                if choices[k] < 0:
                    raise ValueError(f"stage {stage.name!r} has no option for {action}; its options: "
                                     f"{[o.name for o in stage.options]}")
    spans = []
    for segment, indices in starts.items():
        indices = sorted(indices)
        if len(indices) != len(segment) or indices != list(range(indices[0], indices[0] + len(indices))) \
                or [names[i] for i in indices] != list(segment):
            raise ValueError(f"segment {list(segment)} is not a run of consecutive stages of the profile")
        spans.append((indices[0], indices[-1]))
    return choices, sorted([*spans, *(blocks[a.stage] for a in whole_blocks)])


def predict(profile: Profile, actions: Sequence[StageAction], cost: CostKind | str = CostKind.TIME) -> Prediction:
    """The peak, cost, overhead and host bytes of ``actions`` on ``profile`` under the memory model."""
    kind = CostKind.check(cost)
    choices, spans = schedule(profile, actions)
    inside = {k for first, last in spans for k in range(first, last + 1)}
    extra = plan_cost_spans(profile, choices, kind, spans)
    baseline = profile.baseline_costs[kind]
    host = sum(s.options[c].host_bytes for k, (s, c) in enumerate(zip(profile.stages, choices)) if k not in inside)
    # The peak counts a shared input once (core.shared_held); the binding term is read from the additive terms.
    term = binding_term(peak_terms_spans(profile, choices, spans))
    return Prediction(peak_bytes=int(exact_peak(profile, choices, spans)), cost=float(extra),
                      overhead=float(extra / baseline) if baseline else 0.0, host_bytes=int(host), binding=term)


def actions_of(profile: Profile, choices: Sequence[int], spans: Sequence[tuple[int, int]] = ()) -> tuple[StageAction, ...]:
    """One action per stage for option indices ``choices`` and ``spans``; a block's span is one action."""
    if len(choices) != len(profile.stages):
        raise ValueError(f"{len(choices)} choices for {len(profile.stages)} stages")
    check_tied(profile, choices)
    segment_of = {}
    blocks = {(first, last): module for first, last, module in block_ranges(profile)}
    block_at: dict[int, str] = {}
    for first, last in spans:
        names = tuple(s.name for s in profile.stages[first:last + 1])
        segment_of.update({k: names for k in range(first, last + 1)})
        if (first, last) in blocks:
            # A block's range is installed as the block recomputed: one action for its stages.
            block_at.update({k: "" for k in range(first, last + 1)})
            block_at[first] = blocks[first, last]
    actions = []
    for k, (stage, c) in enumerate(zip(profile.stages, choices)):
        if stage.call and not (k in segment_of or k in block_at):
            continue  # a later place of a module: its first place's action stands for it
        if k in block_at:
            if block_at[k]:
                actions.append(StageAction.recompute(block_at[k]))
        elif k in segment_of:
            actions.append(StageAction.in_segment(stage.name, segment_of[k]))
        else:
            actions.append(installed(stage.options[c]))
    return tuple(actions)
