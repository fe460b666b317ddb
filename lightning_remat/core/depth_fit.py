"""The profile of N identical layers from profiles of 4 and 5. A peak is the higher of a forward and a backward
figure, each linear in the depth, so each copy is profiled with ballast held through forward, then backward, and
each figure extrapolated alone; a misfit makes ``extrapolate`` return None (the caller profiles every layer)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from .actions import StageAction, moved
from .shared_held import without_shared
from .memory_model import Profile, Segment, StageOption, StageProfile, predict_peak
from .profile_algebra import Growth, Term, combine, combine_fields, terms

# The two depths profiled: five points on the middle layers (two, then three) check the three-term linear form.
DEPTHS = (4, 5)


class NoFit(Exception):
    """The profiles do not fit the linear form: the caller profiles the whole model."""


@dataclass(frozen=True)
class Pair:
    """A peak's forward and backward figures."""

    forward: int | None
    backward: int | None


class Fit:
    """Fits every number of the profile on the two depths.

    A middle layer's number is ``α + β N + γ d``: ``β`` static memory per layer, ``γ`` a later layer's
    gradients. Figures are not clamped (FSDP2 makes some negative), so every line is exact.

    Example:
        >>> fit = Fit(12)
        >>> fit.line(10, 13), fit.line(Pair(10, 5), Pair(13, 5)), pair_figures(99 + 7, 3, 99)
        (34, 34, Pair(forward=7, backward=None))
    """

    def __init__(self, layers: int):
        self.layers = layers

    def middle(self, points: dict[tuple[int, int], Any]) -> Callable[[int], Any]:
        """``points[(N, d)]`` for the measured middle layers; returns ``d -> value`` at ``self.layers``."""
        if isinstance(next(iter(points.values())), Pair):
            lines = _per_phase(list(points.values()), lambda figures: self.middle(dict(zip(points, figures))))
            return lambda d: max(line(d) for line in lines)
        a, b = DEPTHS
        beta = points[(b, 1)] - points[(a, 1)]
        gamma = points[(a, 2)] - points[(a, 1)]
        base = points[(a, 1)]
        for (n, d), value in points.items():
            expected = base + beta * (n - a) + gamma * (d - 1)
            # Bytes and FLOPs must fit exactly; seconds (a real profile's timings) to rounding.
            if value != expected and not (isinstance(value, float) and math.isclose(value, expected, rel_tol=1e-6,
                                                                                      abs_tol=1e-12)):
                raise NoFit
        return lambda d: base + beta * (self.layers - a) + gamma * (d - 1)

    def line(self, small: Any, large: Any) -> Any:
        """A number of the first layer, the last, a gap or the whole profile: linear in ``N``."""
        if isinstance(small, Pair):
            return max(_per_phase([small, large], lambda figures: self.line(*figures)))
        return small + (large - small) * (self.layers - DEPTHS[0])

    def boundary(self, term: Term, values: Sequence[Any]) -> Any:
        return self.line(*values)

    def middles(self, points: Sequence[tuple[int, int]]) -> Callable[[Term, Sequence[Any]], Callable[[int], Any]]:
        """``middle`` as a combiner, on values measured at ``points``: each term becomes ``d -> value``."""
        return lambda term, values: self.middle(dict(zip(points, values)))


def _per_phase(pairs: Sequence[Pair], fit: Callable[[list], Any]) -> list:
    """``fit`` of each phase's figures: a phase no pass visits is left out, one visited at some points only (or
    neither phase visited) is NoFit."""
    fitted = []
    for phase in ("forward", "backward"):
        figures = [getattr(pair, phase) for pair in pairs]
        if any(f is None for f in figures) and not all(f is None for f in figures):
            raise NoFit  # a pass visits the region at one depth (or layer) and not at another
        if figures[0] is not None:
            fitted.append(fit(figures))
    if not fitted:
        raise NoFit
    return fitted


