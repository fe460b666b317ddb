"""What binds: the term that attains a plan's peak, its bytes split into static memory, activations earlier
stages stored, and the term's own (``plan.binding``).

Example:
    >>> from lightning_remat.core.memory_model import PeakTerm, Profile, Segment, StageAction, StageOption, StageProfile
    >>> keep = StageOption("keep", StageAction("h.0"), 100, 150)
    >>> p = Profile((StageProfile("h.0", (keep,)),), (Segment("between stages (1 stored)", 1, 400),),
    ...             parameter_bytes=40)
    >>> describe(p, PeakTerm("segment", 0, "between stages (1 stored)", 400, 100)).text()
    'what binds: the head and loss (after the last stage) at 500 B: static memory 40 B, stored activations 100 B, its own activations and temporaries 360 B'
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping

from .budget import format_bytes
from .memory_model import PeakTerm, Profile

STAGE, HEAD, EMBEDDINGS, BETWEEN, OPTIMIZER = "stage", "head and loss", "embeddings", "between stages", "optimizer step"
OPTIMIZER_SEGMENT = "optimizer step"  # the segment's name (``runtime.profiling.assemble``)
# The optimizer settings whose step is measured beside the user's, as the ``torch.optim`` keyword of each.
OPTIMIZER_SETTINGS: Mapping[str, dict[str, bool]] = {"fused=True": {"fused": True, "foreach": False},
                                                     "foreach=False": {"foreach": False, "fused": False}}
_WHERE = {STAGE: "", HEAD: " (after the last stage)", EMBEDDINGS: " (before the first stage, and the end of backward)", BETWEEN: "",
          OPTIMIZER: " (its state and its step's temporaries)"}
_PARTS = {"static": "static memory", "stored": "stored activations", "own": "its own activations and temporaries"}


@dataclass(frozen=True)
class Binding:
    """``advice``: per optimizer setting, the least peak; ``host_limit_bytes``: what limited offloading, or None."""

    term: str
    name: str
    peak_bytes: int
    static_bytes: int
    stored_bytes: int
    own_bytes: int
    advice: Mapping[str, int] = None  # type: ignore[assignment]
    host_limit_bytes: int | None = None

    @property
    def largest(self) -> str:
        """Which part is largest: ``static``, ``stored`` or ``own``."""
        parts = {"static": self.static_bytes, "stored": self.stored_bytes, "own": self.own_bytes}
        return max(parts, key=lambda k: parts[k])

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "advice": dict(self.advice or {}), "largest": self.largest}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Binding":
        return cls(**{k: v for k, v in data.items() if k != "largest"})

    def text(self, size: Any = format_bytes) -> str:
        """One line: the term, its bytes (``size`` formats them), split; the optimizer advice; the host limit."""
        what = f"stage {self.name}'s forward or backward" if self.term == STAGE else f"the {self.term}"
        split = ", ".join(f"{_PARTS[k]} {size(v)}" for k, v in
                          (("static", self.static_bytes), ("stored", self.stored_bytes), ("own", self.own_bytes)))
        line = f"what binds: {what}{_WHERE.get(self.term, '')} at {size(self.peak_bytes)}: {split}"
        if self.advice:
            line += "; the optimizer's step would reach " + ", ".join(
                f"{size(peak)} with {setting}" for setting, peak in self.advice.items())
        if self.host_limit_bytes is not None:
            line += f"; offloading limited by host memory ({size(self.host_limit_bytes)})"
        return line


def describe(profile: Profile, term: PeakTerm) -> Binding:
    """The ``Binding`` of ``term`` (from ``memory_model.peak_terms``) on ``profile``."""
    segment = profile.segments[term.index] if term.kind == "segment" else None
    if segment is None:
        kind = STAGE
    elif segment.name == OPTIMIZER_SEGMENT:
        kind = OPTIMIZER
    elif segment.stages_alive >= len(profile.stages):
        kind = HEAD
    else:
        kind = EMBEDDINGS if segment.stages_alive == 0 else BETWEEN
    static = min(profile.static_bytes - (0 if kind == OPTIMIZER else profile.gradient_bytes), term.own_bytes)
    return Binding(kind, term.name, int(term.bytes), int(static), int(term.stored_bytes),
                   int(term.own_bytes - static))


def with_optimizer_setting(profile: Profile, setting: str) -> Profile | None:
    """``profile`` with its optimizer step under ``setting`` (an ``OPTIMIZER_SETTINGS`` key); None if unmeasured."""
    delta = profile.optimizer_step_alternatives.get(setting)
    if delta is None:
        return None
    return replace(profile, segments=tuple(
        replace(s, peak_bytes=s.peak_bytes + delta) if s.name == OPTIMIZER_SEGMENT else s for s in profile.segments))


def optimizer_advice(profile: Profile, least_peak: Callable[[Profile], int]) -> dict[str, int]:
    """Per optimizer setting that lowers the step's peak, the least peak the profile reaches with it."""
    return {setting: int(least_peak(with_optimizer_setting(profile, setting)))
            for setting, delta in profile.optimizer_step_alternatives.items() if delta < 0}
