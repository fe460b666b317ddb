"""The plan: one typed action per stage and its predicted figures; the names it shows (``checkpointed``,
``policies``, ...) are read from its actions."""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Mapping

from .actions import StageAction, check_actions, module_names
from .errors import PlanFormatError
from .plan_checks import check_plan_dict, check_saved_state
from .plan_text import plan_text
from .shapes import Shape
from .vocabulary import Action, CostKind

__all__ = ["Plan", "StageAction", "StageChoice", "check_actions", "saved_plan", "saved_plans", "saved_state_plans"]


@dataclass(frozen=True)
class StageChoice:
    """The option chosen for one stage and its figures.

    Example:
        >>> StageChoice("transformer.h.0", "whole", 4096, 1024, 0.01).option
        'whole'
    """

    stage: str
    option: str
    baseline_stored_bytes: int
    stored_bytes: int
    cost: float


def _figure(value: Any, kind: type) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return kind(value)


# What ``to_dict`` writes for readers of the dict (plan.json, older versions): read from the actions.
_DERIVED = ("checkpointed", "segments", "policies", "offloaded", "offload_limits")


def _read(name: str, value: Any) -> Any:
    if name in ("checkpointed", "offloaded"):
        return list(module_names(name, value))
    if name == "segments":
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise ValueError(f"a plan's 'segments' must be a list of lists of module names, got {value!r}")
        return [list(module_names("segments", s)) for s in value]
    # "policies", "offload_limits": mappings (``check_plan_dict`` checked them)
    return {str(k): v if name == "policies" else int(v) for k, v in value.items()}


