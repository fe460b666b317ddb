"""Mixture-of-Experts planned on fake tensors for an H100 in every precision (runtime/targets/fake_moe.py).

A tiny Qwen2-MoE (4 experts, 2 per token, a shared expert; transformers runs its experts as grouped
matmuls) failed in float32 and bf16-mixed: torch's meta kernel for ``aten._grouped_mm`` accepts
bfloat16 only. Its experts also counted no FLOPs (FlopCounterMode has no formula for grouped
matmuls), so recomputing them looked free. And the "eager" experts loop picks tokens by the router's
values, which fake tensors do not have."""

from __future__ import annotations

import pytest
import torch

from lightning_remat import plan_remat, profile_step

from tests.tiny_hf import qwen2

TOKENS, HIDDEN, TOP_K = 2 * 64, 64, 2
# The routed experts' forward (gate and up projections to 2 x 64, down back to 64), per routed token,
# and the shared expert's (to 2 x 128 and back) on every token: an MLP's forward is more than both.
EXPERT_FLOPS = 2 * TOKENS * TOP_K * (HIDDEN * 2 * HIDDEN + HIDDEN * HIDDEN)
MLP_FLOPS = EXPERT_FLOPS + 2 * TOKENS * (HIDDEN * 4 * HIDDEN + 2 * HIDDEN * HIDDEN)


def _moe():
    model, step = qwen2(moe=True, seq_len=64, hidden=HIDDEN)
    return model, step, torch.optim.AdamW(model.parameters())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_moe_is_planned_on_fake_tensors_for_an_h100_in_every_precision(precision):
    model, step, optimizer = _moe()
    options = dict(optimizer=optimizer, fake=True, gpu="h100", precision=precision)
    profile = profile_step(model, step, **options)
    plan = plan_remat(model, step, "min", **options)
    assert plan.checkpointed and plan.predicted_peak_bytes < profile.baseline_peak_bytes
    # Recomputing the MLP recomputes the experts' grouped matmuls: their FLOPs are counted.
    assert all(s.option("mlp").costs.flops > MLP_FLOPS for s in profile.stages)
    assert all(p.device.type == "cpu" and not type(p).__name__.startswith("Fake") for p in model.parameters())


def test_a_float32_moe_on_fake_tensors_equals_its_real_profile():
    model, step, optimizer = _moe()
    real = profile_step(model, step, optimizer=optimizer)
    fake = profile_step(model, step, optimizer=optimizer, fake=True)
    def figures(profile):  # memory and FLOPs (a fake profile has no time)
        return [[(o.name, o.stored_bytes, o.local_peak_bytes, o.costs.flops, o.shared_held) for o in s.options]
                for s in profile.stages]

    assert figures(fake) == figures(real)
    assert fake.segments == real.segments and fake.baseline_peak_bytes == real.baseline_peak_bytes
    assert fake.baseline_costs.flops == real.baseline_costs.flops


def test_experts_routed_by_data_dependent_shapes_are_planned_as_grouped_matmuls():
    model, step, optimizer = _moe()
    model.set_experts_implementation("eager")  # each expert's tokens by nonzero / where
    profile = profile_step(model, step, optimizer=optimizer, fake=True, gpu="h100")
    assert any("experts_implementation='eager'" in note for note in profile.notes)
    assert all(s.option("mlp").costs.flops > MLP_FLOPS for s in profile.stages)
    assert model.get_experts_implementation()[""] == "eager"  # the user's setting, put back
