"""The sequence-length fit: the memory model at any sequence length (batch fixed), from profiles at a few lengths.

Every term of a step is a polynomial of degree at most two in the sequence length ``s`` (activations grow with
``s``, attention's score matrices on the math path with ``s**2``; static memory does not grow), so the parabola
through three profiled lengths predicts any other. A profiled length (a *node*) is exact; ``find_remat_seq_len``
profiles the lengths its answer rests on, so predictions only steer the search (``docs/seq_len.md``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

from .memory_model import Profile, StageOption, restricted
from .profile_algebra import check_same_stages, combine
from .shape_fit import NodeWeights


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
        >>> from lightning_remat.core.memory_model import StageOption, StageProfile
        >>> def node(s):  # stored activations 8*s + s**2, a peak 1000 (static) + 3*s**2
        ...     keep = StageOption("keep", (), 8 * s + s * s, 1000 + 3 * s * s)
        ...     return Profile((StageProfile("a", (keep,)),), (), parameter_bytes=1000)
        >>> fit = LengthFit({64: node(64), 128: node(128), 256: node(256)})
        >>> fit.at(1024).stages == node(1024).stages, fit.at(128) is fit.nodes[128], fit.batch_sizes
        (True, True, (64, 128, 256))
    """

    def __init__(self, nodes: Mapping[int, Profile]):
        check_same_stages(nodes)
        self.nodes = dict(sorted(nodes.items()))

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The profiled lengths (named as ``ProfileFit``'s, whose place in ``BatchSearch`` this takes)."""
        return tuple(self.nodes)

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
        # with the length at another rate than the bytes saved: its figures are no polynomial, so it is not
        # predicted (a parabola through three of them went below zero stored bytes at 16 times the length).
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
    for key, value in option.extra:
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
        return replace(option, name=option.name[:-len(str(dict(option.extra)[key]))] + head,
                       extra=tuple((k, (head, count) if k == key else v) for k, v in option.extra))
    return replace(profile, stages=tuple(replace(s, options=tuple(free(o) for o in s.options)) for s in profile.stages))


def _counted(profile: Profile, factor: float) -> Profile:
    """``_count_free``'s profile named again, each count scaled by ``factor`` (the length over the first node's)."""
    def counted(option: StageOption) -> StageOption:
        for key, value in option.extra:
            if isinstance(value, tuple):
                head, count = value
                scaled = max(2, 2 ** round(math.log2(count * factor)))
                option = replace(option, name=f"{option.name}:{scaled}",
                                 extra=tuple((k, f"{head}:{scaled}" if k == key else v) for k, v in option.extra))
        return option
    return replace(profile, stages=tuple(replace(s, options=tuple(counted(o) for o in s.options))
                                         for s in profile.stages))
