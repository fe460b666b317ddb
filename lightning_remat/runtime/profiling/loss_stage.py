"""A causal LM's head and its loss as the last stage of the profile (``chunk_loss=True``).

The gap they run in becomes a stage with options ``"keep"``, ``"chunks:k"`` (recomputed in backward) and
``"fused:k"`` (gradients computed in forward), each measured once per chunk count and priced by
``core.head_cost``; one FLOP per chunk makes fewer chunks win at an equal peak."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from ...core.actions import StageAction
from ...core.head_cost import HeadShape, fused_cost, recompute_cost
from ...core.memory_model import Costs, Profile, StageOption, StageProfile, seconds_per_flop
from ..installing.chunked_loss import CHUNK_COUNTS, find_head_loss
from ..installing.recompute import _without_cache
from ..measuring.exclusive import planning_runs_here
from ..measuring.measure import Step
from ..measuring.observe import ObservedStep
from .memory_run import memory_run


@dataclass
class HeadFigures:
    """The head, the gap it runs in, its shape, and the gap's figure whole and per chunk count (recomputed, fused)."""

    head: str
    gap: int
    shape: HeadShape
    unchunked: int
    chunked: dict[int, int] = field(default_factory=dict)
    fused: dict[int, int] = field(default_factory=dict)


def measure_head(model: nn.Module, step: Step, observed: ObservedStep, optimizer: torch.optim.Optimizer | None,
                 replay: Callable[[], None], accumulation_steps: int, keep_gap: dict[int, int]) -> HeadFigures | None:
    """The gap measured per chunk count with the head and loss chunked, and fused; None without a causal LM head."""
    found = find_head_loss(model)
    n = len(observed.positions)
    if found is None or n not in keep_gap or found in observed.order:  # a head that is a stage already
        return None
    head = model.get_submodule(found)
    shapes: list[HeadShape] = []
    hook = head.register_forward_pre_hook(
        lambda _, args: shapes.append(_shape(head, args[0])) if planning_runs_here() else None)
    calls = dict(enumerate(observed.position_calls))
    figures = HeadFigures(found, n, HeadShape(0, 0, 0), keep_gap[n])

    def gap(head: StageAction | None) -> int:
        run = memory_run(model, step, observed.positions, calls, [head] if head else [], optimizer, replay,
                         gradients_alive=accumulation_steps > 1)
        return run.segments.get(n, keep_gap[n])

    # The stages run as a recomputed stage runs them, without a KV cache: a chunked head is planned
    # where layers are recomputed, and the keep run's gap, its peak in backward after the model's
    # outputs (and their cache) are gone, is short of a fused head's by the cache, its peak in forward.
    with hook, _cache_off(model, observed.order) as stripped:  # the hook is removed on leaving
        for kind, figure in ((StageAction.chunk, figures.chunked), (StageAction.fuse, figures.fused)):
            for chunks in CHUNK_COUNTS:
                figure[chunks] = gap(kind(found, chunks))
        if stripped:  # the whole head measured alike; without a cache, the keep run's gap
            figures.unchunked = gap(None)
    if not shapes:
        return None
    figures.shape = max(shapes, key=lambda s: s.tokens)
    return figures


@contextlib.contextmanager
def _cache_off(model: nn.Module, stages: Sequence[str]) -> Iterator[list[str]]:
    """Each stage called without its KV cache, as a recompute calls it; yields the stages whose call changed."""
    modules, stripped = dict(model.named_modules()), []

    def hook(name: str) -> Callable:
        def strip(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            new_args, new_kwargs = _without_cache(module, args, kwargs)
            if any(a is not b for a, b in zip(args, new_args)) or any(
                    new_kwargs.get(k) is not v for k, v in kwargs.items()):
                stripped.append(name)
            return new_args, new_kwargs
        return strip

    with contextlib.ExitStack() as hooks:
        for name in dict.fromkeys(stages):
            hooks.enter_context(modules[name].register_forward_pre_hook(hook(name), with_kwargs=True))
        yield stripped


def _shape(head: nn.Module, hidden: torch.Tensor) -> HeadShape:
    """The head's projection as this call runs it (autocast's dtype where autocast is on)."""
    kind = hidden.device.type
    compute = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else head.weight.dtype
    return HeadShape(hidden.numel() // hidden.shape[-1], head.in_features, head.out_features, compute.itemsize,
                     head.weight.dtype.itemsize, head.weight.requires_grad)


def with_head_stage(profile: Profile, figures: HeadFigures | None, flops_per_second: float = 0.0,
                    bytes_per_second: float = 0.0) -> Profile:
    """``profile`` with the head's gap made a stage after the layers; unchanged without figures.

    Example:
        >>> from lightning_remat.core.memory_model import Segment
        >>> profile = Profile((), (Segment("between stages (0 stored)", 0, 900),), baseline_costs=Costs(flops=100))
        >>> shape = HeadShape(tokens=4, hidden=4, vocab=8)
        >>> head = with_head_stage(profile, HeadFigures("lm_head", 0, shape, 900, {8: 300}, {8: 320}))
        >>> [(o.name, o.local_peak_bytes, o.costs.flops) for o in head.stages[0].options], head.segments
        ([('keep', 900, 0), ('chunks:8', 300, 264), ('fused:8', 320, 8)], ())
    """
    # The last gap: all stages alive (stages that did not run are in the chain by now).
    gap = next((s for s in profile.segments if figures is not None and s.stages_alive == len(profile.stages)
                and s.name != "optimizer step"), None)
    if gap is None or figures is None:
        return profile
    rate = seconds_per_flop(profile.baseline_costs.time, profile.baseline_costs.flops)
    # What the gap's figure counts of an input earlier checkpoints hold (core.shared_held), as the
    # stage's: with one such input its bytes are known; with several, nothing is taken off (safe).
    held = ((gap.shared_labels[0], gap.shared_saving),) if len(gap.shared_labels) == 1 and gap.shared_saving else ()
    options = [StageOption("keep", StageAction(figures.head), 0, gap.peak_bytes, held_before=held)]
    shape, peaks = figures.shape, (flops_per_second, bytes_per_second)
    for kind, measured in (("chunks", figures.chunked), ("fused", figures.fused)):
        fused = kind == "fused"
        for chunks, figure in sorted(measured.items()):
            # Recomputed: the projection's FLOPs again. Fused: none (its backward's matmuls run in forward).
            flops = 0 if fused else shape.flops
            roofline = (fused_cost if fused else recompute_cost)(shape, chunks, *peaks)
            action = (StageAction.fuse if fused else StageAction.chunk)(figures.head, chunks)
            options.append(StageOption(
                f"{kind}:{chunks}", action, 0, gap.peak_bytes - figures.unchunked + figure,
                Costs((flops or chunks) * rate, flops + chunks, roofline), held_before=held))
    stage = StageProfile(figures.head, tuple(options), forward_flops=shape.flops, module_type="head and loss")
    result = replace(profile, stages=(*profile.stages, stage), segments=tuple(s for s in profile.segments if s is not gap),
                     notes=(*profile.notes, f"chunk_loss: {figures.head} and the loss are a stage, computed whole or "
                            f"over {', '.join(map(str, sorted(figures.chunked)))} sequence chunks, each recomputed in backward or "
                            "fused (its gradients computed in forward)"))
    gaps = getattr(profile, "gap_figures", None)
    return result.with_gap_figures(None if gaps is None else {k: v for k, v in gaps.items() if k != gap.name})
