"""One profile algebra: the batch fit, the rank merge and the depth fit combine every numeric field.

The profiles here are synthetic: every numeric field of ``Profile``, ``StageProfile``,
``StageOption`` and ``Segment`` (found with ``dataclasses.fields``, not from the algebra's own
declaration) gets a value of its own, so a field a job forgets (copies from the first input) shows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace

import pytest

from lightning_remat.core.batch_fit import ProfileFit
from lightning_remat.core.actions import StageAction
from lightning_remat.core.memory_model import Costs, Profile, Segment, StageOption, StageProfile, predict_peak
from lightning_remat.core.profile_algebra import merge_profiles

# Memory no batch changes. Every other number grows with the batch.
STATIC = {"parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "buffer_bytes"}
# Figures a peak counts the static memory under.
PEAKS = {"local_peak_bytes", "peak_bytes"}
# Identity, not measures: the same in every input (the shared inputs' bytes a segment may leave out
# are tensors of a fixed size, carried as they are: core.shared_held).
STRUCTURAL_NUMBERS = {"stages_alive", "shared_saving", "call"}


def _numeric(cls: type) -> list[tuple[str, str]]:
    """(name, "int", "float" or "Costs") of every numeric field of ``cls`` (``Costs``: one number per cost kind)."""
    out = []
    for f in fields(cls):
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if kind in ("int", "float", "Costs") and f.name not in STRUCTURAL_NUMBERS and f.name != "baseline_peak_bytes":
            out.append((f.name, kind))
    return out


def _values(cls: type, seed: int, batch: int, static: int) -> dict:
    """A value for every numeric field of ``cls``: ``a + b * batch`` with ``a`` and ``b`` the field's
    own (``a = 0`` but for peaks, whose ``a`` is the static memory; static fields are ``a`` alone).
    Floats are dyadic, so lines through them are exact."""
    out = {}
    for k, (name, kind) in enumerate(_numeric(cls)):
        slope = 1 + k + 100 * seed
        if kind == "Costs":
            out[name] = Costs(**_values(Costs, 1000 + seed, batch, static))
            continue
        if name in STATIC:
            value = 10**6 * (k + 1) + seed
        elif name in PEAKS:
            value = static + slope * batch
        else:
            value = slope * batch
        out[name] = value / 8 if kind == "float" else value
    return out


def _action(name: str, stage: str) -> StageAction:
    actions = {"keep": StageAction(stage), "whole": StageAction.recompute(stage), "offload": StageAction.offload(stage)}
    return actions[name]


def _profile(batch: int, static_seed: int = 0) -> Profile:
    static_fields = {k: v for k, v in _values(Profile, static_seed, 0, 0).items() if k in STATIC}
    static = sum(static_fields.values())
    stages = []
    for i in range(3):
        options = tuple(StageOption(**{"name": name, "action": _action(name, f"l.{i}"),
                                       **_values(StageOption, 10 * i + j, batch, static)})
                        for j, name in enumerate(("keep", "whole", "offload")))
        stages.append(StageProfile(name=f"l.{i}", options=options, module_type="Block",
                                   **_values(StageProfile, 5 + i, batch, static)))
    segments = tuple(Segment(name=name, stages_alive=alive, **_values(Segment, 40 + alive, batch, static))
                     for name, alive in (("outside stages", 0), ("between stages (1 stored)", 1), ("head", 3)))
    profile = Profile(stages=tuple(stages), segments=segments, notes=("n",),
                      **{**_values(Profile, 60, batch, static), **static_fields})
    profile = profile.with_baseline()
    return profile


def test_synthetic_profiles_give_every_numeric_field_a_value_of_its_own():
    profile = _profile(16)
    values = [v for s in profile.stages for o in s.options for v in _flat(o)]
    values += [v for s in profile.stages for v in _flat(s)]
    values += _flat(profile)
    ints, floats = [v for v in values if isinstance(v, int)], [v for v in values if isinstance(v, float)]
    assert len(set(ints)) == len(ints) and len(set(floats)) == len(floats) and 0 not in values
    assert {"costs", "host_bytes", "offload_limit"} <= {n for n, _ in _numeric(StageOption)}
    assert "baseline_costs" in {n for n, _ in _numeric(Profile)}
    assert [n for n, _ in _numeric(Costs)] == ["time", "flops", "roofline"]


@pytest.mark.parametrize("batch", [1, 16, 40, 64, 100])
def test_batch_fit_through_two_profiles_fits_every_numeric_field(batch):
    # Every term is linear in the batch: the line through 16 and 64 gives the profile at any batch,
    # field by field (roofline seconds included), static memory as measured.
    fit = ProfileFit([(16, _profile(16)), (64, _profile(64))])
    assert fit.at(batch) == _profile(batch)


@pytest.mark.parametrize("batch", [1, 5, 64])
def test_batch_fit_from_one_profile_scales_every_numeric_field_in_proportion(batch):
    fit = ProfileFit([(16, _profile(16))])
    assert fit.at(batch) == _profile(batch)


def test_batch_fit_scales_roofline_costs():
    # The issue's figures: at 64, fitted from 16 and 64, the roofline cost stayed at 16's (4x low).
    def profile(batch):
        options = (StageOption("keep", StageAction("a"), 100 * batch, 200 * batch),
                   StageOption("whole", StageAction.recompute("a"), 10 * batch, 150 * batch,
                               Costs(1e-3 * batch, 5 * batch, 1.1e-05 * batch / 16)))
        p = Profile((StageProfile("a", options),), (), baseline_costs=Costs(roofline=4e-05 * batch / 16))
        return p.with_baseline()

    fit = ProfileFit([(16, profile(16)), (64, profile(64))])
    at_64 = fit.at(64)
    assert at_64.stages[0].option("whole").costs.roofline == pytest.approx(4.4e-05)
    assert at_64.baseline_costs.roofline == pytest.approx(1.6e-04)
    at_40 = fit.at(40)
    assert at_40.stages[0].option("whole").costs.roofline == pytest.approx(1.1e-05 * 40 / 16)
    assert at_40.baseline_costs["roofline"] == pytest.approx(4e-05 * 40 / 16)
    # One profile: in proportion to the batch.
    alone = ProfileFit([(16, profile(16))]).at(32)
    assert alone.stages[0].option("whole").costs.roofline == pytest.approx(2.2e-05)
    assert alone.baseline_costs.roofline == pytest.approx(8e-05)


def _rank(rank: int, ranks: int) -> Profile:
    """A rank's profile: every numeric field a value of its own, the largest on a rank that
    changes from field to field (so no rank has every largest value)."""
    counter = itertools.count()

    def renumber(node):
        values = {}
        for name, kind in _numeric(type(node)):
            if kind == "Costs":
                values[name] = renumber(getattr(node, name))
                continue
            k = next(counter)
            value = getattr(node, name) + 7 * ((rank + k) % ranks)
            values[name] = value / 8 if kind == "float" else value
        return replace(node, **values)

    base = _profile(16)
    stages = tuple(replace(renumber(s), options=tuple(renumber(o) for o in s.options)) for s in base.stages)
    profile = replace(renumber(base), stages=stages, segments=tuple(renumber(g) for g in base.segments),
                      notes=(f"rank {rank}",))
    profile = profile.with_baseline()
    return profile


def _flat(node) -> list:
    """The numeric fields of ``node``, a ``Costs`` field's numbers in its place."""
    return [v for n, kind in _numeric(type(node))
            for v in (_flat(getattr(node, n)) if kind == "Costs" else [getattr(node, n)])]


