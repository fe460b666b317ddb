"""One memory run: a step measured with some modules recomputed (or offloaded), read in the model's terms."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ...core.errors import RematError
from ...core.plan import Plan, StageAction
from ..installing.apply import applied
from ..installing.installer import input_offload_of
from ..installing.offload import model_offloader
from ..measuring.measure import Step, model_device
from ..measuring.meter import PeakMeter
from ..measuring.runner import run_step
from ..measuring.tracking import SegmentTracker, current_total, snapshot_by_category
from .held_inputs import DeadInputs, HeldInputs


@dataclass
class MemoryRun:
    """One step measured with some modules recomputed (or offloaded), in the terms of the memory model."""

    stored: list[int]
    local: list[int]
    segments: dict[int, int]  # stages alive -> peak beyond their stored bytes
    gradient_bytes: int
    parameter_bytes: int
    buffer_bytes: int
    residual_bytes: int  # what the step still holds after backward (its loss, outputs), besides static memory
    untracked_bytes: int  # on CUDA: the allocator's peak above MemTracker's (inputs made before, workspaces)
    host_bytes: dict[str, int]  # offloaded stages: bytes sent to the host
    # Inputs several recomputed stages hold (core.shared_held): per stage what it holds, per stage
    # what an earlier stage held (its figures count them), per segment the same.
    shared: list[tuple[tuple[str, int], ...]]
    held_before: list[tuple[tuple[str, int], ...]]
    segments_held: dict[int, tuple[tuple[str, int], ...]]
    fresh: frozenset[int]  # places after a backward pass of the step (StageProfile.fresh)


def memory_run(model: nn.Module, step: Step, order: Sequence[str], calls: dict[int, int],
               actions: Sequence[StageAction], optimizer: torch.optim.Optimizer | None, replay: Callable[[], None],
               gradients_alive: bool = False, dead: dict[str, set[str]] | None = None) -> MemoryRun:
    # ``actions``: what the run installs (an option's: stage_options.option_actions; a chunked or fused head alone:
    # loss_stage.py); ``order``: the chain's places, ``calls`` the calls at each; ``dead``: held_inputs.py.
    plan = Plan(actions)
    wrapped, offloaded, offload_inputs = plan.checkpointed, plan.offloaded, bool(plan.offloaded_inputs)
    modules = dict(model.named_modules())
    replay()
    if gradients_alive:
        # A later micro-batch of an accumulation window: every gradient exists from the start.
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    device = model_device(model)
    places: dict[int, list[int]] = {}  # a module whose calls other stages separate has several
    for i, n in enumerate(order):
        places.setdefault(id(modules[n]), []).append(i)
    tracker = SegmentTracker(places, device, calls)
    meter = _SegmentMeter(model, optimizer, tracker)
    with applied(model, plan), \
            HeldInputs(model, order, dead or {}, wrapped, [calls.get(i, 1) for i in range(len(order))]) as held, \
            DeadInputs(model, order if dead == {} and not wrapped and not offloaded else (), dead) as finder:

        def checked(model: nn.Module) -> torch.Tensor:
            loss = step(model)
            finder.check()
            return loss

        run_step(model, checked, watch=meter)
        # Offloaded stages: the bytes sent to the host.
        host = (dict(model_offloader(model).host_bytes) if offloaded else
                dict(input_offload_of(model)[1].host_bytes) if offload_inputs else {})
    n = len(order)
    missing = [order[i] for i in range(n) if i not in tracker.stored]
    if missing:
        raise RematError(f"stages {missing} ran in one pass over the profiled batch and not in another: the model's "
                         "control flow depends on something other than torch's random generators (which the profile "
                         "replays). Pass candidates= without these modules, or make their use reproducible.")
    stored = [tracker.stored[i] for i in range(n)]
    if (offloaded or offload_inputs) and len(set(order)) == len(order):  # a module at several places: as measured
        stored = net_of_released(stored, tracker.forward_starts, calls, tracker.resharded())
    # A recomputed stage also stores the inputs its checkpoint keeps alive (held_inputs.py); the later terms
    # are taken net of the bytes only this stage holds.
    prefix = list(itertools.accumulate((s + e for s, e in zip(stored, held.exclusive)), initial=0))
    stored = [s + h for s, h in zip(stored, held.bytes)]
    # Not clamped at zero: stages may free some stored bytes later (FSDP2 reshards), docs/sharded.md.
    local, segments = _local_peaks(tracker.segment_peaks, prefix, n, tracker.fresh)
    now = snapshot_by_category(tracker.get_tracker_snapshot("current"), device)
    static_now = sum(now.get(k, 0) for k in ("Gradient", "Parameter", "Buffer", "Optstate"))
    model.zero_grad(set_to_none=True)
    peak = snapshot_by_category(tracker.get_tracker_snapshot("peak"), device).get("Total", 0)
    return MemoryRun(
        # On CUDA the meter's peak is the allocator's, which also sees what the tracker does not.
        stored=stored, local=local, segments=segments, untracked_bytes=max(0, meter.peak_bytes - int(peak)),
        gradient_bytes=now.get("Gradient", 0), parameter_bytes=now.get("Parameter", 0),
        buffer_bytes=now.get("Buffer", 0), residual_bytes=max(0, meter.after_backward - static_now),
        host_bytes=host,
        shared=held.shared, held_before=[held.held_before(i) for i in range(n)],
        segments_held={k: held.held_before(k) for k in segments}, fresh=frozenset(tracker.fresh),
    )


def _local_peaks(segment_peaks: dict, prefix: list[int], n: int,
                 fresh: set[int] = frozenset()) -> tuple[list[int], dict[int, int]]:
    """Each stage's local peak and each gap's segment peak; stored bytes count from the last ``fresh`` stage on."""
    starts = [max([0, *(f for f in fresh if f <= i)]) for i in range(n)]
    local: dict[int, int] = {}
    segments: dict[int, int] = {}
    for (kind, k), peak in segment_peaks.items():
        if kind in ("fw", "bw"):
            own = peak - (prefix[k] - prefix[starts[k]])
            local[k] = max(local.get(k, own), own)
        else:
            own = peak - (prefix[k] - prefix[starts[k - 1]]) if k else peak
            segments[k] = max(segments.get(k, own), own)
    return [local.get(i, 0) for i in range(n)], segments


def net_of_released(stored: list[int], starts: dict[int, int], calls: dict[int, int],
                    resharded: dict[int, int] | None = None) -> list[int]:
    """Stored bytes net of what the gap after each stage's forward released (offload runs: inputs not held).

    ``resharded``: per stage, parameter bytes FSDP2's resharding freed in that gap, in every run alike, so the
    later terms count them already: they do not come off.

    Example:
        >>> net_of_released([100, 100], {0: 0, 1: 40}, {}, {0: 30})  # 60 freed, 30 of them resharded
        [70, 100]
    """
    if any(c > 1 for c in calls.values()) or len(starts) != len(stored):
        return stored
    net = list(stored)
    for i in range(len(stored) - 1):
        released = starts[i] + stored[i] - starts[i + 1] - max(0, (resharded or {}).get(i, 0))
        if released > 0:
            net[i] = max(0, stored[i] - released)
    return net


class _SegmentMeter(PeakMeter):
    """The run's peak meter over its ``SegmentTracker``, also reading what the step holds right after backward."""

    after_backward = 0

    def backward_done(self) -> None:
        self.after_backward = current_total(self.tracker, self.device)