def pair_figures(up: int, down: int, ballast: int) -> Pair:
    """A peak's figures less the ballast: None where not lifted (that pass never visited the region); lifted in
    neither run (the optimizer step), both kept."""

    def lifted(value: int) -> int | None:
        # Half the ballast: a lifted figure sits below it where the region's own figure is negative (FSDP2).
        return value - ballast if value >= ballast // 2 else None

    forward, backward = lifted(up), lifted(down)
    if forward is None and backward is None:
        return Pair(up, down)
    # FSDP2 leaves no moment between two late layers in backward: that figure does not exist.
    return Pair(forward, backward)


def extrapolate(forward: tuple[Profile, Profile], backward: tuple[Profile, Profile], ballast: int, prefix: str,
                layers: int) -> Profile | None:
    """The profile of ``layers`` layers from profiles of ``DEPTHS`` layers, or None where it does not fit.

    Args:
        forward: the profiles at ``DEPTHS[0]`` and ``DEPTHS[1]`` layers with ``ballast`` bytes held in forward.
        backward: the same, with the ballast held in backward.
        prefix: the name of the layers' ``ModuleList`` (stages are ``prefix.i``).
    """
    a, b = DEPTHS
    # Stages after the layers (a causal LM's head and loss, ``chunk_loss``) are the same at both depths.
    tails = [s.name for s in forward[0].stages[a:]]
    # Shared inputs counted in every holder (additive): counting once reads figures the ballast changes.
    forward, backward = tuple(map(without_shared, forward)), tuple(map(without_shared, backward))
    for p, q, n in zip(forward, backward, DEPTHS):
        names = [s.name for s in p.stages]
        if any(s.call or s.fresh for s in p.stages):  # layers run several times per step (core.calls): no line
            return None
        if names != [f"{prefix}.{i}" for i in range(n)] + tails or not _same(_skeleton(p), _skeleton(q)):
            return None
        if p.baseline_peak_bytes != predict_peak(p, [0] * len(names)):
            return None
    if forward[0].notes != forward[1].notes or forward[0].device != forward[1].device:
        return None
    fit = Fit(layers)
    try:
        small, large = (_paired(p, q, ballast) for p, q in zip(forward, backward))
        stages = _stages(small, large, prefix, layers, fit)
        gap_runs = tuple(_gap_runs(p, q, ballast) for p, q in zip(forward, backward))
        segments = _segments(small, large, layers, fit, gap_runs)
        top = combine_fields([small, large], fit.boundary, structure=_alike)
    except NoFit:
        return None
    note = (f"extrapolated from profiles of {a} and {b} of the {layers} identical layers of {prefix} (every "
            "forward and backward figure is linear in the depth, checked on the measured layers); "
            "ProfileOptions(repeated_blocks=False) profiles every layer")
    profile = replace(small, **{**top, "stages": stages, "segments": segments, "notes": (*large.notes, note)})
    return profile.with_baseline()


def _skeleton(profile: Profile) -> dict:
    """Everything but the peaks (which the ballast lifts)."""
    return combine([profile], lambda term, values: None if term.quantity.growth is Growth.PEAK else values[0],
                   derive=False).to_dict()


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to a relative 1e-9 (roofline sums' last bits differ between the ballast runs)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# Fields renamed per layer (module names, a gap's stages alive), not fitted or compared.
_RENAMED = {(StageProfile, "name"), (StageOption, "action"), (Segment, "name"), (Segment, "stages_alive")}


def _alike(owner: type, name: str, values: Sequence[Any]) -> Any:
    """Structure of the boundary fits: a renamed field is the larger copy's, anything else must agree."""
    if (owner, name) in _RENAMED:
        return values[-1]
    if any(v != values[0] for v in values[1:]):
        raise NoFit
    return values[0]


def _paired(forward: Profile, backward: Profile, ballast: int) -> Profile:
    """``forward`` with every peak a ``Pair`` of its forward and backward figures."""

    def pair(term: Term, values: Sequence[Any]) -> Any:
        up, down = values
        peak = term.quantity.growth is Growth.PEAK and not term.quantity.derived
        return pair_figures(up, down, ballast) if peak else up

    return combine([forward, backward], pair, derive=False)


