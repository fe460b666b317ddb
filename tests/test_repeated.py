"""Profiles of N identical layers extrapolated from 4 and 5 layers equal the full profiles."""

import pytest
import torch

from lightning_remat.core.config import ProfileOptions
from lightning_remat.core.memory_model import Profile, Segment, StageOption, StageProfile, predict_peak
from lightning_remat.core.solve import least_peak, solve
from lightning_remat.models import build
from lightning_remat.runtime import repeated
from lightning_remat.runtime.profile import profile_step


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


# llama: every peak shows its backward figure at 4-5 layers (the plain fit); gpt2: some keep their
# forward figure there, so the backward-ballast pass is needed.
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_extrapolated_profile_equals_full_profile(monkeypatch, name):
    monkeypatch.setattr(repeated, "MIN_LAYERS", 6)
    case = build(name, layers=7, batch_size=4, seq_len=128)
    fast, full = _profiles(case)
    assert any(n.startswith("extrapolated from profiles of 4 and 5") for n in fast.notes)
    assert len(fast.stages) == 7
    assert _without_note(fast) == _without_note(full)  # every byte, FLOP and second
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


def _chain(n: int, forward: int, ballast: int = 0) -> Profile:
    """A synthetic n-layer profile: static n bytes; a layer's backward peak holds 3 bytes per later layer
    (plus ``ballast``); its forward peak is ``forward``."""
    def peak(later: int) -> int:
        return n + max(forward, 20 + 3 * later + ballast)

    stages = tuple(StageProfile(f"l.{i}", (StageOption("keep", (), 10, peak(n - 1 - i), 0.0, 0),)) for i in range(n))
    segments = (Segment("outside stages", 0, n + 1 + 3 * n + ballast),
                *(Segment(f"between stages ({j} stored)", j, n + 3 * (n - j) + ballast) for j in range(1, n + 1)))
    profile = Profile(stages, segments, parameter_bytes=n)
    profile.baseline_peak_bytes = predict_peak(profile, [0] * n)
    return profile


def test_a_forward_figure_ruling_everywhere_needs_the_backward_pass():
    # At 4-5 layers the forward figure (40) rules every layer; at 20 layers the backward one does.
    small, large = _chain(4, 40), _chain(5, 40)
    assert repeated.extrapolate(small, large, "l", 20) is None
    ballast = 1000
    deep = repeated.extrapolate(small, large, "l", 20, backward=(_chain(4, 40, ballast), _chain(5, 40, ballast), ballast))
    assert deep.stages == _chain(20, 40).stages and deep.segments == _chain(20, 40).segments
    assert deep.baseline_peak_bytes == _chain(20, 40).baseline_peak_bytes