@dataclass(frozen=True)
class Plan:
    """A plan for one model under one budget; figures are None where not predicted. ``fingerprint``: what
    ``apply_plan`` checks (docs/plans.md); ``binding``: what binds the predicted peak.

    Example:
        >>> plan = Plan([StageAction.recompute("h.0")], budget_bytes=2**30, baseline_peak_bytes=2**31,
        ...             predicted_peak_bytes=2**30 - 1, predicted_overhead=0.1)
        >>> Plan.from_dict(plan.to_dict()) == plan, plan.checkpointed
        (True, ['h.0'])
    """

    actions: tuple[StageAction, ...] = ()
    budget_bytes: int | None = None
    baseline_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_overhead: float | None = None
    cost_kind: CostKind = CostKind.TIME
    requested_budget: str = ""
    choices: tuple[StageChoice, ...] = ()
    parameter_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_state_bytes: int = 0
    notes: tuple[str, ...] = ()
    fingerprint: dict[str, Any] = field(default_factory=dict)
    sharding: dict[str, Any] = field(default_factory=dict)
    host_bytes: int = 0
    # A description of the predicted figures: a plan saved before it existed (or sent without it) is the same plan.
    binding: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        actions = tuple(self.actions)
        if not all(isinstance(a, StageAction) for a in actions):
            raise TypeError(f"a plan's actions are StageActions, got {actions!r}")
        values = dict(
            {n: _figure(getattr(self, n), int) for n in ("budget_bytes", "baseline_peak_bytes", "predicted_peak_bytes")},
            **{n: int(getattr(self, n)) for n in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "host_bytes")},
            actions=actions, predicted_overhead=_figure(self.predicted_overhead, float),
            cost_kind=CostKind.check(self.cost_kind), requested_budget=str(self.requested_budget),
            choices=tuple(c if isinstance(c, StageChoice) else StageChoice(**c) for c in self.choices),
            notes=tuple(str(n) for n in self.notes), fingerprint=dict(self.fingerprint or {}),
            sharding=dict(self.sharding or {}),
            binding=copy.deepcopy(dict(self.binding)) if self.binding is not None else None)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def checkpointed(self) -> list[str]:
        """Names of the modules recomputed alone (in the plan's order)."""
        return [m for a in self.actions for m in a.modules]

    @property
    def policies(self) -> dict[str, str]:
        """Per recomputed module that has one, its op-level policy's name."""
        return {m: a.policy.value for a in self.actions if a.policy is not None for m in a.modules}

    @property
    def segments(self) -> list[list[str]]:
        """Runs of consecutive stages (items of one nn.Sequential) recomputed as ONE checkpoint each."""
        return [list(s) for s in dict.fromkeys(a.segment for a in self.actions if a.action is Action.SEGMENT)]

    @property
    def offloaded(self) -> list[str]:
        """Modules whose saved tensors go to host memory during forward and come back for backward."""
        return [a.stage for a in self.actions if a.action is Action.OFFLOAD]

    @property
    def offload_limits(self) -> dict[str, int]:
        """Per offloaded module with a limit, the bytes it offloads at most per forward call."""
        return {a.stage: a.offload_limit for a in self.actions if a.offload_limit is not None}

    @property
    def chunked_loss(self) -> dict[str, int]:
        """Per chunked head (recomputed or fused), its number of sequence chunks."""
        return {a.stage: a.chunks for a in self.actions if a.chunks is not None}

    @property
    def fused_loss(self) -> dict[str, int]:
        """The heads of ``chunked_loss`` fused (each chunk's gradients computed in forward)."""
        return {a.stage: a.chunks for a in self.actions if a.action is Action.FUSE}

    @property
    def offloaded_inputs(self) -> list[str]:
        """Recomputed modules whose checkpoint input goes to host memory (``StageAction.offload_input``)."""
        return [m for a in self.actions if a.offload_input for m in a.modules]

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(a.stage for a in self.actions)

    @property
    def stage_order(self) -> tuple[str, ...] | None:
        """Every stage in execution order (None without a profile): offloading works one stage ahead."""
        # The choices, not the actions: a block recomputed whole is one action for all its stages.
        return tuple(c.stage for c in self.choices) if self.choices else None

    @property
    def fallback(self) -> bool:
        return self.predicted_peak_bytes is None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (with the names the actions say); ``Plan.from_dict`` rebuilds an equal plan."""
        data = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}
        data.update(actions=[a.to_dict() for a in self.actions], choices=[asdict(c) for c in self.choices],
                    notes=list(self.notes), cost_kind=self.cost_kind.value, fallback=self.fallback,
                    **{name: getattr(self, name) for name in _DERIVED})
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """The plan of a dict from ``to_dict``, every field checked first (``PlanFormatError`` names a bad one)."""
        check_plan_dict(data)
        if not isinstance(data.get("actions"), (list, tuple)):
            raise ValueError(f"a plan's 'actions' must be a list of actions, got {data.get('actions')!r}")
        common = {f.name: data[f.name] for f in fields(cls) if f.name in data and f.name != "actions"}
        plan = cls([StageAction.from_dict(a) for a in data["actions"]], **common)
        disagree = [name for name in _DERIVED if name in data and _read(name, data[name]) != getattr(plan, name)]
        if disagree:
            raise ValueError(f"a plan's {', '.join(repr(n) for n in disagree)} disagree(s) with its 'actions'")
        return plan

    def summary(self, title: str = "Recompute plan") -> str:
        """A readable text: the totals, one row per stage, and memory no recomputation frees."""
        return plan_text(self, title)


def saved_plans(state: Any, owner: str) -> tuple[Plan | None, list[tuple[Shape, Plan]]]:
    """An integration's checkpoint state: its ``plan``, and its ``plans`` as (shape, plan), all checked first."""
    check_saved_state(state, owner)
    return saved_plan(state.get("plan"), owner), [
        (Shape(int(entry[0]), int(entry[1]), entry[3] if len(entry) == 4 else ()),
         saved_plan(entry[2], owner, f"plans[{i}]")) for i, entry in enumerate(state.get("plans", []))]


def saved_state_plans(plans: Mapping[Shape, Plan]) -> list[list]:
    """Plans per shape as a checkpoint keeps them: ``[batch size, sequence length, plan's dict, (layout)]``."""
    return [[shape.batch_size, shape.seq_len, plan.to_dict(), *shape.to_list()[2:]] for shape, plan in plans.items()]


def saved_plan(data: Any, owner: str, where: str = "plan") -> Plan | None:
    """The plan of ``data`` (None for None); an error names ``owner``'s ``where`` it came from."""
    if data is None:
        return None
    try:
        return Plan.from_dict(data)
    except PlanFormatError as error:
        error.add_hint(f"(in {owner} {where!r})")
        raise
    except (ValueError, TypeError) as error:
        raise PlanFormatError(where, data, f"a plan's dict ({error})", owner) from None
