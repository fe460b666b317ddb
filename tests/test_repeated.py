"""Profiles of N identical layers extrapolated from 4 and 5 layers equal the full profiles."""

from dataclasses import replace

import pytest
import torch

from lightning_remat.core.config import ProfileOptions
from lightning_remat.core.memory_model import Profile, Segment, StageAction, StageOption, StageProfile
from lightning_remat.core.shared_held import without_shared
from lightning_remat.core.solve import least_peak, solve
from lightning_remat.models import build
from lightning_remat.runtime.profiling import repeated
from lightning_remat.runtime.profiling.profile import profile_step


def _profiles(case, **options):
    opt = torch.optim.AdamW(case.model.parameters())
    common = dict(fake=True, gpu="h100", device="cuda", **options)
    fast = profile_step(case.model, case.step, optimizer=opt, options=ProfileOptions(**common))
    full = profile_step(case.model, case.step, optimizer=opt, options=ProfileOptions(repeated_blocks=False, **common))
    return fast, full


def _without_note(profile: Profile) -> dict:
    data = profile.to_dict()
    data["notes"] = tuple(n for n in data["notes"] if not n.startswith("extrapolated"))
    return data


def _assert_equal_profiles(fast: Profile, full: Profile) -> None:
    """Every byte, FLOP and second equal; the step's roofline seconds (a float sum over thousands of
    ops, extrapolated) to rounding. The extrapolation counts an input several layers hold in every
    holder, as the additive model does (core.shared_held): the full profile's figures without what
    counts it once."""
    a, b = _without_note(fast), _without_note(without_shared(full))
    assert a["baseline_costs"].pop("roofline") == pytest.approx(b["baseline_costs"].pop("roofline"), rel=1e-9)
    assert full.baseline_costs.roofline > 0
    assert a == b


# gpt2: some peaks keep their forward figure at 4-5 layers and take the backward one deeper.
# llama under bf16-mixed autocast and gradient accumulation (every gradient alive from the start);
# llama in pure bf16: a gap's figure is the largest of the keep run's (falling one hidden state per
# layer) and the recompute runs' (flat), which bends; each run's figures are extrapolated alone.
@pytest.mark.parametrize("name, options", [("gpt2", {}),
                                           ("llama", {"precision": "bf16-mixed", "accumulation_steps": 2}),
                                           ("llama", {"dtype": torch.bfloat16})])
def test_extrapolated_profile_equals_full_profile(monkeypatch, name, options):
    monkeypatch.setattr(repeated, "MIN_LAYERS", 6)
    case = build(name, layers=7, batch_size=4, seq_len=128)
    fast, full = _profiles(case, **options)
    assert any(n.startswith("extrapolated from profiles of 4 and 5") for n in fast.notes)
    assert len(fast.stages) == 7
    # The optimizer settings' advice: measured on the 4- and 5-layer copies' optimizers, on a line.
    assert dict(fast.optimizer_step_alternatives) == dict(full.optimizer_step_alternatives) != {}
    _assert_equal_profiles(fast, full)
    assert least_peak(full) < full.baseline_peak_bytes
    budget = (least_peak(full) + full.baseline_peak_bytes) // 2
    assert solve(fast, budget, cost="flops").checkpointed == solve(full, budget, cost="flops").checkpointed
    assert solve(fast, budget, cost="flops").checkpointed  # the budget makes it recompute something


def test_layers_that_differ_are_profiled_whole(monkeypatch):
    monkeypatch.setattr(repeated, "MIN_LAYERS", 6)
    case = build("llama", layers=6, batch_size=2, seq_len=32)
    assert repeated.repeated_stack(case.model, None) == repeated.RepeatedStack("model.layers", 6)
    # One layer with a wider MLP: not interchangeable.
    from transformers.models.llama.modeling_llama import LlamaMLP

    wide = type(case.model.config)(**{**case.model.config.to_dict(), "intermediate_size": 400})
    case.model.model.layers[3].mlp = LlamaMLP(wide)
    assert repeated.repeated_stack(case.model, None) is None
    profile = profile_step(case.model, case.step, options=ProfileOptions(fake=True, device="cuda"))
    assert not any(n.startswith("extrapolated") for n in profile.notes) and len(profile.stages) == 6


def test_per_layer_config_settings_are_refused(monkeypatch):
    monkeypatch.setattr(repeated, "MIN_LAYERS", 6)
    case = build("llama", layers=6, batch_size=2, seq_len=32)
    case.model.config.layer_types = ["full_attention", "sliding_attention"] * 3
    assert repeated.repeated_stack(case.model, None) is None
    case.model.config.layer_types = ["full_attention"] * 6
    assert repeated.repeated_stack(case.model, None) is not None


