"""Combine aligned profiles number by number with a *combiner* ``(term, values) -> value`` (the batch, depth and
shape fits, the rank merge): ``combine`` walks every field, so a new numeric field needs no list kept in sync."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any, Callable, Mapping, Sequence

from .errors import UnsupportedShardingError
from .memory_model import Costs, Profile, Segment, StageOption, StageProfile


class Unit(Enum):
    """What a number counts, which says how a combined value is stored."""

    BYTES = "bytes"  # an int, rounded up: a byte short is a prediction below the truth
    COUNT = "count"  # an int (FLOPs), rounded
    SECONDS = "seconds"  # a float


class Growth(Enum):
    """How a number changes with the batch size."""

    STATIC = "static"  # parameters, gradients, optimizer state, buffers: the same at any batch
    PER_SAMPLE = "per sample"  # activations, costs: in proportion to the batch, zero without one
    PEAK = "peak"  # a peak counts the static memory under it: static plus a part that grows


@dataclass(frozen=True)
class Quantity:
    """What one numeric field of a profile is.

    Args:
        signed: whether it may be below zero (the model's terms are measured differences, never clamped).
        derived: computed from the rest of the node after the other fields (the baseline peak: ``with_baseline``).
    """

    unit: Unit
    growth: Growth = Growth.PER_SAMPLE
    signed: bool = False
    derived: bool = False

    def coerce(self, value: float) -> int | float:
        """``value`` as stored: bytes rounded up, counts rounded, never below zero unless ``signed``."""
        if self.unit is Unit.SECONDS:
            return value if self.signed else max(0.0, value)
        number = int(math.ceil(value)) if self.unit is Unit.BYTES else round(value)
        return number if self.signed else max(0, number)


# Every numeric field not named here is a per-sample figure, never below zero, in the unit its type says.
_STATIC = Quantity(Unit.BYTES, Growth.STATIC)
_DECLARED: dict[tuple[type, str], Quantity | None] = {
    **{(Profile, name): _STATIC for name in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes",
                                              "buffer_bytes")},
    (StageOption, "stored_bytes"): Quantity(Unit.BYTES, signed=True),
    (StageOption, "local_peak_bytes"): Quantity(Unit.BYTES, Growth.PEAK, signed=True),
    (Segment, "peak_bytes"): Quantity(Unit.BYTES, Growth.PEAK, signed=True),
    (Profile, "baseline_peak_bytes"): Quantity(Unit.BYTES, Growth.PEAK, signed=True, derived=True),
    # Which stages are alive while the segment runs: part of what the segment is, not a measure.
    (Segment, "stages_alive"): None,
    # Shared inputs (``core.shared_held``, ``position_ids``): a fixed size at any batch and depth, never scaled.
    (Segment, "shared_saving"): None,
    # Which run of its module's calls a stage is (``core.calls``): identity, not a measure.
    (StageProfile, "call"): None,
}


class Missing(Enum):
    """What becomes of a child (an option, a segment) that some of the inputs lack."""

    REFUSE = "refuse"  # a ValueError
    DROP = "drop"  # left out of the result
    KEEP = "keep"  # combined from the inputs that have it (the combiner sees None for the others)


# Nodes that hold others, by child type: the fields that line a child up (None: by position), and a missing one.
_CHILDREN: dict[type, tuple[tuple[str, ...] | None, Missing]] = {
    # Stages by position: every job checks that the inputs have the same stages.
    StageProfile: (None, Missing.REFUSE),
    # An option only some profiles measured cannot be fitted: it is not offered.
    StageOption: (("name",), Missing.DROP),
    # A segment only some profiles have (a calibration one rank needed) is still part of the step.
    Segment: (("name", "stages_alive"), Missing.KEEP),
}


@dataclass(frozen=True)
class Term:
    """One numeric field of one node type, as a combiner sees it."""

    owner: type
    name: str
    quantity: Quantity


Combiner = Callable[[Term, Sequence[Any]], Any]
Structure = Callable[[type, str, Sequence[Any]], Any]


def check_same_stages(nodes: Mapping[Any, Profile]) -> None:
    """ValueError unless ``nodes`` (a fit's profiles by where they were measured) has one, and all the first's stages."""
    if not nodes:
        raise ValueError("a fit needs at least one profile")
    names = [s.name for s in next(iter(nodes.values())).stages]
    for at, profile in nodes.items():
        if [s.name for s in profile.stages] != names:
            raise ValueError(f"the profile at {at} has other stages than the first: "
                             f"{[s.name for s in profile.stages]} vs {names}")


def _type_name(annotation: Any) -> str:
    # ``from __future__ import annotations`` keeps annotations as strings.
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))


def quantity(owner: type, name: str) -> Quantity | None:
    """What the field ``name`` of ``owner`` (a profile dataclass, or a subclass) is; None for structure."""
    for cls in owner.__mro__:
        if (cls, name) in _DECLARED:
            return _DECLARED[(cls, name)]
    declared = {f.name: f.type for f in fields(owner)}
    if name not in declared:
        raise KeyError(f"{owner.__name__} has no field {name!r}")
    annotation = _type_name(declared[name])
    if annotation == "float":
        return Quantity(Unit.SECONDS)
    if annotation == "int":
        return Quantity(Unit.COUNT if name.endswith("flops") else Unit.BYTES)
    return None


@functools.cache
def _layout(owner: type) -> tuple[tuple[str, Term | None, type | None], ...]:
    """Every field of ``owner``: its name, its term (None: structure) and the child type it holds."""
    layout = []
    for f in (f for f in fields(owner) if f.init):  # not what a node carries for one reader (gap_figures)
        annotation = _type_name(f.type)
        child = Costs if annotation == "Costs" else next(  # Costs: one node, combined with the node holding it
            (c for c in _CHILDREN if annotation == f"tuple[{c.__name__}, ...]"), None)
        kind = None if child is not None else quantity(owner, f.name)
        layout.append((f.name, None if kind is None else Term(owner, f.name, kind), child))
    return tuple(layout)


def terms(owner: type) -> tuple[Term, ...]:
    """The numeric fields of ``owner``, in declaration order."""
    return tuple(term for _, term, _ in _layout(owner) if term is not None)


def first_present(owner: type, name: str, values: Sequence[Any]) -> Any:
    """The default structure policy: a structural field (a name, a policy) is the first input's."""
    return values[0]


def largest(term: Term, values: Sequence[Any]) -> Any:
    """The combiner of the rank merge: the largest value of the inputs that have the field."""
    return max(v for v in values if v is not None)


def merge_profiles(profiles: list[Profile]) -> Profile:
    """One profile whose every numeric term is the largest of the ranks', so a plan within budget fits every rank."""
    first = profiles[0]
    shape = [(s.name, [o.name for o in s.options]) for s in first.stages]
    for other in profiles[1:]:
        if [(s.name, [o.name for o in s.options]) for s in other.stages] != shape:
            raise UnsupportedShardingError(
                "the ranks profiled different stages or options (different control flow, or batches of different "
                "shapes): give every rank a batch of the same shape while planning, or pass candidates=")
    merged = combine(profiles, largest)
    if len(profiles) > 1:
        merged = replace(merged, notes=(*first.notes, f"profiled on each of {len(profiles)} ranks in lockstep (the model is sharded); "
                        "every term is the largest over the ranks, so the budget is per rank"))
    return merged


def combine_fields(nodes: Sequence[Any], combiner: Combiner, structure: Structure = first_present) -> dict[str, Any]:
    """The fields of one node, children excepted, combined from aligned ``nodes`` (None: lacking it); structure
    through ``structure`` (left out under ``first_present``)."""
    present = [n for n in nodes if n is not None]
    owner = type(present[0])
    out = {}
    for name, term, child in _layout(owner):
        if child is Costs:
            out[name] = combine([None if n is None else getattr(n, name) for n in nodes], combiner, structure=structure)
        if child is not None:
            continue
        if term is None:
            if structure is not first_present:  # else the node is built on the first present one
                out[name] = structure(owner, name, [getattr(n, name) for n in present])
        else:
            out[name] = combiner(term, [None if n is None else getattr(n, name) for n in nodes])
    return out


def combine(nodes: Sequence[Any], combiner: Combiner, *, structure: Structure = first_present,
            derive: bool = True) -> Any:
    """One node combined from aligned ``nodes``, children lined up as ``_CHILDREN`` says (ValueError where they
    cannot be); derived figures recomputed unless ``derive`` is False.

    Example:
        >>> opt = lambda name, stored: StageOption(name, StageAction("a"), stored, 2 * stored)
        >>> from lightning_remat.core.actions import StageAction
        >>> low = StageProfile("a", (opt("keep", 10), opt("whole", 1)))
        >>> high = StageProfile("a", (opt("keep", 30),))
        >>> [(o.name, o.stored_bytes) for o in combine([low, high], largest).options]  # "whole": only in low
        [('keep', 30)]
    """
    present = [n for n in nodes if n is not None]
    owner = type(present[0])
    values = combine_fields(nodes, combiner, structure)
    for name, _, child in _layout(owner):
        if child in _CHILDREN:
            groups = _align([() if n is None else getattr(n, name) for n in nodes], child)
            values[name] = tuple(combine(group, combiner, structure=structure, derive=derive) for group in groups)
    node = replace(present[0], **values)
    # A profile's one derived figure, its baseline peak, from its combined terms.
    return node.with_baseline() if derive and isinstance(node, Profile) else node


def _align(collections: Sequence[Sequence[Any]], child: type) -> list[list[Any]]:
    """One list per child, aligned with the inputs (None where an input lacks it)."""
    keys, missing = _CHILDREN[child]
    if keys is None:
        if len({len(items) for items in collections}) > 1:
            raise ValueError(f"the inputs have different numbers of {child.__name__}: "
                             f"{[len(items) for items in collections]}")
        return [list(group) for group in zip(*collections)]
    groups: dict[tuple, list] = {}
    for i, items in enumerate(collections):
        for item in items:
            group = groups.setdefault(tuple(getattr(item, k) for k in keys), [None] * len(collections))
            if group[i] is not None:
                raise ValueError(f"two {child.__name__}s of one input share {({k: getattr(item, k) for k in keys})}")
            group[i] = item
    aligned = list(groups.values())
    if missing is not Missing.KEEP and any(None in group for group in aligned):
        if missing is Missing.REFUSE:
            raise ValueError(f"some inputs lack a {child.__name__} others have")
        aligned = [group for group in aligned if None not in group]
    return aligned
