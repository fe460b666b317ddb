"""The default cost is the target's: the roofline with a GPU's own figures (a CUDA model, or a fake profile for a named
gpu), counted FLOPs on the CPU (deterministic) and on a GPU the hardware table does not know; an explicit cost wins.
Every entry point resolves it in one place (``RematConfig.for_target`` through ``service.planning.resolve_cost``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_remat import ProfileOptions, RematConfig, plan_remat, profile_step, solve
from lightning_remat.runtime.measuring import roofline
from lightning_remat.service.batch_search import BatchSearch
from lightning_remat.service.planning import Planner, resolve_cost
from lightning_remat.service.shape_plans import ShapePlans


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)])


def _step(model):
    return model(torch.ones(64, 32)).square().mean()


def _options(plan):
    return [(c.stage, c.option) for c in plan.choices]


def test_a_fake_h100_plans_on_its_roofline_by_default_and_equals_the_explicit_roofline_plan():
    model = _mlp()
    profile = profile_step(model, _step, fake=True, gpu="h100", policies=None)
    lo, hi = solve(profile, "min", "roofline").predicted_peak_bytes, profile.baseline_peak_bytes
    budget = lo + (hi - lo) // 2
    default = plan_remat(model, _step, budget, fake=True, gpu="h100", policies=None, verbose=False)
    assert default.cost_kind == "roofline"
    (note,) = [n for n in default.notes if n.startswith("cost 'roofline', the default for a GPU")]
    assert "h100" in note and "989 TFLOP/s" in note and "3.35 TB/s" in note

    def solved(cost):
        options = ProfileOptions(fake=True, gpu="h100", policies=None)
        return Planner(RematConfig(budget, cost=cost, profile=options)).solve_profile(model, profile)

    explicit, flops = solved("roofline"), solved("flops")
    assert _options(default) == _options(explicit) and default.predicted_peak_bytes == explicit.predicted_peak_bytes
    assert default.predicted_overhead == explicit.predicted_overhead and note not in explicit.notes
    # Not the FLOPs plan: at this budget FLOPs recompute two layers' GELUs, the H100's roofline one layer whole.
    assert _options(flops) != _options(default) and flops.cost_kind == "flops"


def test_a_cpu_plan_without_a_cost_is_the_flops_plan():
    model = _mlp()
    for fake in (False, True):
        default = plan_remat(model, _step, "min", fake=fake, verbose=False)
        flops = plan_remat(model, _step, "min", fake=fake, cost="flops", verbose=False)
        assert default.to_dict() == flops.to_dict() and default.cost_kind == "flops"


def test_an_explicit_cost_wins_over_the_targets():
    config, note = RematConfig("min", cost="flops", profile=ProfileOptions(fake=True, gpu="h100")).for_target(
        "cuda", "h100")
    assert config.cost == "flops" and note is None
    for cost in ("flops", "time"):
        resolved, note = resolve_cost(RematConfig("min", cost=cost, profile=ProfileOptions(fake=True, gpu="a100")),
                                      _mlp())
        assert resolved.cost == cost and note is None


def test_a_gpu_the_table_does_not_know_plans_on_flops_with_a_note(monkeypatch):
    # A real CUDA model: the device's own name matched against core/hardware.py.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, key in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-40GB", "a100"),
                      ("NVIDIA GeForce RTX 2060", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert roofline.target_gpu("cuda") == ("cuda", key, name)
        config, note = RematConfig("1GB").for_target(*roofline.target_gpu("cuda"))
        assert config.cost == ("roofline" if key else "flops")
        assert (key or "not in core/hardware.py") in note and (name in note) == (key is None)
    monkeypatch.undo()
    # A fake profile for 'cuda' without gpu= on a machine without one: no figures to price it by.
    config, note = resolve_cost(RematConfig("min", profile=ProfileOptions(fake=True, device="cuda")), _mlp())
    assert config.cost == "flops" and "not in core/hardware.py (none named)" in note


@pytest.mark.parametrize("gpu, want", [(None, "flops"), ("h100", "roofline")])
def test_every_entry_point_resolves_the_cost_the_same_way(gpu, want):
    model = _mlp()
    options = ProfileOptions(fake=gpu is not None, gpu=gpu)
    plans = ShapePlans(model, lambda m, batch: m(batch).square().mean(), config=RematConfig("min", profile=options))
    assert plans.config.cost == want and plans.planner.config.cost == want
    search = BatchSearch(lambda bs: _step, model, None, RematConfig("1GB", profile=options), 10**9, 0.35, 1,
                         "binsearch", 2)
    assert search.cost == want and search.config.cost == want
    assert any("default for a GPU" in n for n in search.notes) == (gpu is not None)