def _numbers(profile: Profile) -> list:
    values = _flat(profile)
    for stage in profile.stages:
        values += _flat(stage)
        values += [v for o in stage.options for v in _flat(o)]
    return values + [v for g in profile.segments for v in _flat(g)]


def test_rank_merge_takes_the_largest_of_every_numeric_field():
    ranks = [_rank(r, 3) for r in range(3)]
    merged = merge_profiles(ranks)
    per_rank = [_numbers(p) for p in ranks]
    assert _numbers(merged) == [max(column) for column in zip(*per_rank)]
    assert all(_numbers(merged) != values for values in per_rank)  # no rank had them all
    assert merged.baseline_peak_bytes == predict_peak(merged, [0] * 3)
    assert merged.notes[0] == "rank 0" and merged.stages[1].name == "l.1"


def test_rank_merge_takes_the_largest_costs_and_host_bytes():
    # Rank 1 recomputes more FLOPs, takes longer on the roofline and offloads more than rank 0.
    def profile(flops, roofline, host, step_roofline):
        options = (StageOption("keep", StageAction("a"), 100, 150),
                   StageOption("offload", StageAction.offload("a"), 10, 60, Costs(0.5, flops, roofline),
                               host_bytes=host))
        return Profile((StageProfile("a", options),), (Segment("head", 1, 50),), baseline_costs=Costs(roofline=step_roofline))

    merged = merge_profiles([profile(5, 1e-05, 90, 2e-04), profile(7, 3e-05, 120, 1e-04)])
    offload = merged.stages[0].option("offload")
    assert (offload.costs.flops, offload.costs.roofline, offload.host_bytes) == (7, 3e-05, 120)
    assert merged.baseline_costs.roofline == 2e-04


