"""The "offload" option of a stage in the memory model: its transfer cost and its in-flight bytes.

The memory run does not see tensors in flight while the *next* stage runs, so the stage's local peak is
raised to ``stored + host_bytes + the next stage's largest local peak`` (an upper bound). The cost is the
transfer time not hidden behind the next stage's forward and backward.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from .budget import format_bytes
from .calls import owners
from .errors import BudgetTooSmallError, RematError
from .memory_model import Costs, Profile, StageOption, segment_peaks
from .vocabulary import Action

OFFLOAD = "offload"
# Offload only what the host link moves while the next stage's forward runs: free by construction.
OFFLOAD_HIDDEN = "offload:hidden"
# Recomputed whole, with the input its checkpoint keeps in host memory (copied synchronously both ways).
OFFLOAD_INPUT = "whole+offload-input"


def is_offload(option: StageOption) -> bool:
    """Whether ``option`` sends its stage's saved tensors to host memory."""
    return option.action.action is Action.OFFLOAD


def to_host(option: StageOption) -> bool:
    """Whether ``option`` puts anything in host memory: its saved tensors, or its checkpoint's input."""
    return is_offload(option) or option.action.offload_input


def with_offload_costs(profile: Profile, bandwidth: float, flops_per_second: float) -> Profile:
    """``profile`` with its offload options priced at ``bandwidth`` and their in-flight bytes bounded."""
    stages = list(profile.stages)
    n = len(stages)
    # A prefetched stage (all but the last) has its tensors back when its backward starts: at least keep's peak.
    for i, stage in enumerate(stages[:-1]):
        keep = stage.options[0]
        stages[i] = replace(stage, options=tuple(
            replace(o, local_peak_bytes=int(max(o.local_peak_bytes, keep.local_peak_bytes
                                                + max(0, o.stored_bytes + o.host_bytes - keep.stored_bytes))))
            if is_offload(o) else o for o in stage.options))
    after_last = segment_peaks(profile).get(n, 0)
    for i, stage in enumerate(stages):
        options = []
        nxt = stages[i + 1] if i + 1 < n else None
        # A checkpoint input sent out and back (synchronously: nothing hides it) on top of the recompute.
        stage = replace(stage, options=tuple(
            replace(o, costs=o.costs + _transfer(2 * o.host_bytes / bandwidth, flops_per_second))
            if o.action.offload_input else o
            for o in stage.options))
        hidden = nxt.forward_seconds if nxt is not None else 0.0
        next_peak = max(o.local_peak_bytes for o in nxt.options) if nxt is not None else after_last
        for option in stage.options:
            if is_offload(option):
                transfer = option.host_bytes / bandwidth
                seconds = max(0.0, transfer - hidden) + max(0.0, transfer - 2 * hidden)
                local = max(option.local_peak_bytes, option.stored_bytes + option.host_bytes + next_peak)
                option = replace(option, costs=_transfer(seconds, flops_per_second), local_peak_bytes=int(local))
            options.append(option)
        stages[i] = replace(stage, options=tuple(options))
    return replace(profile, stages=tuple(stages))


def _transfer(seconds: float, flops_per_second: float) -> Costs:
    return Costs(seconds, int(seconds * flops_per_second), seconds)  # as FLOPs: those the device could run meanwhile


def without_offload(profile: Profile, stages: set[int]) -> Profile:
    """``profile`` without the offload options of the given stages (and their modules' other calls)."""
    owner = owners(profile)
    modules = {owner[i] for i in stages}
    return replace(profile, stages=tuple(
        replace(s, options=tuple(o for o in s.options if not to_host(o)))
        if owner[i] in modules else s for i, s in enumerate(profile.stages)))


def solve_within_host(profile: Profile, host_free: int, solve: Callable[[Profile], Any]) -> Any:
    """``solve(profile)``, with no more than ``host_free`` bytes offloaded to the host.

    While a plan offloads too much, the largest offloaded stages lose their offload options and the profile is
    solved again (within the host's memory, not always the cheapest such plan); ``RematError`` if nothing fits.
    """
    withdrawn: set[int] = set()
    first_host = None
    while True:
        try:
            plan = solve(without_offload(profile, withdrawn) if withdrawn else profile)
        except BudgetTooSmallError as error:
            if not withdrawn:
                raise
            raise RematError(f"offload: the budget needs {format_bytes(first_host or 0)} of activations offloaded to "
                             f"host memory, and the host has {format_bytes(host_free)} free; no plan within the "
                             f"host's memory fits ({error.args[0].split(':')[0]}). Free host memory, raise the "
                             "budget, or reduce the batch") from None
        if plan.host_bytes <= host_free:
            if withdrawn and plan.binding is not None:
                # What binds is then also the host's memory: said with the plan (``core.binding``).
                plan = replace(plan, binding={**plan.binding, "host_limit_bytes": int(host_free)})
            return plan
        first_host = first_host if first_host is not None else plan.host_bytes
        moved = {*plan.offloaded, *plan.offloaded_inputs}
        chosen = sorted(((max(o.host_bytes for o in s.options), i) for i, s in enumerate(profile.stages)
                         if s.name in moved), reverse=True)
        excess = plan.host_bytes - host_free
        for host, i in chosen:
            withdrawn.add(i)
            excess -= host
            if excess <= 0:
                break
