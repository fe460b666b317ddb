"""What a measured step under a plan adds to the fake-tensor profile: memory it did not see, seconds per FLOP."""

from __future__ import annotations


from ..core.budget import format_bytes
from ..core.memory_model import Profile, priced
from ..core.plan import Plan
from ..runtime.profiling.profile_adjust import with_always_alive


def measured_excess(plan: Plan, measured_peak_bytes: int) -> int:
    """Bytes a measured step under ``plan`` peaked above its prediction (0 if not, or nothing was predicted)."""
    predicted = plan.predicted_peak_bytes
    return 0 if predicted is None else max(0, int(measured_peak_bytes) - int(predicted))


def with_measured_excess(profile: Profile, excess: int) -> Profile:
    """``profile`` with ``excess`` bytes more in every term."""
    return with_always_alive(profile, excess, (
        f"calibrated by a measured step: it peaked {format_bytes(excess)} ({excess} bytes) above the plan's "
        "prediction (memory the profile did not see: on a GPU the allocator's rounding and library workspaces, "
        "or code outside the profiled step); counted in every term"))


def seconds_per_flop(plan: Plan, profile: Profile, seconds: float) -> float | None:
    """Seconds per FLOP of a step measured at ``seconds`` under ``plan``; None when the profile counts no FLOPs."""
    flops = profile.baseline_step_flops * (1.0 + (plan.predicted_overhead or 0.0))
    return seconds / flops if flops > 0 and seconds > 0 else None

