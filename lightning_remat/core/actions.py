"""What a plan does with one stage (``StageAction``), and the rules each behaviour adds (``add_rule``) that make
a set of actions installable together (``check_actions``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from .errors import InvalidPlanError
from .vocabulary import Action, Policy, check_chunks


@dataclass(frozen=True)
class StageAction:
    """What a plan does with one stage.

    Attributes:
        stage: the stage's module name (as in ``model.named_modules()``).
        action: ``Action.KEEP``, ``RECOMPUTE``, ``SEGMENT``, ``OFFLOAD``, ``CHUNK`` or ``FUSE`` (or their strings).
        modules: with ``RECOMPUTE``, the modules whose forward runs again: the stage (default) or some children.
        policy: with ``RECOMPUTE``, the selective-checkpointing policy of the recompute; None: the whole forward.
        segment: with ``SEGMENT``, every stage of the segment in order (items of one ``nn.Sequential``).
        offload_limit: with ``OFFLOAD``, the bytes offloaded at most per forward call; None: all.
        chunks: with ``CHUNK`` or ``FUSE`` (a causal LM's head with its loss), the number of sequence chunks.
        offload_input: with ``RECOMPUTE``, each recomputed module's checkpoint input goes to host memory.
        extra: settings of behaviours registered outside the package, by behaviour name.

    Example:
        >>> StageAction.from_dict(StageAction.offload("h.1", limit=2**20).to_dict())
        StageAction(stage='h.1', action=<Action.OFFLOAD: 'offload'>, modules=(), policy=None, segment=(), offload_limit=1048576, chunks=None, offload_input=False, extra=())
    """

    stage: str
    action: Action = Action.KEEP
    modules: tuple[str, ...] = ()
    policy: Policy | None = None
    segment: tuple[str, ...] = ()
    offload_limit: int | None = None
    chunks: int | None = None
    offload_input: bool = False
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.stage, str):
            raise ValueError(f"a stage is named by a string, got {self.stage!r}")
        action = Action.check(self.action)
        modules = module_names("modules", self.modules)
        segment = module_names("segment", self.segment)
        if action is Action.RECOMPUTE and not modules:
            modules = (self.stage,)
        if modules and action is not Action.RECOMPUTE:
            raise ValueError(f"stage {self.stage!r}: only a recomputed stage names modules to recompute, got "
                             f"{list(modules)} with action {action.value!r}")
        if self.policy is not None and action is not Action.RECOMPUTE:
            raise ValueError(f"stage {self.stage!r}: only a recomputed stage has a policy, got {str(self.policy)!r} "
                             f"with action {action.value!r}")
        if (action is Action.SEGMENT) != bool(segment) or (segment and self.stage not in segment):
            raise ValueError(f"stage {self.stage!r}: a segment's stage names the segment it is in, got {list(segment)} "
                             f"with action {action.value!r}")
        limit = self.offload_limit
        if limit is not None and (action is not Action.OFFLOAD or isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 0):
            raise ValueError(f"stage {self.stage!r}: an offload limit is bytes >= 0 of an offloaded stage, got "
                             f"{limit!r} with action {action.value!r}")
        if (action in (Action.CHUNK, Action.FUSE)) != (self.chunks is not None):
            raise ValueError(f"stage {self.stage!r}: a chunked head (and only it) has a number of chunks, got "
                             f"{self.chunks!r} with action {action.value!r}")
        if self.chunks is not None:
            check_chunks(self.chunks)
        if self.offload_input not in (True, False) or (self.offload_input and action is not Action.RECOMPUTE):
            raise ValueError(f"stage {self.stage!r}: only a recomputed stage offloads its checkpoint input, got "
                             f"offload_input={self.offload_input!r} with action {action.value!r}")
        extra = dict(self.extra)
        if not all(isinstance(k, str) for k in extra):
            raise ValueError(f"stage {self.stage!r}: extra settings are named by behaviour names, got {extra!r}")
        # An offload limit of 0 bytes is no limit.
        for name, value in dict(extra=tuple(sorted(extra.items())), offload_input=bool(self.offload_input),
                                action=action, modules=modules, segment=segment, offload_limit=limit or None,
                                policy=None if self.policy is None else Policy.check(self.policy)).items():
            object.__setattr__(self, name, value)

    @classmethod
    def recompute(cls, stage: str, modules: Sequence[str] = (), policy: Policy | str | None = None,
                  offload_input: bool = False, extra: Any = ()) -> "StageAction":
        return cls(stage, Action.RECOMPUTE, modules=tuple(modules), policy=policy or None, offload_input=offload_input,
                   extra=extra)

    @classmethod
    def in_segment(cls, stage: str, segment: Sequence[str]) -> "StageAction":
        return cls(stage, Action.SEGMENT, segment=tuple(segment))

    @classmethod
    def offload(cls, stage: str, limit: int | None = None) -> "StageAction":
        return cls(stage, Action.OFFLOAD, offload_limit=limit or None)

    @classmethod
    def chunk(cls, stage: str, chunks: int) -> "StageAction":
        return cls(stage, Action.CHUNK, chunks=chunks)

    @classmethod
    def fuse(cls, stage: str, chunks: int) -> "StageAction":
        return cls(stage, Action.FUSE, chunks=chunks)

    def to_dict(self) -> dict[str, Any]:
        """Plain strings, lists and ints; ``chunks``, ``offload_input`` and ``extra`` only where set."""
        data = {"stage": self.stage, "action": self.action.value, "modules": list(self.modules),
                "policy": None if self.policy is None else self.policy.value, "segment": list(self.segment),
                "offload_limit": self.offload_limit}
        if self.chunks is not None:
            data["chunks"] = self.chunks
        if self.offload_input:
            data["offload_input"] = True
        if self.extra:
            data["extra"] = dict(self.extra)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StageAction":
        if not isinstance(data, Mapping) or "stage" not in data:
            raise ValueError(f"a plan's action is a dict with a 'stage', got {data!r}")
        return cls(data["stage"], data.get("action", Action.KEEP), modules=data.get("modules") or (),
                   policy=data.get("policy"), segment=data.get("segment") or (),
                   offload_limit=data.get("offload_limit"), chunks=data.get("chunks"),
                   offload_input=data.get("offload_input", False), extra=data.get("extra") or ())


def module_names(what: str, names: Any) -> tuple[str, ...]:
    """``names`` as a tuple of module names, or a ValueError saying what a plan's ``what`` must be."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise ValueError(f"a plan's {what!r} must be a list of module names, got {names!r}")
    names = tuple(names)
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"a plan's {what!r} must be a list of module names, got {list(names)!r}")
    return names


