"""The shape fits: a profile at any batch shape (``ShapeFit``, docs/shapes.md) or at any sequence length, the batch
fixed (``LengthFit``, docs/seq_len.md), from profiles at a few (the *nodes*, each exact).

Memory is a polynomial in ``b``, ``b * s`` and ``b * s**2`` with non-negative coefficients, so a chord between
nodes lies above the peak; outside the nodes the least-squares law only predicts. At one batch size every term has
degree at most two in ``s`` (attention's score matrices on the math path grow with ``s**2``), so the parabola
through three profiled lengths predicts any other; ``find_remat_seq_len`` profiles the lengths its answer rests on,
so predictions only steer its search.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace
from typing import Mapping, Sequence

import numpy as np

from .memory_model import Profile, StageOption, restricted
from .profile_algebra import Growth, Term, Unit, check_same_stages, combine
from .shapes import Shape, ladder_down, ladder_up


class NodeWeights:
    """Each term as ``offset + sum(w * (value - offset))`` (``offset``: ``static_bytes`` for a peak, else 0); a
    node that lacks the term is left out, the others rescaled."""

    def __init__(self, weights: Sequence[float], static_bytes: int):
        self.weights = tuple(float(w) for w in weights)
        self.static_bytes = static_bytes

    def __call__(self, term: Term, values: Sequence[float | None]) -> float:
        kind = term.quantity
        if kind.growth is Growth.STATIC:
            return values[0]
        present = [(w, v) for w, v in zip(self.weights, values) if v is not None]
        total, kept = sum(self.weights), sum(w for w, _ in present)
        scale = total / kept if kept else 0.0
        offset = float(self.static_bytes) if kind.growth is Growth.PEAK else 0.0
        return kind.coerce(offset + sum(w * scale * (v - offset) for w, v in present))


def _bracket(values: Sequence[int], x: int) -> list[tuple[int, float]] | None:
    """``x`` as a convex combination of its neighbours in sorted ``values``; None outside them."""
    i = bisect.bisect_left(values, x)
    if i < len(values) and values[i] == x:
        return [(x, 1.0)]
    if i == 0 or i == len(values):
        return None
    low, high = values[i - 1], values[i]
    share = (x - low) / (high - low)
    return [(low, 1.0 - share), (high, share)]


def _family(nodes: Sequence[Shape], target: Shape) -> list[Shape]:
    return [node for node in nodes if node.layout == target.layout]


def chord_weights(nodes: Sequence[Shape], target: Shape) -> dict[Shape, float] | None:
    """Weights (>= 0, sum 1) of ``target`` between ``nodes`` of its layout (None: not bracketed)."""
    by_batch: dict[int, list[int]] = {}
    for node in _family(nodes, target):
        by_batch.setdefault(node.batch_size, []).append(node.seq_len)
    usable = sorted(b for b, lengths in by_batch.items() if _bracket(sorted(lengths), target.seq_len) is not None)
    across = _bracket(usable, target.batch_size)
    if across is None:
        return None
    weights: dict[Shape, float] = {}
    for batch, batch_share in across:
        for seq, seq_share in _bracket(sorted(by_batch[batch]), target.seq_len) or ():
            node = Shape(batch, seq, target.layout)
            weights[node] = weights.get(node, 0.0) + batch_share * seq_share
    return {shape: w for shape, w in weights.items() if w > 0}


def _law_features(shape: Shape) -> np.ndarray:
    b, s = float(shape.batch_size), float(shape.seq_len)
    return np.array([1.0, b, b * s, b * s * s])


def law_weights(nodes: Sequence[Shape], target: Shape) -> dict[Shape, float] | None:
    """Weights of the least-squares law ``c + b * (alpha + beta * s + gamma * s**2)`` at ``target``, or None."""
    nodes = _family(nodes, target)
    if len(nodes) < 4:
        return None
    features = np.array([_law_features(n) for n in nodes])
    # Columns scaled to one, so that b * s**2 (10**6 and more) and 1 are solved alike.
    scale = np.abs(features).max(axis=0)
    if np.linalg.matrix_rank(features / scale) < 4:
        return None
    weights = (_law_features(target) / scale) @ np.linalg.pinv(features / scale)
    return {node: float(w) for node, w in zip(nodes, weights)}


def _scaled_weights(nodes: Sequence[Shape], target: Shape) -> dict[Shape, float]:
    """The nearest node, scaled by the steepest growth a term has (batch, squared sequence)."""
    family = _family(nodes, target)
    nearest = min(family or nodes, key=lambda n: (abs(math.log(target.elements / n.elements)), n))
    per_sample = (target.elements / target.tokens) / (nearest.elements / nearest.tokens)
    ratio = (target.batch_size / nearest.batch_size * max(1.0, (target.seq_len / nearest.seq_len) ** 2)
             * max(1.0, per_sample ** 2))
    return {nearest: ratio}


class Anchored:
    """Carries an anchor's difference ``d`` from its node to another shape: an excess as ``d * max(1, r)``, a
    shortfall as ``d * min(1, r)`` (``r``: ``token_ratio``), so either errs high; seconds as a ratio."""

    def __init__(self, token_ratio: float, static_bytes: int):
        self.token_ratio = float(token_ratio)
        self.static_bytes = static_bytes

    def __call__(self, term: Term, values: Sequence[float | None]) -> float:
        predicted, node, anchor = values
        kind = term.quantity
        if kind.growth is Growth.STATIC:
            return predicted if anchor is None else anchor
        if anchor is None:
            return predicted
        grows = max(1.0, self.token_ratio)
        if predicted is None or node is None:
            offset = float(self.static_bytes) if kind.growth is Growth.PEAK else 0.0
            return kind.coerce(offset + (anchor - offset) * grows)
        if kind.unit is Unit.SECONDS:
            return kind.coerce(predicted * anchor / node if node > 0 else anchor * self.token_ratio)
        difference = anchor - node
        return kind.coerce(predicted + difference * (grows if difference > 0 else min(1.0, self.token_ratio)))


class ShapeFit:
    """Profiles at a few shapes (the *nodes*) extended to any shape; ``anchor``: ``(shape, profile)`` trusted at
    one node's shape, its difference carried to every shape."""

    def __init__(self, nodes: Mapping[Shape, Profile], anchor: tuple[Shape, Profile] | None = None):
        check_same_stages(nodes)
        self.nodes = dict(nodes)
        if anchor is not None and anchor[0] not in self.nodes:
            raise ValueError(f"the anchor's shape {anchor[0]} is not a node: {sorted(map(str, self.nodes))}")
        self.anchor = anchor

    def with_node(self, shape: Shape, profile: Profile) -> "ShapeFit":
        return ShapeFit({**self.nodes, shape: profile}, self.anchor)

    def bounded(self, shape: Shape) -> bool:
        """Whether nodes bracket ``shape``: its prediction is then at or above the truth."""
        return chord_weights(list(self.nodes), shape) is not None

    def missing_nodes(self, shape: Shape, per_octave: int = 4, limit: Shape | None = None) -> list[Shape]:
        """The nodes on the ladder to profile so that ``shape`` is bracketed, never beyond ``limit`` unless it is."""
        if self.bounded(shape):
            return []

        def up(n: int, cap: int | None) -> int:
            return ladder_up(n, per_octave) if cap is None else min(ladder_up(n, per_octave), max(cap, n))

        top = up(shape.seq_len, limit.seq_len if limit else None)
        bottom = ladder_down(shape.seq_len, per_octave)
        batches = dict.fromkeys((ladder_down(shape.batch_size, per_octave),
                                 up(shape.batch_size, limit.batch_size if limit else None)))
        missing: list[Shape] = []
        for batch in batches:
            lengths = [n.seq_len for n in _family(list(self.nodes), shape) if n.batch_size == batch]
            if not any(length >= shape.seq_len for length in lengths):
                missing.append(Shape(batch, top, shape.layout))
            if not any(length <= shape.seq_len for length in lengths) and bottom != top:
                missing.append(Shape(batch, bottom, shape.layout))
        return missing

    def at(self, shape: Shape, method: str | None = None) -> Profile:
        """The profile predicted for ``shape`` by ``method`` (``"chord"``, ``"law"``; None: the first that applies,
        else the nearest node scaled by the steepest growth)."""
        finders = {"chord": chord_weights, "law": law_weights}
        for how in (method,) if method is not None else finders:
            weights = finders[how](list(self.nodes), shape)
            if weights is not None:
                return self._combined(shape, weights, how)
        if method is not None:
            raise ValueError(f"the nodes {sorted(map(str, self.nodes))} give no {method} at {shape}")
        return self._combined(shape, _scaled_weights(list(self.nodes), shape), "scaled")

    def _combined(self, shape: Shape, weights: dict[Shape, float], how: str) -> Profile:
        shapes = list(weights)
        sources = [self.nodes[s] for s in shapes]
        profile = combine(sources, NodeWeights([weights[s] for s in shapes], sources[0].static_bytes))
        if self.anchor is not None:
            anchor_shape, anchor = self.anchor
            profile = combine([profile, self.nodes[anchor_shape], anchor],
                              Anchored(shape.elements / anchor_shape.elements, anchor.static_bytes))
            sources.append(anchor)
        made = ", ".join(f"{s}" for s in shapes)
        return replace(profile, notes=(*dict.fromkeys(note for p in sources for note in p.notes),
                                       f"predicted for batch shape {shape} ({how}, from the profile(s) at {made})"))


