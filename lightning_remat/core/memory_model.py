"""The memory model the solver optimises: plain numbers, no torch.

A training step is a chain of *stages* (candidate blocks, in execution order) between fixed *segments*
(embeddings, head and loss, optimizer step). Under its option stage ``i`` stores ``stored_bytes`` until
its backward and reaches ``local_peak_bytes`` in its own forward or backward; a segment reaches
``peak_bytes`` above the first ``stages_alive`` stages' stored bytes. With ``S_k`` the bytes stored by
the first ``k`` stages,

    peak = max( max_i local_peak_i(o_i) + S_i ,  max_segments peak_bytes + S_stages_alive )

Every term is measured (static memory included) under every option: exact for one option everywhere,
additive in between.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

from .actions import StageAction
from .vocabulary import CostKind


@dataclass(frozen=True)
class Costs:
    """A recompute's cost per ``CostKind``, read as ``costs[kind]``: one field per kind, named as its value.

    Example:
        >>> Costs(time=0.5, flops=10)["flops"], Costs(flops=10) + Costs(roofline=0.5)
        (10, Costs(time=0.0, flops=10, roofline=0.5))
    """

    time: float = 0.0  # measured seconds (a fake profile's: its FLOPs at the target's rate, ``priced``)
    flops: int = 0  # counted FLOPs
    roofline: float = 0.0  # seconds: per op max(FLOPs / peak FLOP/s, bytes / bandwidth)

    def __getitem__(self, kind: Any) -> float:
        return getattr(self, CostKind(kind).value)

    def __add__(self, other: "Costs") -> "Costs":
        return Costs(**{k.value: self[k] + other[k] for k in CostKind})


@dataclass(frozen=True)
class StageOption:
    """One way to run a stage: the action it installs on the stage, and what that costs and stores.

    Example:
        >>> StageOption("whole", StageAction.recompute("h.0"), 1024, 4096, Costs(0.01, 10**9)).costs["flops"]
        1000000000
    """

    name: str
    # What the option does to its stage (``StageAction.stage`` is the stage's name), as its memory run installed it,
    # its offload limit excepted: that is a figure, ``offload_limit``.
    action: StageAction
    stored_bytes: int
    local_peak_bytes: int
    costs: Costs = Costs()
    # The bytes an offload (the stage's saved tensors, or its checkpoint's input) puts in host memory.
    host_bytes: int = 0
    # "offload:hidden": bytes per forward call that go out at most (what the link moves meanwhile); 0: all. A figure
    # the fits scale with the batch, so not in ``action``: the plan's action takes it (``core.predict``).
    offload_limit: int = 0
    # Inputs other checkpoints may hold too (``position_ids``), as (label, bytes), alive once however many hold them
    # (``core.shared_held``); ``held_before``: those an earlier stage held, which ``local_peak_bytes`` counts.
    shared_held: tuple[tuple[str, int], ...] = ()
    held_before: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class StageProfile:
    """A candidate block and its options; ``options[0]`` is always ``"keep"``; the solver reads only these.

    Example:
        >>> keep = StageOption("keep", StageAction("layer.0"), 100, 150)
        >>> StageProfile("layer.0", (keep,), saved_bytes=100).options[0].name
        'keep'
    """

    name: str
    options: tuple[StageOption, ...]
    saved_bytes: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    forward_seconds: float = 0.0
    forward_flops: int = 0
    module_type: str = ""
    # Which run of the module's calls in one step this stage is; a later call takes its first's option (core.calls).
    call: int = 0
    # Runs after the backward of every stage before it (several backwards per step): nothing they stored is alive.
    fresh: bool = False

    def option(self, name: str) -> StageOption:
        for option in self.options:
            if option.name == name:
                return option
        raise KeyError(f"stage {self.name!r} has no option {name!r}; it has {[o.name for o in self.options]}")


@dataclass(frozen=True)
class Segment:
    """A part of the step outside the stages: its peak beyond the stored bytes of the first ``stages_alive`` stages.

    Example:
        >>> Segment("optimizer step", 0, 3 * 2**20).stages_alive
        0
    """

    name: str
    stages_alive: int
    peak_bytes: int
    # How much lower the peak is where the plan already holds the shared inputs ``shared_labels`` (core.shared_held).
    shared_saving: int = 0
    shared_labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class Profile:
    """What the profiler measured of one training step, in the terms of the memory model.

    Example:
        >>> keep = StageOption("keep", StageAction("a"), 100, 150)
        >>> p = Profile(stages=(StageProfile("a", (keep,)),), segments=(), parameter_bytes=10)
        >>> p.static_bytes, Profile.from_dict(p.to_dict()) == p
        (10, True)
    """

    stages: tuple[StageProfile, ...]
    segments: tuple[Segment, ...]
    parameter_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_state_bytes: int = 0
    buffer_bytes: int = 0
    baseline_peak_bytes: int = 0
    # The whole step's costs (forward and backward, nothing recomputed): what an overhead is relative to.
    baseline_costs: Costs = Costs()
    device: str = "cpu"
    notes: tuple[str, ...] = field(default_factory=tuple)
    # A sharded (FSDP2) step (``runtime.targets.sharded``); empty for one device. Byte figures are then per GPU.
    sharding: dict[str, Any] = field(default_factory=dict)
    # Stages that may be recomputed together as one checkpoint (items of one ``nn.Sequential``, ``core.spans``).
    span_groups: tuple[tuple[str, ...], ...] = field(default_factory=tuple)
    # Blocks planned through their children (``runtime.profiling.hierarchy``): a module name and the stages its
    # forward chains, in order; recomputing the block whole is one checkpoint over them (``core.spans``).
    blocks: tuple[tuple[str, tuple[str, ...]], ...] = field(default_factory=tuple)
    # Per optimizer setting (``core.binding``), bytes its step peak would differ by (a fake profile's: lazily).
    optimizer_step_alternatives: dict[str, int] = field(default_factory=dict)
    # The profiled model's parameter shapes and count: ``apply_plan`` refuses the plan on other shapes.
    fingerprint: dict[str, Any] = field(default_factory=dict)
    # Each gap's figures per memory run, for the depth fit only: not compared, saved, nor carried by ``replace``.
    gap_figures: dict[str, Any] | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def static_bytes(self) -> int:
        """Parameters, gradients and optimizer state: memory no recomputation can free."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes + self.buffer_bytes

    @property
    def baseline_activation_bytes(self) -> int:
        """Measured peak of the step without recomputation, minus static memory."""
        return self.baseline_peak_bytes - self.static_bytes

    def with_baseline(self) -> "Profile":
        """This profile with its baseline peak predicted from its terms (nothing recomputed)."""
        return replace(self, baseline_peak_bytes=predict_peak(self, [0] * len(self.stages)))

    def with_gap_figures(self, figures: dict[str, Any] | None) -> "Profile":
        profile = replace(self)
        object.__setattr__(profile, "gap_figures", figures)  # not an __init__ argument: see the field
        return profile

    def noted(self, *notes: str) -> "Profile":
        return replace(self, notes=(*self.notes, *notes))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict; ``Profile.from_dict`` rebuilds an equal profile."""
        data = asdict(replace(self))  # ``replace`` leaves ``gap_figures`` behind
        del data["gap_figures"]
        for stage, saved in zip(self.stages, data["stages"]):
            for option, entry in zip(stage.options, saved["options"]):
                entry["action"] = option.action.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Profile":
        stages = tuple(
            StageProfile(**{**s, "options": tuple(StageOption(**{**o, "action": StageAction.from_dict(o["action"]),
                                                           "costs": Costs(**o["costs"]),
                                                           "shared_held": _pairs(o.get("shared_held", ())),
                                                           "held_before": _pairs(o.get("held_before", ()))})
                                              for o in s["options"])})
            for s in data["stages"]
        )
        segments = tuple(Segment(**{**s, "shared_labels": tuple(s.get("shared_labels", ()))}) for s in data["segments"])
        return cls(**{**data, "stages": stages, "segments": segments, "notes": tuple(data.get("notes", ())),
                      "baseline_costs": Costs(**data["baseline_costs"]),
                      "span_groups": tuple(tuple(g) for g in data.get("span_groups", ())),
                      "blocks": tuple((m, tuple(names)) for m, names in data.get("blocks", ()))})


def seconds_per_flop(seconds: float, flops: float) -> float:
    """Seconds per FLOP of ``flops`` (at least 1) run in ``seconds``: the rate FLOPs become seconds at (``priced``)."""
    return seconds / max(1, flops)


def priced(profile: Profile, rate: float) -> Profile:
    """``profile``'s costs in seconds from its counted FLOPs at ``rate`` seconds per FLOP (``seconds_per_flop``)."""
    stages = tuple(replace(stage, forward_seconds=stage.forward_flops * rate,
                           options=tuple(replace(o, costs=replace(o.costs, time=o.costs.flops * rate))
                                         for o in stage.options))
                   for stage in profile.stages)
    costs = profile.baseline_costs
    return replace(profile, stages=stages, baseline_costs=replace(costs, time=costs.flops * rate))


