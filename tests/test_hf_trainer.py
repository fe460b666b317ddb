"""The Hugging Face Trainer with ``RematTrainerCallback``: a tiny GPT-2 (random weights, nothing
downloaded) trained by ``Trainer`` on the CPU holds a budget of static memory + 50% of its
activations over steady steps (torch's MemTracker, opened by the test), the prediction is within 5%
of that peak, and the logged losses equal those of the same run without the callback."""

from __future__ import annotations

import pytest
import torch

from lightning_remat import RematTrainerCallback
from lightning_remat.accelerate import ENV_BUDGET
from lightning_remat.core.errors import AlreadyCheckpointedError

from tests.torch_meter import TorchPeak, static_bytes

transformers = pytest.importorskip("transformers")

STEPS = 6
FIRST_STEADY = 3  # step 0 observed and planned, step 1 measured by the session, then steady steps


def _model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=128)
    return transformers.GPT2LMHeadModel(config)


def _data(n: int = 48):
    ids = torch.randint(0, 128, (n, 64), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": x, "labels": x} for x in ids]


class SteadyPeaks(transformers.TrainerCallback):
    """Torch's MemTracker peak of every optimizer step from ``FIRST_STEADY`` on, and the static bytes
    (parameters, gradients, optimizer state) at the first of them."""

    def __init__(self):
        self.peaks, self.static, self.meter = [], None, None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step >= FIRST_STEADY:
            self.static = self.static or static_bytes(model, optimizer)
            self.meter = TorchPeak(model, optimizer).start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.meter is not None:
            self.peaks.append(self.meter.stop())
            self.meter = None


def _train(tmp_path, *callbacks, accumulation: int = 1, **arguments):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
        max_steps=STEPS, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, **arguments)
    peaks = SteadyPeaks()
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_data(), callbacks=[peaks, *callbacks])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, peaks, losses


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_holds_the_budget_from_the_environment_with_the_same_losses(tmp_path, monkeypatch, accumulation):
    monkeypatch.delenv(ENV_BUDGET, raising=False)
    _, plain, plain_losses = _train(tmp_path, accumulation=accumulation)
    baseline = max(plain.peaks)
    budget = plain.static + (baseline - plain.static) // 2
    # The Trainer builds its own Accelerator: the environment reaches it through the callback.
    monkeypatch.setenv(ENV_BUDGET, str(budget))
    callback = RematTrainerCallback()
    trainer, planned, losses = _train(tmp_path, callback, accumulation=accumulation)

    plan = callback.plan
    assert plan is not None and plan.checkpointed
    steady = max(planned.peaks)
    assert steady <= budget, (steady, budget, baseline)
    assert abs(plan.predicted_peak_bytes - steady) <= 0.05 * steady, (plan.predicted_peak_bytes, steady)
    assert losses == plain_losses
    logged = {k: v for entry in trainer.state.log_history for k, v in entry.items() if k.startswith("remat/")}
    assert logged["remat/budget_bytes"] == budget
    assert logged["remat/predicted_peak_bytes"] == plan.predicted_peak_bytes
    assert logged["remat/measured_peak_bytes"] <= budget


def test_without_a_budget_the_callback_warns_and_leaves_the_run_alone(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_BUDGET, raising=False)
    callback = RematTrainerCallback()
    model = _model()
    with pytest.warns(UserWarning, match="no budget given"):
        callback.on_train_begin(None, None, None, model=model)
    assert callback.plan is None and callback.session is None


def test_the_trainer_s_own_gradient_checkpointing_is_refused(tmp_path):
    with pytest.raises(AlreadyCheckpointedError):
        _train(tmp_path, RematTrainerCallback(budget="1GB"), gradient_checkpointing=True)
