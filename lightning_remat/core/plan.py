"""The plan: which modules to recompute, and what that is predicted to cost and save."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence


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
        cost_kind: ``"time"`` (measured seconds), ``"flops"`` (counted FLOPs) or ``"roofline"``
            (per op max(FLOPs / peak, bytes / bandwidth)).
        offloaded: modules whose saved tensors go to host memory and come back for backward
            (``runtime.offload``); ``host_bytes`` is the host memory they take.
        policies: per checkpointed module, the selective-checkpointing policy its recompute runs
            under (``runtime.sac.POLICIES``); a module not in it recomputes its whole forward.

    Example:
        >>> plan = Plan(["h.0"], budget_bytes=2**30, baseline_peak_bytes=2**31,
        ...             predicted_peak_bytes=2**30 - 1, predicted_overhead=0.1)
        >>> Plan.from_dict(plan.to_dict()) == plan
        True
        >>> sac = Plan(["h.0"], 2**30, 2**31, 2**30, 0.01, policies={"h.0": "save_matmuls"})
        >>> Plan.from_dict(sac.to_dict()).policies
        {'h.0': 'save_matmuls'}
        >>> Plan.from_dict({**plan.to_dict(), "checkpointed": "h.0"})
        Traceback (most recent call last):
        ...
        ValueError: a plan's 'checkpointed' must be a list of module names, got 'h.0'

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
    fallback: bool = False
    # What the plan was made for (parameter bytes, the batch's size and shapes), so that an
    # integration can tell when it no longer applies: a resumed run, a larger batch.
    fingerprint: dict[str, Any] = field(default_factory=dict)
    # The profile's ``sharding`` (FSDP2 world size, unsharded parameters in flight); empty on one device.
    sharding: dict[str, Any] = field(default_factory=dict)
    # Runs of consecutive stages (items of one nn.Sequential) recomputed as ONE checkpoint each:
    # their inner boundaries are not kept (``core.spans``). Empty: every module is recomputed alone.
    segments: list[list[str]] = field(default_factory=list)
    policies: dict[str, str] = field(default_factory=dict)
    # Modules whose saved tensors go to host memory during forward and come back for backward
    # (``runtime.offload``); ``host_bytes`` is what they hold on the host.
    offloaded: list[str] = field(default_factory=list)
    host_bytes: int = 0
    # Per offloaded module, the bytes it offloads at most per forward call (absent: everything).
    offload_limits: dict[str, int] = field(default_factory=dict)

    @classmethod
    def recompute_everything(cls, stages: Sequence[str], budget: int | str, cost_kind: str, requested_budget: str,
                             note: str) -> "Plan":
        """The plan made without a profile (profiling ran out of memory): every stage recomputed whole.

        Nothing is predicted: ``predicted_peak_bytes`` and ``baseline_peak_bytes`` are 0 and
        ``predicted_overhead`` is NaN (unknown); ``budget_bytes`` is 0 for ``"min"``.

        Example:
            >>> plan = Plan.recompute_everything(["h.0", "h.1"], "min", "flops", "min", "out of memory")
            >>> plan.fallback, plan.checkpointed, plan.budget_bytes
            (True, ['h.0', 'h.1'], 0)
        """
        return cls(checkpointed=list(stages), budget_bytes=budget if isinstance(budget, int) else 0,
                   baseline_peak_bytes=0, predicted_peak_bytes=0, predicted_overhead=float("nan"),
                   cost_kind=cost_kind, requested_budget=requested_budget, notes=[note], fallback=True)

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
        checkpointed = data.get("checkpointed")
        if not isinstance(checkpointed, (list, tuple)) or not all(isinstance(n, str) for n in checkpointed):
            raise ValueError(f"a plan's 'checkpointed' must be a list of module names, got {checkpointed!r}")
        known["choices"] = [StageChoice(**c) for c in data.get("choices", [])]
        known["checkpointed"] = list(checkpointed)
        known["notes"] = list(data.get("notes", []))
        known["segments"] = [list(s) for s in data.get("segments", [])]
        policies = data.get("policies", {})
        if not isinstance(policies, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in policies.items()):
            raise ValueError(f"a plan's 'policies' must map module names to policy names, got {policies!r}")
        known["policies"] = dict(policies)
        offloaded = data.get("offloaded", [])
        if not isinstance(offloaded, (list, tuple)) or not all(isinstance(n, str) for n in offloaded):
            raise ValueError(f"a plan's 'offloaded' must be a list of module names, got {offloaded!r}")
        known["offloaded"] = list(offloaded)
        known["offload_limits"] = {str(k): int(v) for k, v in data.get("offload_limits", {}).items()}
        return cls(**known)

    def summary(self, title: str = "Recompute plan") -> str:
        """A readable table: the totals, one row per stage, and memory no recomputation frees
        (rendered by ``lightning_remat.report.render.plan_summary``)."""
        from ..report.render import plan_summary

        return plan_summary(self, title)