def moved(action: StageAction, old: str, new: str) -> StageAction:
    """``action`` with the module names it holds under ``old`` (its stage's) named under ``new``; ValueError for a
    name outside ``old``.

    Example:
        >>> moved(StageAction.recompute("h.0", ["h.0.mlp"]), "h.0", "h.7").modules
        ('h.7.mlp',)
    """
    def name(module: str) -> str:
        if module != old and not nested_in(module, old):
            raise ValueError(f"{module!r} is not {old!r} nor inside it")
        return new + module[len(old):]
    return replace(action, stage=name(action.stage), modules=tuple(map(name, action.modules)),
                   segment=tuple(map(name, action.segment)))


def nested_in(inner: str, outer: str) -> bool:
    """Whether module ``inner`` lies inside module ``outer`` (by name; everything but ``""`` lies inside ``""``)."""
    return inner != outer and (outer == "" or inner.startswith(outer + "."))


def refuse_nested(names: Sequence[str], what: str) -> None:
    """Raise ``InvalidPlanError`` naming each pair of ``names`` where one lies inside the other."""
    pairs = [(inner, outer) for inner in names for outer in names if nested_in(inner, outer)]
    if pairs:
        shown = "; ".join(f"{inner!r} inside {outer!r}" + (" (the model itself)" if outer == "" else "")
                          for inner, outer in pairs)
        raise InvalidPlanError(f"plan {what} a module and another one inside it, which would nest one inside the "
                               f"other: {shown}. Name one of each pair")