def test_every_numeric_field_has_a_quantity_and_a_new_one_is_combined():
    from lightning_remat.core.profile_algebra import Growth, Unit, combine, largest, quantity, terms

    for cls in (Profile, StageProfile, StageOption, Segment, Costs):
        numeric = {n for n, k in _numeric(cls) if k != "Costs"} | ({"baseline_peak_bytes"} if cls is Profile else set())
        assert {t.name for t in terms(cls)} == numeric, cls
        for name, kind in (f for f in _numeric(cls) if f[1] != "Costs"):
            unit = quantity(cls, name).unit
            assert (unit is Unit.SECONDS) == (kind == "float"), name
            assert (quantity(cls, name).growth is Growth.STATIC) == (name in STATIC), name
            assert (quantity(cls, name).growth is Growth.PEAK) == (name in PEAKS), name
    assert quantity(Profile, "baseline_peak_bytes").derived

    # A field someone adds later is combined with no change to the algebra: scaled by the batch fit
    # (bytes round up), maxed by the merge.
    @dataclass(frozen=True)
    class SpillingOption(StageOption):
        spill_bytes: int = 0

    def profile(batch, spill):
        option = SpillingOption("keep", (), 10 * batch, 20 * batch, spill_bytes=spill)
        return Profile((StageProfile("a", (option,)),), ())

    assert ProfileFit([(2, profile(2, 7)), (4, profile(4, 13))]).at(3).stages[0].options[0].spill_bytes == 10
    assert ProfileFit([(4, profile(4, 13))]).at(3).stages[0].options[0].spill_bytes == 10  # 9.75 rounded up
    assert combine([profile(2, 7), profile(2, 13), profile(2, 5)], largest).stages[0].options[0].spill_bytes == 13


def test_children_line_up_by_position_name_and_key():
    from lightning_remat.core.profile_algebra import combine, largest

    a, b = _profile(16), _profile(64)
    with pytest.raises(ValueError, match="different numbers of StageProfile"):
        combine([a, replace(b, stages=b.stages[:2])], largest)
    twice = replace(a, segments=(*a.segments, a.segments[0]))
    with pytest.raises(ValueError, match="share"):
        combine([twice, b], largest)
    # An option one input lacks is dropped; a segment one input lacks is kept, from the others.
    short = replace(b, stages=tuple(replace(s, options=s.options[:2]) for s in b.stages), segments=b.segments[1:])
    merged = combine([a, short], largest)
    assert [o.name for o in merged.stages[0].options] == ["keep", "whole"]
    assert merged.segments[0] == a.segments[0] and merged.segments[1] == b.segments[1]


def test_depth_fit_extrapolates_every_numeric_field():
    # Every numeric field a value of its own: the options' and stages' the same in every layer, the
    # profile's linear in the depth, the peaks a forward and a backward figure (20 + 3 per later layer).
    from lightning_remat.core.depth_fit import extrapolate

    def chain(n: int, lift_forward: int = 0, lift_backward: int = 0) -> Profile:
        def peak(later: int) -> int:
            return n + max(40 + lift_forward, 20 + 3 * later + lift_backward)

        stages = []
        for i in range(n):
            options = tuple(StageOption(**{"name": name, "action": _action(name, f"l.{i}"),
                                           **_values(StageOption, j, 1, 0), "local_peak_bytes": peak(n - 1 - i) + j})
                            for j, name in enumerate(("keep", "whole", "offload")))
            stages.append(StageProfile(name=f"l.{i}", options=options, module_type="Block",
                                       **_values(StageProfile, 5, 1, 0)))
        segments = (Segment("outside stages", 0, n + max(1 + lift_forward, 1 + 3 * n + lift_backward)),
                    *(Segment(f"between stages ({j} stored)", j, n + max(lift_forward, 3 * (n - j) + lift_backward))
                      for j in range(1, n + 1)),
                    Segment("optimizer step", 0, 7 * n))
        profile = Profile(tuple(stages), segments, notes=("n",), **_values(Profile, 60, n, 0))
        profile = profile.with_baseline()
        return profile

    x = 10**6
    deep = extrapolate((chain(4, lift_forward=x), chain(5, lift_forward=x)),
                       (chain(4, lift_backward=x), chain(5, lift_backward=x)), x, "l", 20)
    want = chain(20)
    assert deep.stages == want.stages and deep.segments == want.segments
    assert replace(deep, notes=want.notes) == want
