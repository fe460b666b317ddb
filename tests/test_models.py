"""The budget holds on a real model definition, and the model agrees with measurement: the checks of
the model sweep (benchmarks/model_sweep.py: GPT-2, BERT, ViT, ResNet-50 and Llama at larger sizes)
on one small GPT-2, at a budget between the least peak and the baseline and at "min"."""

import pytest

from benchmarks import model_sweep as sweep
from lightning_remat.models import build
from lightning_remat.runtime.profiling.profile import profile_step

import torch


@pytest.fixture(scope="module")
def profiled():
    torch.manual_seed(0)
    case = build("gpt2", layers=3, hidden=48, seq_len=48, batch_size=2)
    optimizer = torch.optim.Adam(case.model.parameters())
    profile = profile_step(case.model, case.step, optimizer=optimizer)
    assert not optimizer.state, "profiling must not create optimizer state"
    return case, profile


def test_the_baseline_prediction_matches_measurement(profiled):
    sweep.test_the_baseline_prediction_matches_measurement(profiled)


@pytest.mark.parametrize("fraction", (0.5, "min"))
def test_the_budget_holds_and_the_prediction_is_within_five_percent(profiled, fraction):
    sweep.test_the_budget_holds_and_the_prediction_is_within_five_percent(profiled, fraction)


def test_no_more_overhead_than_hugging_face_at_its_own_peak(profiled):
    sweep.test_no_more_overhead_than_hugging_face_at_its_own_peak(profiled)