def parabola_weights(lengths: tuple[int, ...], target: int) -> list[float]:
    """Lagrange weights (summing to one) of the polynomial through ``lengths`` (one to three of them) at ``target``.

    Example:
        >>> [round(w, 6) for w in parabola_weights((1, 2, 4), 8)]  # s**2 at 1, 2, 4 gives 64 at 8
        [8.0, -14.0, 7.0]
        >>> sum(w * s * s for w, s in zip(parabola_weights((1, 2, 4), 8), (1, 2, 4)))
        64.0
    """
    weights = []
    for i, node in enumerate(lengths):
        weight = 1.0
        for j, other in enumerate(lengths):
            if j != i:
                weight *= (target - other) / (node - other)
        weights.append(weight)
    return weights


class LengthFit:
    """Profiles at a few sequence lengths, extended to any length: exact at a node; elsewhere the parabola through
    the three nodes nearest (on a log scale) to the length asked (the line through two while only two exist).

    Example:
        >>> from lightning_remat.core.memory_model import StageAction, StageOption, StageProfile
        >>> def node(s):  # stored activations 8*s + s**2, a peak 1000 (static) + 3*s**2
        ...     keep = StageOption("keep", StageAction("a"), 8 * s + s * s, 1000 + 3 * s * s)
        ...     return Profile((StageProfile("a", (keep,)),), (), parameter_bytes=1000)
        >>> fit = LengthFit({64: node(64), 128: node(128), 256: node(256)})
        >>> fit.at(1024).stages == node(1024).stages, fit.at(128) is fit.nodes[128]
        (True, True)
    """

    def __init__(self, nodes: Mapping[int, Profile]):
        check_same_stages(nodes)
        self.nodes = dict(sorted(nodes.items()))

    @property
    def static_bytes(self) -> int:
        return next(iter(self.nodes.values())).static_bytes

    def with_node(self, length: int, profile: Profile) -> "LengthFit":
        return LengthFit({**self.nodes, length: profile})

    def at(self, length: int) -> Profile:
        """The profile at ``length``: the node's own, or the parabola's prediction."""
        if length in self.nodes:
            return self.nodes[length]
        nearest = tuple(sorted(sorted(self.nodes, key=lambda n: (abs(math.log(length / n)), n))[:3]))
        if len(nearest) == 1:
            # One node: scaled by the steepest growth (squared), so the prediction errs high.
            nearest = (nearest[0], nearest[0] * 2)
            profiles = [self.nodes[nearest[0]]] * 2
            weights = [max(1.0, (length / nearest[0]) ** 2), 0.0]
        else:
            profiles = [self.nodes[n] for n in nearest]
            weights = parabola_weights(nearest, length)
        # "offload:hidden" moves at most what the link carries during the next stage's compute, which grows
        # with the length at another rate than the bytes saved: its figures are no polynomial, so it is not predicted.
        profiles = [_count_free(restricted(p, lambda o: not o.offload_limit)) for p in profiles]
        profile = _counted(combine(profiles, NodeWeights(weights, profiles[0].static_bytes)), length / nearest[0])
        made = ", ".join(map(str, dict.fromkeys(nearest)))
        return replace(profile, notes=(*dict.fromkeys(note for p in profiles for note in p.notes),
                                       f"predicted for sequence length {length} from the profiles at {made}"))


