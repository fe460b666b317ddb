"""The plan: which modules to recompute, and what that is predicted to cost and save."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .budget import format_bytes


@dataclass(frozen=True)
class StageChoice:
    """The option chosen for one stage, with the figures the summary shows.

    Example:
        >>> StageChoice("transformer.h.0", "whole", 4096, 1024, 0.01).option
        'whole'
    """

    stage: str
    option: str
    baseline_stored_bytes: int
    stored_bytes: int
    cost: float


@dataclass
class Plan:
    """A recompute plan for one model under one budget.

    Attributes:
        checkpointed: names (as in ``model.named_modules()``) of the modules whose forward is
            recomputed during backward.
        budget_bytes: the budget the plan was solved for (for ``budget="min"``, the least peak).
        baseline_peak_bytes: measured peak of a training step without recomputation.
        predicted_peak_bytes: the memory model's peak for this plan.
        predicted_overhead: recompute cost divided by the cost of a step without recomputation.
        cost_kind: ``"time"`` (measured seconds) or ``"flops"`` (counted FLOPs).

    Example:
        >>> plan = Plan(["h.0"], budget_bytes=2**30, baseline_peak_bytes=2**31,
        ...             predicted_peak_bytes=2**30 - 1, predicted_overhead=0.1)
        >>> Plan.from_dict(plan.to_dict()) == plan
        True
        >>> print(plan.summary().splitlines()[0])
        Recompute plan: 1 module(s), predicted peak 1024.00 MiB (budget 1.00 GiB, baseline 2.00 GiB), overhead 10.0% (time)
    """

    checkpointed: list[str]
    budget_bytes: int
    baseline_peak_bytes: int
    predicted_peak_bytes: int
    predicted_overhead: float
    cost_kind: str = "time"
    requested_budget: str = ""
    choices: list[StageChoice] = field(default_factory=list)
    parameter_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_state_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def predicted_saving_bytes(self) -> int:
        """Bytes of peak memory the plan is predicted to save against no recomputation."""
        return self.baseline_peak_bytes - self.predicted_peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict; ``Plan.from_dict`` rebuilds an equal plan."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        known["choices"] = [StageChoice(**c) for c in data.get("choices", [])]
        known["checkpointed"] = list(data["checkpointed"])
        known["notes"] = list(data.get("notes", []))
        return cls(**known)

    def summary(self) -> str:
        """A readable table: the totals, one row per stage, and memory no recomputation frees."""
        unit = "s" if self.cost_kind == "time" else "FLOP"
        lines = [
            f"Recompute plan: {len(self.checkpointed)} module(s), predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"(budget {format_bytes(self.budget_bytes)}, baseline {format_bytes(self.baseline_peak_bytes)}), "
            f"overhead {self.predicted_overhead:.1%} ({self.cost_kind})",
            f"  at the peak: parameters {format_bytes(self.parameter_bytes)}, gradients {format_bytes(self.gradient_bytes)}, "
            f"optimizer state {format_bytes(self.optimizer_state_bytes)}, activations and temporaries "
            f"{format_bytes(max(0, self.predicted_peak_bytes - self.parameter_bytes - self.gradient_bytes - self.optimizer_state_bytes))}",
        ]
        if self.choices:
            width = max(len("stage"), *(len(c.stage) for c in self.choices))
            lines.append(f"  {'stage':<{width}}  {'option':<10} {'stored (keep)':>14} {'stored (plan)':>14} {'cost':>10}")
            for c in self.choices:
                cost = f"{c.cost:.3g} {unit}" if c.cost else "-"
                lines.append(
                    f"  {c.stage:<{width}}  {c.option:<10} {format_bytes(c.baseline_stored_bytes):>14} "
                    f"{format_bytes(c.stored_bytes):>14} {cost:>10}"
                )
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)