def overlaps(name: str, names: Iterable[str]) -> bool:
    """Whether module ``name`` is one of ``names``, lies inside one, or holds one."""
    return any(name == t or nested_in(name, t) or nested_in(t, name) for t in names)


Rule = Callable[[Sequence[StageAction]], None]
RULES: list[Rule] = []


def add_rule(rule: Rule) -> Rule:
    """Make ``check_actions`` run ``rule`` (once, after the rules added before it); returns it."""
    if rule not in RULES:
        RULES.append(rule)
    return rule


def check_actions(actions: Sequence[StageAction]) -> None:
    """Raise ``InvalidPlanError`` unless every rule passes (the installer checks the names against the model)."""
    for rule in RULES:
        rule(actions)


def _recomputed(actions: Sequence[StageAction]) -> list[str]:
    return [m for a in actions if a.action is Action.RECOMPUTE for m in a.modules]


def _segmented(actions: Sequence[StageAction]) -> list[str]:
    return [s for a in actions if a.action is Action.SEGMENT for s in a.segment]


@add_rule
def _recompute_rule(actions: Sequence[StageAction]) -> None:
    recomputed = _recomputed(actions)
    if len(set(recomputed)) != len(recomputed):
        raise InvalidPlanError(f"plan names a module twice: {recomputed}")
    refuse_nested(recomputed, "recomputes")


@add_rule
def _segment_rule(actions: Sequence[StageAction]) -> None:
    segments = list(dict.fromkeys(a.segment for a in actions if a.action is Action.SEGMENT))
    taken: set[str] = set()
    for segment in segments:
        overlap = taken & set(segment)
        if overlap or len(set(segment)) != len(segment):
            raise InvalidPlanError(f"plan names module(s) {sorted(overlap or segment)} in two segments")
        taken.update(segment)
    members = {a.stage: a.segment for a in actions if a.action is Action.SEGMENT}
    for segment in segments:
        missing = [s for s in segment if members.get(s) != segment]
        if missing:
            raise InvalidPlanError(f"segment {list(segment)}: stage(s) {missing} do not have that segment's action")
    for name in _recomputed(actions):
        if overlaps(name, taken):
            raise InvalidPlanError(f"plan recomputes {name!r} alone and as part of a segment")


@add_rule
def _offload_rule(actions: Sequence[StageAction]) -> None:
    offloaded = [a.stage for a in actions if a.action is Action.OFFLOAD]
    if len(set(offloaded)) != len(offloaded):
        raise InvalidPlanError(f"offload names a module twice: {offloaded}")
    refuse_nested(offloaded, "offloads")
    both = [n for n in offloaded if overlaps(n, [*_recomputed(actions), *_segmented(actions)])]
    if both:
        raise InvalidPlanError(f"module(s) {both} are both recomputed and offloaded: a module is one or the other")


@add_rule
def _chunk_rule(actions: Sequence[StageAction]) -> None:
    chunked = [a.stage for a in actions if a.action in (Action.CHUNK, Action.FUSE)]
    touched = [*_recomputed(actions), *_segmented(actions), *(a.stage for a in actions if a.action is Action.OFFLOAD)]
    clash = [n for n in chunked if overlaps(n, touched)]
    if clash or len(set(chunked)) != len(chunked):
        raise InvalidPlanError(f"a chunked head is neither recomputed, offloaded nor chunked twice: {clash or chunked}")


@add_rule
def _one_action_per_stage(actions: Sequence[StageAction]) -> None:
    stages = [a.stage for a in actions]
    twice = sorted({s for s in stages if stages.count(s) > 1})
    if twice:
        raise InvalidPlanError(f"a plan has one action per stage; stage(s) {twice} have several")