# An option's setting that ends in a count of sequence chunks (a tiled MLP's "mlp:32", in ``extra`` and at the end of
# the option's name) is profiled with chunks of about the same size at every length, so the count grows with the
# length ("tile:mlp:16" at 64K tokens, "tile:mlp:32" at 128K): the fit lines such options up without their count
# and gives the prediction the count scaled to its length (a power of two, as the profiler picks it).


def _counted_setting(option: StageOption) -> tuple[str, str, int] | None:
    """(extra key, setting without its count, count) of an option named after a counted setting, or None."""
    for key, value in option.action.extra:
        head, _, count = str(value).rpartition(":")
        if head and count.isdigit() and option.name.endswith(str(value)):
            return key, head, int(count)
    return None


def _count_free(profile: Profile) -> Profile:
    """``profile`` with counted settings named without their count (``"whole+tile:mlp"``), their count in ``extra``."""
    def free(option: StageOption) -> StageOption:
        found = _counted_setting(option)
        if found is None:
            return option
        key, head, count = found
        extra = dict(option.action.extra)
        return replace(option, name=option.name[:-len(str(extra[key]))] + head,
                       action=replace(option.action, extra={**extra, key: (head, count)}))
    return replace(profile, stages=tuple(replace(s, options=tuple(free(o) for o in s.options)) for s in profile.stages))


def _counted(profile: Profile, factor: float) -> Profile:
    """``_count_free``'s profile named again, each count scaled by ``factor`` (the length over the first node's)."""
    def counted(option: StageOption) -> StageOption:
        for key, value in option.action.extra:
            if isinstance(value, tuple):
                head, count = value
                scaled = max(2, 2 ** round(math.log2(count * factor)))
                option = replace(option, name=f"{option.name}:{scaled}", action=replace(
                    option.action, extra={**dict(option.action.extra), key: f"{head}:{scaled}"}))
        return option
    return replace(profile, stages=tuple(replace(s, options=tuple(counted(o) for o in s.options))
                                         for s in profile.stages))
