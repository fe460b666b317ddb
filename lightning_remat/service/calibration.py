"""The first step and the steps that calibrate it: what a run knows before its first real step, and
what a measured step under a plan adds to it.

Every integration plans the first step before it runs, on a fake-tensor profile (exact to the byte
on the CPU; it allocates nothing, so it fits wherever the step does). A real step under the plan is
then measured; what it shows that the profile could not see goes back into the profile:

- ``measured_excess``: a step that peaked above what its plan predicted shows memory the profile
  did not see (on a GPU the allocator's rounding and library workspaces, code outside the profiled
  step); ``with_measured_excess`` adds it to every term of the profile, and the plans are solved
  again on it before the next step.
- ``priced``: with ``cost="time"``, a fake profile's costs are its counted FLOPs at the seconds per
  FLOP a real step under the plan took (``seconds_per_flop``).

Example:
    >>> from lightning_remat.core.memory_model import Profile, Segment, StageOption, StageProfile
    >>> from lightning_remat.core.plan import Plan
    >>> keep = StageOption("keep", (), 100, 150, 0.0, 0)
    >>> profile = Profile((StageProfile("a", (keep,), forward_flops=10),), (Segment("head", 1, 50),),
    ...                   baseline_step_flops=30)
    >>> plan = Plan([], budget_bytes=300, baseline_peak_bytes=150, predicted_peak_bytes=150, predicted_overhead=0.0)
    >>> measured_excess(plan, 162), measured_excess(plan, 140)
    (12, 0)
    >>> with_measured_excess(profile, 12).baseline_peak_bytes
    162
    >>> priced(profile, seconds_per_flop(plan, profile, 0.003)).baseline_step_seconds
    0.003
"""

from __future__ import annotations

from dataclasses import replace

from ..core.budget import format_bytes
from ..core.memory_model import Profile
from ..core.plan import Plan
from ..runtime.profiling.profile_adjust import with_always_alive


def measured_excess(plan: Plan, measured_peak_bytes: int) -> int:
    """Bytes a measured step under ``plan`` peaked above the plan's prediction (0 when it did not,
    or the plan predicts nothing: a fallback plan)."""
    predicted = plan.predicted_peak_bytes
    return 0 if predicted is None else max(0, int(measured_peak_bytes) - int(predicted))


def with_measured_excess(profile: Profile, excess: int) -> Profile:
    """``profile`` with ``excess`` bytes more in every term: a measured step under a plan made on it
    peaked that much above its prediction, memory the profile did not see."""
    return with_always_alive(profile, excess, (
        f"calibrated by a measured step: it peaked {format_bytes(excess)} ({excess} bytes) above the plan's "
        "prediction (memory the profile did not see: on a GPU the allocator's rounding and library workspaces, "
        "or code outside the profiled step); counted in every term"))


def seconds_per_flop(plan: Plan, profile: Profile, seconds: float) -> float | None:
    """The seconds per FLOP of a measured step of ``seconds`` under ``plan`` (made on ``profile``,
    priced by FLOPs): the step's counted FLOPs are the profile's step without recomputation and the
    plan's recompute. None when the profile counts no FLOPs."""
    flops = profile.baseline_step_flops * (1.0 + (plan.predicted_overhead or 0.0))
    return seconds / flops if flops > 0 and seconds > 0 else None


def priced(profile: Profile, rate: float) -> Profile:
    """A fake profile's costs in seconds, its counted FLOPs at ``rate`` seconds per FLOP (as
    ``profile_step`` prices a fake profile with a GPU's speed)."""
    stages = tuple(replace(stage, forward_seconds=stage.forward_flops * rate,
                           options=tuple(replace(o, cost_seconds=o.cost_flops * rate) for o in stage.options))
                   for stage in profile.stages)
    return replace(profile, stages=stages, baseline_step_seconds=profile.baseline_step_flops * rate)
