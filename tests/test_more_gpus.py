"""The "more GPUs (FSDP2)" knob (service/knobs.py): no sharded re-profile where even infinitely many GPUs
cannot fit, and a named world size whose sharded plan fits."""

from dataclasses import replace

import pytest
import torch

from lightning_remat import plan_remat
from lightning_remat.core.errors import BudgetTooSmallError
from lightning_remat.core.solve import least_peak
from lightning_remat.service import knobs
from lightning_remat.service.planning import Planner

_FAKE = dict(fake=True, gpu="h100", device="cuda", precision="bf16-true", cost="flops", verbose=False)


def _llama(layers, frozen):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).train()
    for name, p in model.named_parameters():
        p.requires_grad_(not frozen or "norm" in name)  # frozen: only the norms train, as a LoRA keeps little state
    ids = torch.randint(0, 256, (1, 128))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return model, (lambda m: m(input_ids=ids, labels=ids).loss), optimizer


def _sharded_profiles(monkeypatch):
    sizes = []
    profile = Planner.profile

    def counted(self, *args, **kwargs):
        sizes.append(self.config.profile.world_size)
        return profile(self, *args, **kwargs)
    monkeypatch.setattr(Planner, "profile", counted)
    return sizes


def test_no_sharded_reprofile_where_even_infinitely_many_gpus_cannot_fit(monkeypatch):
    # Two frozen layers: FSDP2 gathers the root and both layers, all the parameters sharding would save.
    model, step, optimizer = _llama(2, frozen=True)
    least = plan_remat(model, step, "min", optimizer=optimizer, **_FAKE).predicted_peak_bytes
    monkeypatch.setattr(knobs, "KNOBS", {"more GPUs (FSDP2)": knobs._more_gpus})
    sizes = _sharded_profiles(monkeypatch)
    budget = least - 2**16  # below the least peak by more than the state of the norms that train
    with pytest.raises(BudgetTooSmallError) as caught:
        plan_remat(model, step, budget, optimizer=optimizer, **_FAKE)
    assert caught.value.knobs == [] and sizes == [1]  # the step's own profile; no sharded one
    # Right to skip it: sharded over 8 GPUs the least peak per GPU is still above the budget.
    assert plan_remat(model, step, "min", optimizer=optimizer, world_size=8, **_FAKE).predicted_peak_bytes > budget


def test_the_next_world_size_from_a_sharded_profile_fits_as_predicted(monkeypatch):
    # Eight trainable layers: parameters, gradients and AdamW's state are most of the peak.
    model, step, optimizer = _llama(8, frozen=False)
    contexts = []
    monkeypatch.setattr(knobs, "knob_figures", lambda context: contexts.append(context) or [])
    with pytest.raises(BudgetTooSmallError):
        plan_remat(model, step, 2**10, optimizer=optimizer, world_size=2, **_FAKE)
    context = contexts[0]
    peak = least_peak(context.profile)
    own = context.profile.parameter_bytes + context.profile.optimizer_state_bytes
    budget = peak - own // 2  # within reach of 4 GPUs by the sharded profile's algebra
    sizes = _sharded_profiles(monkeypatch)
    setting, predicted = knobs._more_gpus_from(replace(context, budget_bytes=budget), context.profile, 2, peak)
    assert setting.startswith("fake=True, world_size=4 ") and sizes == []  # computed, not re-profiled
    plan = plan_remat(model, step, budget, optimizer=optimizer, world_size=4, **_FAKE)
    # The figure bounds the sharded plan's peak (gradients may shrink too, and the peak's moment move).
    assert plan.predicted_peak_bytes <= predicted <= budget
