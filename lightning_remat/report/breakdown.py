"""Where the memory of a training step goes (the blocks that save most), and how it moves operator by operator."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.binding import OPTIMIZER_SEGMENT, describe
from ..core.memory_model import Profile, binding_term, peak_terms
from ..core.plan import Plan
from ..runtime.installing.apply import applied, recomputation_of
from ..runtime.measuring.measure import Step, model_device, preserved_training_state
from ..runtime.measuring.runner import Tracking, run_step
from ..runtime.measuring.tracking import TimelineTracker, snapshot_by_category
from ..runtime.measuring.user_hooks import user_hooks_suspended
from ..runtime.profiling.optimizer_step import optimizer_step_cost
from .render import breakdown_renderables, print_renderables


@dataclass(frozen=True)
class ModuleMemory:
    """A candidate block and the activation bytes it saves for backward (nothing recomputed)."""

    name: str
    module_type: str
    saved_bytes: int
    share: float  # of the bytes saved by all candidate blocks


@dataclass
class MemoryBreakdown:
    """Where the memory of one training step goes.

    Attributes:
        optimizer_state_bytes: before the first step, the state it will create (``optimizer_state_counted_ahead``).
        at_peak: the split of the forward/backward peak by category; it sums to ``forward_backward_peak_bytes``.
        peak_bytes: the predicted peak of a whole steady-state step: what a budget is compared with.
    """

    parameter_bytes: int = 0
    buffer_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_state_bytes: int = 0
    optimizer_state_counted_ahead: bool = False
    activation_bytes: int = 0
    temporary_bytes: int = 0
    at_peak: dict[str, int] = field(default_factory=dict)
    forward_backward_peak_bytes: int = 0
    peak_bytes: int = 0
    saved_activation_bytes: int = 0
    top_modules: list[ModuleMemory] = field(default_factory=list)
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)

    @property
    def static_bytes(self) -> int:
        """Parameters, buffers, gradients and optimizer state: what no recomputation can free."""
        return self.parameter_bytes + self.buffer_bytes + self.gradient_bytes + self.optimizer_state_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "static_bytes": self.static_bytes}

    def print(self, console: Any = None) -> None:
        """Print the breakdown's tables with rich (to ``console``, default stdout)."""
        print_renderables(breakdown_renderables(self), console)


_MODELLED = ("nothing was measured: the split at the peak is the memory model's, and its temporaries include the "
             "gradients alive then")


def modelled_split(profile: Profile) -> dict[str, int]:
    """The forward/backward peak of ``profile`` with nothing recomputed, split into static memory by kind, the
    activations stored before the binding term (``Activation``) and the term's own bytes (``Temp``).

    >>> from lightning_remat.core.memory_model import Segment, StageAction, StageOption, StageProfile
    >>> keep = StageOption("keep", StageAction("a"), 100, 150)
    >>> p = Profile((StageProfile("a", (keep,)),), (Segment("head", 1, 60),), parameter_bytes=10)
    >>> modelled_split(p)
    {'Parameter': 10, 'Buffer': 0, 'Optstate': 0, 'Activation': 100, 'Temp': 50}
    """
    terms = [t for t in peak_terms(profile, [0] * len(profile.stages))
             if not (t.kind == "segment" and profile.segments[t.index].name == OPTIMIZER_SEGMENT)]
    term = binding_term(terms)
    if term is None:
        return {}
    found = describe(profile, term)
    static = {"Parameter": profile.parameter_bytes, "Buffer": profile.buffer_bytes,
              "Optstate": profile.optimizer_state_bytes}
    left = found.static_bytes  # ``describe`` caps static memory at the term's own bytes
    for key, nbytes in static.items():
        static[key] = min(nbytes, left)
        left -= static[key]
    return {**static, "Activation": found.stored_bytes, "Temp": found.own_bytes}