def _gap_runs(forward: Profile, backward: Profile, ballast: int) -> dict[str, dict[str, Pair]] | None:
    """Each gap's figures per memory run (``profile.gap_figures``), paired as ``_paired`` pairs peaks."""
    up, down = getattr(forward, "gap_figures", None), getattr(backward, "gap_figures", None)
    if up is None or down is None or up.keys() != down.keys():
        return None
    if any(up[name].keys() != down[name].keys() for name in up):
        return None
    return {name: {run: pair_figures(up[name][run], down[name][run], ballast) for run in up[name]} for name in up}


def _moved(action: StageAction, old: str, new: str) -> StageAction:
    try:
        return moved(action, old, new)
    except ValueError:
        raise NoFit from None


def _renamed(stage: StageProfile, new: str) -> StageProfile:
    """``stage`` as layer ``new``: its name and the modules its options' actions name."""
    options = tuple(replace(o, action=_moved(o.action, stage.name, new)) for o in stage.options)
    return replace(stage, name=new, options=options)


def _stages(small: Profile, large: Profile, prefix: str, layers: int, fit: Fit) -> tuple[StageProfile, ...]:
    a, b = DEPTHS
    # The larger copy's second layer first: the middle layers' structure is its.
    middle = {**{(b, b - 1 - i): large.stages[i] for i in range(1, b - 1)},
              **{(a, a - 1 - i): small.stages[i] for i in range(1, a - 1)}}
    reference = large.stages[1]
    for stage in middle.values():
        if [o.name for o in stage.options] != [o.name for o in reference.options] or \
                stage.module_type != reference.module_type:
            raise NoFit
        if any(_moved(o.action, stage.name, reference.name) != like.action
               for o, like in zip(stage.options, reference.options)):
            raise NoFit
    # Every number a line fitted once (``d -> value``), then read at each middle layer.
    lines = combine(list(middle.values()), fit.middles(list(middle)), derive=False)
    middles = tuple(_renamed(combine([lines], lambda term, line: line[0](layers - 1 - i), derive=False),
                             f"{prefix}.{i}") for i in range(1, layers - 1))
    first = _boundary_stage(small.stages[0], large.stages[0], f"{prefix}.0", fit)
    last = _boundary_stage(small.stages[a - 1], large.stages[b - 1], f"{prefix}.{layers - 1}", fit)
    # A stage after the layers (the head and loss) is fitted in N alone, as the last layer.
    tails = tuple(_boundary_stage(s, t, t.name, fit) for s, t in zip(small.stages[a:], large.stages[b:]))
    return (first, *middles, last, *tails)


def _boundary_stage(s: StageProfile, t: StageProfile, new: str, fit: Fit) -> StageProfile:
    """The first or the last layer from its two copies (``s`` of the smaller), named ``new``."""
    if [o.name for o in s.options] != [o.name for o in t.options]:
        raise NoFit
    if any(_moved(o.action, s.name, t.name) != p.action for o, p in zip(s.options, t.options)):
        raise NoFit
    return _renamed(combine([s, t], fit.boundary, structure=_alike, derive=False), new)


def _roles(profile: Profile, n: int) -> dict[tuple[str, str], list[Segment]]:
    """Segments by role: none, the first, the middle or all stages alive."""
    roles: dict = {}
    for seg in profile.segments:
        k = seg.stages_alive
        role = "zero" if k == 0 else "first" if k == 1 else "last" if k == n else "middle"
        roles.setdefault((role, re.sub(r"\d+", "#", seg.name)), []).append(seg)
    return roles


def _segments(small: Profile, large: Profile, layers: int, fit: Fit, gap_runs: tuple = (None, None)) -> tuple:
    """The segments at ``layers``, in the profile's order: by stages alive, the optimizer step last."""
    a, b = DEPTHS
    rs, rl = _roles(small, a), _roles(large, b)
    if rs.keys() != rl.keys():
        raise NoFit
    runs_at = dict(zip((a, b), gap_runs))
    placed: list[tuple[int, list[Segment]]] = []
    for (role, key), segs in rl.items():
        mine = rs[(role, key)]
        if role == "middle":
            placed.append((2, _middle_segments(mine, segs, layers, fit, runs_at)))
            continue
        if len(mine) != 1 or len(segs) != 1:
            raise NoFit
        placed.append(_boundary_segment(mine[0], segs[0], role == "last", layers, fit, runs_at))
    result = tuple(seg for _, group in sorted(placed, key=lambda kv: kv[0]) for seg in group)
    if len(result) != len(large.segments) + (layers - b):
        raise NoFit
    return result


