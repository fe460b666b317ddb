"""Every step within the budget, the first included (issue 29): the first step is planned on a fake-tensor
profile before it runs, in every integration, and calibrated by the measured step afterwards.

Each run: a budget between the least peak and the peak of a plain first step (so a first step that
runs without recomputation, or is profiled for real, breaks it), every step's peak measured
independently of the package from ``torch.profiler``'s allocator events (``tests/torch_meter.py``:
the package's own planning work inside the step counts), and the losses against the run without
the package. The integrations' runs (Lightning, Accelerate, the Hugging Face Trainer) are in
``test_first_step_integrations.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_remat import profile_step
from lightning_remat.core.solve import solve
from lightning_remat.runtime.measuring.meter import PeakWindow
from lightning_remat.service.shape_plans import ShapePlans
from tests.torch_meter import TorchPeak

WIDTH, VOCAB = 32, 64


def token_model(seed: int = 0, blocks: int = 4, block: type | None = None) -> nn.Module:
    """An embedding and ``blocks`` MLP blocks: activations (8 x 64 tokens, 4x wide) dominate its memory."""
    torch.manual_seed(seed)
    make = block or (lambda: nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)))
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), *[make() for _ in range(blocks)])


def token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).square().mean()


def token_batches(steps: int = 3, rows: int = 8, length: int = 64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (rows, length), generator=generator) for _ in range(steps)]


def run_steps(model, optimizer, batches, before=None, held=None, after=None):
    """Per step: the peak (``TorchPeak`` over the whole step, ``before(batch)`` included), and the loss.
    ``held(step)``: bytes the loop itself allocates inside the step and holds through it (memory no
    profile sees); ``after(step)`` runs after the step, outside its window."""
    peaks, losses = [], []
    for step, batch in enumerate(batches):
        meter = TorchPeak(model, optimizer).start()
        if before is not None:
            before(batch)
        kept = torch.empty(held(step), dtype=torch.uint8) if held else None
        loss = token_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        del loss, kept
        peaks.append(meter.stop())
        if after is not None:
            after(step)
    return peaks, losses


def fresh(seed: int = 0, **kwargs):
    model = token_model(seed, **kwargs)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def budget_between(model_kwargs: dict | None = None, share: float = 0.5) -> tuple[int, int, int]:
    """(budget, least peak, plain first-step peak): the budget ``share`` of the way from the least
    peak (a fake profile solved for "min") to the plain first step's measured peak."""
    model, optimizer = fresh(**(model_kwargs or {}))
    batch = token_batches(1)[0]
    profile = profile_step(model, lambda m: token_loss(m, batch), optimizer=optimizer, fake=True)
    least = solve(profile, "min", "flops").predicted_peak_bytes
    plain = run_steps(model, optimizer, [batch])[0][0]
    return least + int((plain - least) * share), least, plain


@pytest.fixture(scope="module")
def plain_run():
    model, optimizer = fresh()
    return run_steps(model, optimizer, token_batches())


@pytest.mark.parametrize("share", [0.25, 0.7])
def test_the_first_step_of_a_hand_written_loop_holds_a_budget_a_plain_step_cannot_meet(plain_run, share):
    budget, least, plain = budget_between(share=share)
    assert least < budget < plain == plain_run[0][0]
    model, optimizer = fresh()
    plans = ShapePlans(model, token_loss, budget, optimizer=optimizer, verbose=False)
    peaks, losses = run_steps(model, optimizer, token_batches(), before=plans.use)
    assert all(peak <= budget for peak in peaks), (budget, peaks, plain_run[0])
    assert losses == plain_run[1]
    assert plans.counts.real_profiles == 0 and plans.counts.fake_profiles == 1 and plans.installed.predicted_overhead > 0