def restricted(profile: Profile, allowed: Callable[[StageOption], bool]) -> Profile:
    """``profile`` with only the options ``allowed`` accepts; every stage keeps its first, ``"keep"``. Solving it
    plans as if the others had not been offered (what an option buys: the least peak with and without it, from one
    profile).

    Example:
        >>> keep = StageOption("keep", StageAction("a"), 100, 150)
        >>> whole = StageOption("whole", StageAction.recompute("a"), 10, 150, Costs(0.1, 5))
        >>> p = Profile(stages=(StageProfile("a", (keep, whole)),), segments=())
        >>> [o.name for o in restricted(p, lambda o: o.name != "whole").stages[0].options]
        ['keep']
    """
    return replace(profile, stages=tuple(
        replace(s, options=(s.options[0], *(o for o in s.options[1:] if allowed(o)))) for s in profile.stages))


def _pairs(items: Any) -> tuple[tuple[str, int], ...]:
    return tuple((str(label), int(nbytes)) for label, nbytes in items)


@dataclass(frozen=True)
class PeakTerm:
    """One term of the peak formula (``kind``: ``"stage"``, ``"span"`` or ``"segment"``) over the bytes stored before."""

    kind: str
    index: int
    name: str
    own_bytes: int
    stored_bytes: int

    @property
    def bytes(self) -> int:
        return self.own_bytes + self.stored_bytes


