"""AutoRemat and the loops it does not plan, and the setups it refuses or has just gained.

- Validation batches are predicted before they run (no activations saved, but their own batch and
  the training's memory alive): a validation batch 4x the training one that would exceed the
  budget is warned about before its first batch runs, naming the largest validation batch that
  fits; a validation batch that fits gets no warning. The prediction is checked against the
  validation step's real peak (torch.profiler's allocation events).
- Lightning's ``DeepSpeedStrategy`` is refused with an ``UnsupportedSetupError`` naming the
  workarounds (the real class, not instantiated: that needs deepspeed, which is not installed here).
- ``AutoRemat(policies=...)``: op-level policies in a Lightning run hold the budget.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_remat import AutoRemat
from lightning_remat.core.errors import UnsupportedSetupError
from tests.lightning_gpt2 import SMALL, LitGPT2, SteadyPeaks
from tests.torch_meter import TorchPeak

STEPS = 4
# A vocabulary large enough that the logits of a validation batch 4x the training one exceed the budget.
SIZES = dict(vocab=2048)


class WithValidation(LitGPT2):
    """LitGPT2 with a validation loop of ``val_batch_size`` sequences a batch; it records the order
    of events (``events``: warnings and validation steps) and each validation batch's real peak."""

    def __init__(self, val_batch_size: int):
        super().__init__(**SIZES)
        self.val_batch_size, self.events = val_batch_size, []

    def val_dataloader(self):
        ids = torch.randint(0, self.sizes["vocab"], (2 * self.val_batch_size, self.sizes["seq_len"]),
                            generator=torch.Generator().manual_seed(2))
        return DataLoader(TensorDataset(ids), batch_size=self.val_batch_size)

    def validation_step(self, batch, batch_idx):
        self.events.append(("validation_step", batch_idx))
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss


class ValidationPeaks(L.Callback):
    """The real peak of every validation batch (after AutoRemat's prediction: listed after it)."""

    def __init__(self):
        self.peaks, self.meter = [], None

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.meter = TorchPeak(pl_module, trainer.optimizers).start()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.peaks.append(self.meter.stop())


def _fit(module, *callbacks, **trainer_args):
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                        **trainer_args)
    trainer.fit(module)
    return trainer


@pytest.fixture(scope="module")
def budget():
    """Static memory + 50% of the activations of the training step (batch 2), measured without the package."""
    module, peaks = LitGPT2(**SIZES), SteadyPeaks(first=2)
    _fit(module, peaks)
    static = sum(p.numel() * p.element_size() for p in module.parameters()) * 4  # weights, gradients, Adam's two
    return static + (max(peaks.peaks) - static) // 2


@pytest.mark.parametrize("val_batch_size, warned", [(4 * SMALL["batch_size"], True), (SMALL["batch_size"], False)])
def test_a_validation_batch_over_the_budget_is_warned_about_before_it_runs(budget, val_batch_size, warned):
    module, measured = WithValidation(val_batch_size), ValidationPeaks()
    callback = AutoRemat(budget=budget, verbose=False)
    callback.loop_peaks.warn = lambda message: module.events.append(("warning", message))
    # Validation after the second training batch: the optimizer's state and the gradients are alive.
    _fit(module, callback, measured, val_check_interval=2, num_sanity_val_steps=0, limit_val_batches=1)

    warnings = [message for kind, message in module.events if kind == "warning"]
    predicted = max(callback.loop_peaks.predicted.values())
    real = max(measured.peaks)
    assert abs(predicted - real) <= 0.05 * real, (predicted, real)
    if not warned:
        assert not warnings and real <= budget, (warnings, real, budget)
        return
    assert real > budget, (real, budget)  # the case is real: the validation batch does exceed the budget
    assert module.events[0][0] == "warning", module.events[:2]  # before the first validation step ran
    assert len(warnings) == 1 and f"validation batch of {val_batch_size} " in warnings[0]
    largest = int(warnings[0].split("The largest validation batch that fits is ")[1].rstrip("."))
    assert 1 <= largest < val_batch_size
    fit = next(iter(callback.loop_peaks.fits.values()))
    alive = predicted - fit.peak_at(val_batch_size, 0)
    assert fit.peak_at(largest, alive) <= budget < fit.peak_at(largest + 1, alive)


class _DeepSpeedLike:
    """What the callback sees of a trainer under Lightning's DeepSpeedStrategy."""

    def __init__(self, strategy):
        self.strategy = strategy


def test_deepspeed_strategy_is_refused_with_the_workaround():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # the real class; __init__ needs deepspeed
    with pytest.raises(UnsupportedSetupError, match="ModelParallelStrategy.*plan_remat"):
        AutoRemat(budget="1GB").setup(_DeepSpeedLike(strategy), LitGPT2(), "fit")

    class DeepSpeedStrategyOfMine(L.strategies.SingleDeviceStrategy):  # a subclass by another name
        pass

    with pytest.raises(UnsupportedSetupError):
        AutoRemat(budget="1GB").setup(_DeepSpeedLike(DeepSpeedStrategyOfMine(device="cpu")), LitGPT2(), "fit")


def test_op_level_policies_hold_the_budget_in_a_lightning_run(budget):
    module, peaks = LitGPT2(**SIZES), SteadyPeaks(first=2)
    callback = AutoRemat(budget=budget, policies=["save_matmuls"], verbose=False)
    _fit(module, callback, peaks)
    plan = callback.plan
    # The policy is what the plan uses (cheaper than recomputing blocks whole at this budget).
    assert plan is not None and plan.policies and set(plan.policies.values()) == {"save_matmuls"}
    assert max(peaks.peaks) <= budget
    assert abs(plan.predicted_peak_bytes - max(peaks.peaks)) <= 0.05 * max(peaks.peaks)


class _SkipsEverything(LitGPT2):
    def training_step(self, batch, batch_idx):
        self.model(input_ids=batch[0])  # runs, but returns no loss: Lightning skips the batch
        return None


def test_a_fit_whose_training_step_skips_every_batch_says_nothing_was_planned_and_why():
    """Before: no plan and no word. Now a warning at the end of training, naming the skip."""
    callback = AutoRemat(budget="min", cost="flops", verbose=False)
    with pytest.warns(UserWarning, match=r"planned nothing: every one of the 3 training batch\(es\) was skipped "
                                         r"\(training_step returned None"):
        L.Trainer(max_epochs=1, limit_train_batches=3, accelerator="cpu", devices=1, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[callback]).fit(_SkipsEverything())
    assert callback.plan is None