def _chain(n: int, forward: int, lift_forward: int = 0, lift_backward: int = 0) -> Profile:
    """A synthetic n-layer profile: static n bytes; a layer's forward peak is ``forward``, its backward
    peak 20 + 3 bytes per later layer; ballast lifts the forward or the backward figures."""
    def peak(later: int) -> int:
        return n + max(forward + lift_forward, 20 + 3 * later + lift_backward)

    stages = tuple(StageProfile(f"l.{i}", (StageOption("keep", StageAction(f"l.{i}"), 10, peak(n - 1 - i)),))
                   for i in range(n))
    segments = (Segment("outside stages", 0, n + max(1 + lift_forward, 1 + 3 * n + lift_backward)),
                *(Segment(f"between stages ({j} stored)", j, n + max(lift_forward, 3 * (n - j) + lift_backward))
                  for j in range(1, n + 1)),
                Segment("optimizer step", 0, 7 * n))
    profile = Profile(stages, segments, parameter_bytes=n)
    profile = profile.with_baseline()
    return profile


def test_forward_and_backward_figures_are_extrapolated_apart():
    # At 4-5 layers the forward figure (40) rules every layer; at 20 layers the backward one rules
    # the first ones: a line through the measured peaks would say 40 + 20 everywhere.
    x = 1000
    forward = (_chain(4, 40, lift_forward=x), _chain(5, 40, lift_forward=x))
    backward = (_chain(4, 40, lift_backward=x), _chain(5, 40, lift_backward=x))
    deep = repeated.extrapolate(forward, backward, x, "l", 20)
    assert deep.stages == _chain(20, 40).stages and deep.segments == _chain(20, 40).segments
    assert deep.baseline_peak_bytes == _chain(20, 40).baseline_peak_bytes
    assert deep.stages[0].options[0].local_peak_bytes == 20 + 20 + 3 * 19 > 20 + 40
    # A middle layer off the line (one byte more in layer 1 of the 5-layer copy): no fit, profile all.
    stages = list(forward[1].stages)
    stages[1] = replace(stages[1], options=(replace(stages[1].options[0], local_peak_bytes=stages[1].options[0].local_peak_bytes + 1),))
    bent = replace(forward[1], stages=tuple(stages))
    bent = bent.with_baseline()
    assert repeated.extrapolate((forward[0], bent), backward, x, "l", 20) is None


def test_a_region_one_pass_never_visits_is_extrapolated_from_the_other():
    # The gaps between layers are visited in forward only (their backward-ballast figure is the
    # forward one, not lifted), and their figures fall below zero with depth: the extrapolation uses
    # the forward line alone and keeps the negative values (a clamp at zero overstated 70B at 8 GPUs).
    x = 10**6

    def chain(n: int, lift_forward: int = 0, lift_backward: int = 0) -> Profile:
        stages = tuple(StageProfile(f"l.{i}", (StageOption("keep", StageAction(f"l.{i}"), 10,
                                                                 n + max(40 + lift_forward, 20 + lift_backward)),))
                       for i in range(n))
        gap = [n + 30 - 12 * j for j in range(1, n + 1)]  # forward only: 30 less 12 bytes per stored layer
        segments = (Segment("outside stages", 0, n + max(1 + lift_forward, 1 + 3 * n + lift_backward)),
                    *(Segment(f"between stages ({j} stored)", j, gap[j - 1] + lift_forward) for j in range(1, n + 1)),
                    Segment("optimizer step", 0, 7 * n))
        profile = Profile(stages, segments, parameter_bytes=n)
        profile = profile.with_baseline()
        return profile

    deep = repeated.extrapolate((chain(4, lift_forward=x), chain(5, lift_forward=x)),
                                (chain(4, lift_backward=x), chain(5, lift_backward=x)), x, "l", 20)
    assert deep.segments == chain(20).segments and deep.stages == chain(20).stages
    assert min(s.peak_bytes for s in deep.segments) == 20 + 30 - 12 * 20 < 0
    assert deep.baseline_peak_bytes == chain(20).baseline_peak_bytes


def test_sharded_extrapolated_profile_equals_full_profile(monkeypatch):
    # FSDP2 at 8 GPUs: deep in the forward a gap's figure falls below zero (the stored bytes count
    # unsharded parameters FSDP2 frees), and backward never visits the gaps between late layers. 8 layers: at 7 the
    # lowest gap was below zero only while each recomputed layer counted FSDP2's view of its input as held.
    monkeypatch.setattr(repeated, "MIN_LAYERS", 6)
    case = build("llama", layers=8, batch_size=2, seq_len=64)
    fast, full = _profiles(case, precision="bf16-mixed", world_size=8)
    assert any(n.startswith("extrapolated from profiles of 4 and 5") for n in fast.notes)
    assert fast.sharding == full.sharding and full.sharding["world_size"] == 8
    floor = full.optimizer_state_bytes  # counted ahead in every figure
    assert any(s.peak_bytes < floor for s in full.segments)  # a figure below zero is exercised
    _assert_equal_profiles(fast, full)