def peak_terms(profile: Profile, choices: Sequence[int]) -> list[PeakTerm]:
    """Every term of ``predict_peak`` for ``choices``: stages in order, then segments."""
    if len(choices) != len(profile.stages):
        raise ValueError(f"{len(choices)} choices for {len(profile.stages)} stages")
    prefix = [0]
    starts = episode_starts(profile)
    terms = []
    for i, (stage, choice) in enumerate(zip(profile.stages, choices)):
        option = stage.options[choice]
        terms.append(PeakTerm("stage", i, stage.name, option.local_peak_bytes, prefix[-1] - prefix[starts[i]]))
        prefix.append(prefix[-1] + option.stored_bytes)
    for k, segment in enumerate(profile.segments):
        alive = prefix[segment.stages_alive] - prefix[starts[segment.stages_alive - 1]] if segment.stages_alive else 0
        terms.append(PeakTerm("segment", k, segment.name, segment.peak_bytes, alive))
    return terms


def episode_starts(profile: Profile) -> list[int]:
    """Per stage, the first stage whose stored bytes are alive while it runs (the last ``fresh`` one)."""
    starts, start = [], 0
    for i, stage in enumerate(profile.stages):
        start = i if stage.fresh else start
        starts.append(start)
    return starts


def segment_peaks(profile: Profile) -> dict[int, int]:
    """The largest segment peak per number of stages alive."""
    peaks: dict[int, int] = {}
    for seg in profile.segments:
        peaks[seg.stages_alive] = max(peaks.get(seg.stages_alive, seg.peak_bytes), seg.peak_bytes)
    return peaks


def binding_term(terms: Sequence[PeakTerm]) -> PeakTerm | None:
    """The term that attains the peak (the first of equal ones), None without terms."""
    return max(terms, key=lambda t: t.bytes, default=None)


def predict_peak(profile: Profile, choices: Sequence[int]) -> int:
    """Predicted peak bytes of a step where stage ``i`` runs under option ``choices[i]``."""
    term = binding_term(peak_terms(profile, choices))
    return 0 if term is None else term.bytes