def _middle_segments(mine: list[Segment], segs: list[Segment], layers: int, fit: Fit,
                     runs_at: dict[int, Any]) -> list[Segment]:
    """The gaps between middle layers at ``layers``: the peak by ``_gap_line``, the rest lines in ``N`` and ``d``."""
    a, b = DEPTHS
    points = {**{(a, a - s.stages_alive): s for s in mine}, **{(b, b - s.stages_alive): s for s in segs}}
    if len(points) != (a - 2) + (b - 2) or len(mine) + len(segs) != len(points):
        raise NoFit
    peak = _gap_line(fit, {k: s.peak_bytes for k, s in points.items()}, _run_points(points, runs_at))
    middles = fit.middles(list(points))
    template = segs[0]
    lines = combine(list(points.values()),
                    lambda term, values: peak if term.quantity.growth is Growth.PEAK else middles(term, values),
                    structure=lambda owner, name, values: getattr(template, name), derive=False)
    return [replace(lines, name=_restate(template.name, template.stages_alive, j), stages_alive=j,
                    **{term.name: getattr(lines, term.name)(layers - j) for term in terms(Segment)})
            for j in range(2, layers)]


def _boundary_segment(s: Segment, t: Segment, last: bool, layers: int, fit: Fit,
                      runs_at: dict[int, Any]) -> tuple[int, list[Segment]]:
    """A segment outside the middle gaps, linear in ``N``, and its place in the profile's order."""
    a, b = DEPTHS
    runs = _run_points({(a, 0): s, (b, 0): t}, runs_at)

    def boundary(term: Term, values: Sequence[Any]) -> Any:
        value = fit.boundary(term, values)
        return _gap_boundary(fit, runs, value) if runs is not None and term.quantity.growth is Growth.PEAK else value

    values = combine_fields([s, t], boundary, structure=_alike)
    alive = layers if last else t.stages_alive
    name = _restate(t.name, t.stages_alive, alive) if last else t.name
    # The profile's order: by stages alive, the optimizer step (added last) last.
    order = layers + 1 if name == "optimizer step" else alive
    return order, [replace(t, **{**values, "name": name, "stages_alive": alive})]


def _run_points(points: dict[tuple[int, int], Segment], gap_runs: dict[int, Any]) -> dict[str, dict] | None:
    """``points`` (``(N, d)`` -> segment) as each memory run's figures, or None where missing or unlike."""
    per_point = {}
    for key, seg in points.items():
        runs = gap_runs.get(key[0])
        if runs is None or seg.name not in runs:
            return None
        per_point[key] = runs[seg.name]
    names = {tuple(r) for r in per_point.values()}
    if len(names) != 1:
        return None
    return {run: {key: figures[run] for key, figures in per_point.items()} for run in next(iter(names))}


def _gap_line(fit: Fit, peaks: dict, runs: dict[str, dict] | None) -> Callable[[int], int]:
    """A middle gap's peak: the largest of each memory run's own line (their maximum is no line)."""
    if runs is not None:
        try:
            lines = [fit.middle(points) for points in runs.values()]
            return lambda d: max(line(d) for line in lines)
        except NoFit:
            pass
    return fit.middle(peaks)


def _gap_boundary(fit: Fit, runs: dict[str, dict], fallback: int) -> int:
    """A first or last gap's peak, as ``_gap_line`` does it, linear in ``N``."""
    a, b = DEPTHS
    try:
        return max(fit.line(points[(a, 0)], points[(b, 0)]) for points in runs.values())
    except NoFit:
        return fallback


def _restate(name: str, old: int, new: int) -> str:
    return name.replace(f"({old} stored)", f"({new} stored)")