def test_a_step_above_its_prediction_calibrates_the_plans_before_the_next_step():
    """The loop holds memory no profile sees (a buffer it allocates in every step): the first step
    peaks above its plan's prediction, the package's meter says by how much, ``calibrate`` adds it to
    the profile, and the next step runs under a re-solved plan that holds the budget. (SGD: no
    optimizer state, so the first step is a steady one; with Adam the first step shows the excess
    less the state it does not hold yet, and the next measured step the rest.)"""
    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=1e-3)

    model = token_model()
    plain = run_steps(model, sgd(model), token_batches())
    budget = budget_between(share=0.6)[0]
    model = token_model()
    optimizer = sgd(model)
    plans = ShapePlans(model, token_loss, budget, optimizer=optimizer, verbose=False)
    first = plans.plan(token_batches(1)[0])
    unseen = budget - first.predicted_peak_bytes + 64 * 1024
    windows = []

    def before(batch):
        plans.use(batch)
        windows.append(PeakWindow(model, optimizer))

    peaks, losses = run_steps(model, optimizer, token_batches(), before=before, held=lambda step: unseen,
                              after=lambda step: plans.calibrate(windows[step].close()))
    assert peaks[0] > budget  # memory the plan could not know of
    assert all(peak <= budget for peak in peaks[1:]), (budget, peaks)
    assert plans.counts.calibrations == 1 and plans.counts.installs == 2 and plans.counts.fake_profiles == 1
    assert plans.installed.predicted_overhead > first.predicted_overhead
    assert any("calibrated by a measured step" in note for note in plans.installed.notes)
    assert losses == plain[1]


class ReadsValues(nn.Module):
    """A block whose code reads a value (a data-dependent branch): fake tensors cannot run it."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        return self.net(x) if float(x.mean()) < 1e9 else x


def test_a_model_fake_tensors_cannot_run_gets_the_fallback_plan_before_its_first_step():
    model, optimizer = fresh(block=ReadsValues)
    plain = run_steps(model, optimizer, token_batches())
    model, optimizer = fresh(block=ReadsValues)
    plans = ShapePlans(model, token_loss, "min", optimizer=optimizer, verbose=False)
    with pytest.warns(UserWarning, match="fake tensors cannot run the model"):
        peaks, losses = run_steps(model, optimizer, token_batches(), before=plans.use)
    assert plans.installed.fallback and {"1", "2", "3", "4"} <= set(plans.installed.checkpointed)
    assert plans.counts.real_profiles == 0 and losses == plain[1]
    assert max(peaks) < 0.7 * min(plain[0]), (peaks, plain[0])  # every block recomputed from the first step


def test_fake_false_profiles_the_first_batch_for_real_only_where_its_plain_step_fits(plain_run):
    model, optimizer = fresh()
    roomy = ShapePlans(model, token_loss, 4 * max(plain_run[0]), optimizer=optimizer, fake=False, cost="time",
                       verbose=False)
    roomy.use(token_batches(1)[0])
    assert roomy.counts.real_profiles == 1 and not roomy.installed.checkpointed
    budget, _, _ = budget_between(share=0.5)
    model, optimizer = fresh()
    tight = ShapePlans(model, token_loss, budget, optimizer=optimizer, fake=False, verbose=False)
    with pytest.warns(UserWarning, match="not profiled for real"):
        peaks, _ = run_steps(model, optimizer, token_batches(1), before=tight.use)
    assert tight.counts.real_profiles == 0 and peaks[0] <= budget and tight.installed.predicted_overhead > 0


def test_cost_time_prices_fake_profiles_at_the_seconds_of_a_measured_step():
    model, optimizer = fresh()
    plans = ShapePlans(model, token_loss, "min", optimizer=optimizer, cost="time", verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cost="time" with a fake first profile is no error, no warning
        plan = plans.use(token_batches(1)[0])
    assert plans.calibrate(plan.predicted_peak_bytes, seconds=0.5)  # re-priced: the plans are solved again
    repriced = plans.use(token_batches(1)[0])
    profile = plans.profile_of(repriced)
    step_flops = profile.baseline_costs.flops * (1 + repriced.predicted_overhead)
    assert abs(profile.baseline_costs.time / profile.baseline_costs.flops * step_flops - 0.5) < 1e-9
    assert repriced.actions == plan.actions and not plans.calibrate(plan.predicted_peak_bytes, seconds=9.0)
