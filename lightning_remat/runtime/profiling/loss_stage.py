"""A causal LM's head and its loss as the last stage of the profile (``chunk_loss=True``).

The gap they run in becomes a stage with options ``"keep"`` and ``"chunks:k"``, measured once per chunk
count; one FLOP per chunk makes fewer chunks win at an equal peak."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from ...core.memory_model import Profile, StageOption, StageProfile
from ...core.vocabulary import OptionKind, option_name
from ..installing.chunked_loss import CHUNK_COUNTS, find_head_loss, head_flops
from ..measuring.exclusive import planning_runs_here
from ..measuring.measure import Step
from ..measuring.observe import ObservedStep
from .memory_run import memory_run


@dataclass
class HeadFigures:
    """What the chunked runs measured: the head, the gap it runs in, its FLOPs, and the gap's figure per chunk count."""

    head: str
    gap: int
    flops: int
    unchunked: int
    chunked: dict[int, int] = field(default_factory=dict)


def measure_head(model: nn.Module, step: Step, observed: ObservedStep, optimizer: torch.optim.Optimizer | None,
                 replay: Callable[[], None], accumulation_steps: int, keep_gap: dict[int, int]) -> HeadFigures | None:
    """The step measured once per chunk count with head and loss chunked; None without a causal LM head."""
    found = find_head_loss(model)
    n = len(observed.positions)
    if found is None or n not in keep_gap or found.head in observed.order:  # a head that is a stage already
        return None
    head = model.get_submodule(found.head)
    tokens: list[int] = []
    hook = head.register_forward_pre_hook(
        lambda _, args: tokens.append(args[0].numel() // args[0].shape[-1]) if planning_runs_here() else None)
    calls = dict(enumerate(observed.position_calls))
    figures = HeadFigures(found.head, n, 0, keep_gap[n])
    try:
        for chunks in CHUNK_COUNTS:
            run = memory_run(model, step, observed.positions, calls, [], optimizer, replay,
                             gradients_alive=accumulation_steps > 1, chunked={found.head: chunks})
            figures.chunked[chunks] = run.segments.get(n, keep_gap[n])
    finally:
        hook.remove()
    if not tokens:
        return None
    figures.flops = head_flops(head, max(tokens))
    return figures


def with_head_stage(profile: Profile, figures: HeadFigures | None, flops_per_second: float = 0.0) -> Profile:
    """``profile`` with the head's gap made a stage after the layers; unchanged without figures.

    Example:
        >>> from lightning_remat.core.memory_model import Segment
        >>> profile = Profile((), (Segment("between stages (0 stored)", 0, 900),), baseline_step_flops=100)
        >>> head = with_head_stage(profile, HeadFigures("lm_head", 0, 50, 900, {8: 300}))
        >>> [(o.name, o.local_peak_bytes) for o in head.stages[0].options], head.segments
        ([('keep', 900), ('chunks:8', 300)], ())
    """
    # The last gap: all stages alive (stages that did not run are in the chain by now).
    gap = next((s for s in profile.segments if figures is not None and s.stages_alive == len(profile.stages)
                and s.name != "optimizer step"), None)
    if gap is None or figures is None:
        return profile
    per_second = profile.baseline_step_seconds / (profile.baseline_step_flops or 1)
    roofline = figures.flops / flops_per_second if flops_per_second else 0.0
    # What the gap's figure counts of an input earlier checkpoints hold (core.shared_held), as the
    # stage's: with one such input its bytes are known; with several, nothing is taken off (safe).
    held = ((gap.shared_labels[0], gap.shared_saving),) if len(gap.shared_labels) == 1 and gap.shared_saving else ()
    options = [StageOption(option_name(OptionKind.KEEP), (), 0, gap.peak_bytes, 0.0, 0, held_before=held)]
    for chunks, figure in sorted(figures.chunked.items()):
        options.append(StageOption(
            option_name(OptionKind.CHUNKS, chunks), (), 0, gap.peak_bytes - figures.unchunked + figure,
            cost_seconds=figures.flops * per_second, cost_flops=figures.flops + chunks,
            cost_roofline=roofline, chunks=chunks, held_before=held))
    stage = StageProfile(figures.head, tuple(options), forward_flops=figures.flops, module_type="head and loss")
    result = replace(profile, stages=(*profile.stages, stage), segments=tuple(s for s in profile.segments if s is not gap),
                     notes=(*profile.notes, f"chunk_loss: {figures.head} and the loss are a stage, computed whole or "
                            f"over {', '.join(map(str, sorted(figures.chunked)))} sequence chunks"))
    gaps = getattr(profile, "gap_figures", None)
    result = result.with_gap_figures(None if gaps is None else {k: v for k, v in gaps.items() if k != gap.name})
    return result