def breakdown_from_profile(profile: Profile, tracker_totals: dict[str, int] | None = None,
                           counted_ahead: bool = False, top: int = 10) -> MemoryBreakdown:
    """Build a ``MemoryBreakdown`` from a profile and (optionally) the category split of a measured peak."""
    # MemTracker's "Total" is dropped: the parts' sum is the one total, so the split always adds up.
    measured = tracker_totals is not None
    at_peak = {k: int(v) for k, v in (tracker_totals if measured else modelled_split(profile)).items() if k != "Total"}
    saved_total = sum(s.saved_bytes for s in profile.stages)
    ranked = sorted(profile.stages, key=lambda s: s.saved_bytes, reverse=True)[:top]
    modules = [ModuleMemory(s.name, s.module_type, int(s.saved_bytes), s.saved_bytes / saved_total if saved_total else 0.0)
               for s in ranked]
    # Measured: the activations alive at the peak. Modelled: all that forward stores (alive at its end).
    activation = (int(at_peak.get("Activation", 0)) if measured
                  else max((t.stored_bytes for t in peak_terms(profile, [0] * len(profile.stages))), default=0))
    temporary = int(at_peak.get("Temp", 0))
    if counted_ahead and measured and at_peak:
        # The state does not exist yet while this step runs; in every later step it does.
        at_peak["Optstate"] = at_peak.get("Optstate", 0) + profile.optimizer_state_bytes
    fw_bw_peak = sum(at_peak.values())
    return MemoryBreakdown(
        parameter_bytes=profile.parameter_bytes, buffer_bytes=profile.buffer_bytes,
        gradient_bytes=profile.gradient_bytes, optimizer_state_bytes=profile.optimizer_state_bytes,
        optimizer_state_counted_ahead=counted_ahead, activation_bytes=activation, temporary_bytes=temporary,
        at_peak=at_peak, forward_backward_peak_bytes=fw_bw_peak, peak_bytes=profile.baseline_peak_bytes,
        saved_activation_bytes=int(saved_total), top_modules=modules, device=profile.device,
        notes=list(profile.notes) + ([] if measured or not at_peak else [_MODELLED]),
    )


def memory_breakdown(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None = None, *,
                     profile: Profile | None = None, top: int = 10, show: bool = True,
                     console: Any = None) -> MemoryBreakdown:
    """Where the memory of one training step of ``model`` goes, printed and returned (``profile``: reuse one).

    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    >>> opt = torch.optim.Adam(net.parameters())
    >>> b = memory_breakdown(net, lambda m: m(torch.randn(32, 64)).sum(), opt, show=False)
    >>> b.optimizer_state_bytes >= 2 * b.parameter_bytes, len(b.top_modules), b.peak_bytes > b.static_bytes
    (True, 4, True)
    """
    if profile is None:
        from ..runtime.profiling.profile import profile_step

        profile = profile_step(model, step, optimizer=optimizer)
    counted_ahead = optimizer is not None and not optimizer.state
    tracker = tracked_step(model, step, optimizer, Plan())
    peak = snapshot_by_category(tracker.get_tracker_snapshot("peak"), model_device(model))
    peak["Temp"] = peak.get("Temp", 0) + peak.pop("Other", 0)
    result = breakdown_from_profile(profile, peak, counted_ahead, top)
    if show:
        result.print(console)
    return result


@dataclass
class MemoryTimeline:
    """Total memory after each operator of one forward and backward pass (optimizer state included)."""

    label: str
    bytes_after_op: list[int]
    backward_start: int | None = None

    @property
    def peak_bytes(self) -> int:
        return max(self.bytes_after_op, default=0)


def tracked_step(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None,
                  plan: Plan) -> TimelineTracker:
    """One forward and backward pass under the timeline tracker with ``plan`` applied; the model left as it was."""
    device = model_device(model)
    tracker = TimelineTracker(device)
    with preserved_training_state(model, optimizer), applied(model, plan), \
            user_hooks_suspended(model), warnings.catch_warnings():
        # MemTracker warns when a module's backward hook outlives the module's outputs.
        warnings.simplefilter("ignore")
        # The optimizer is tracked (its state is part of the step's memory), not stepped.
        run_step(model, step, watch=Tracking(tracker, model, optimizer), zero_grad="before")
    return tracker


def memory_timeline(model: nn.Module, step: Step, plan: Plan | None = None, *,
                    optimizer: torch.optim.Optimizer | None = None, label: str | None = None) -> MemoryTimeline:
    """The total memory after every operator of one forward and backward pass under ``plan`` (None: nothing)."""
    plan = recomputation_of(plan or Plan())
    names = plan.checkpointed
    tracker = tracked_step(model, step, optimizer, plan)
    # The state the optimizer will create at its first step (none once it stepped).
    offset = optimizer_step_cost(optimizer).state_bytes if optimizer is not None and not optimizer.state else 0
    if label is None:
        label = f"recompute {len(names)} module(s)" if names else "no recomputation"
    return MemoryTimeline(label, [t + offset for t in tracker.totals], tracker.backward_start)
