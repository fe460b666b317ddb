"""Gradient accumulation: from the second micro-batch of a window on, every gradient is alive through
forward and backward. The plan counts it, the reported peak is the largest over a whole steady
window, and the budget holds (Lightning and Accelerate)."""

import lightning.pytorch as L
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader, TensorDataset

from lightning_remat import AutoRemat, ProfileOptions, profile_step
from lightning_remat.accelerate import RematPlugin, prepare_remat, remat_session
from lightning_remat.models import build
from lightning_remat.runtime.measuring.measure import PeakWindow
from tests.lightning_gpt2 import LitGPT2

SMALL = dict(layers=3, hidden=64, seq_len=64, batch_size=2, vocab=256)
WINDOW = 4


def _ids(n):
    return torch.randint(0, SMALL["vocab"], (n, SMALL["seq_len"]), generator=torch.Generator().manual_seed(1))


def _budget(model, step, optimizer):
    profile = profile_step(model, step, optimizer=optimizer, options=ProfileOptions(accumulation_steps=WINDOW))
    return int(profile.static_bytes + 0.5 * profile.baseline_activation_bytes)


class WindowPeaks(L.Callback):
    """The MemTracker peak of every whole accumulation window from the third on (the callback
    measures the second), and the losses."""

    def __init__(self):
        self.peaks, self.losses, self.window = [], [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= 2 * WINDOW and batch_idx % WINDOW == 0:
            self.window = PeakWindow(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if self.window is not None and batch_idx % WINDOW == WINDOW - 1:
            self.peaks.append(self.window.close())
            self.window = None


def _fit(tmp_path, callbacks):
    L.seed_everything(0)
    lit = LitGPT2(**SMALL)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=WINDOW, logger=False,
                        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path, deterministic=True)
    trainer.fit(lit, DataLoader(TensorDataset(_ids(3 * WINDOW * SMALL["batch_size"])), batch_size=SMALL["batch_size"]))
    return lit


def test_lightning_accumulation_window_holds_the_budget_and_is_reported(tmp_path):
    plain = WindowPeaks()
    _fit(tmp_path, [plain])
    lit = LitGPT2(**SMALL)
    first = _ids(SMALL["batch_size"])
    budget = _budget(lit, lambda m: m.model(input_ids=first, labels=first).loss, torch.optim.Adam(lit.parameters()))
    callback, recorded = AutoRemat(budget=budget, cost="flops", verbose=False), WindowPeaks()
    _fit(tmp_path, [callback, recorded])
    assert callback.plan.checkpointed
    assert any("gradient accumulation over 4" in note for note in callback.plan.notes)
    steady = max(recorded.peaks)
    assert steady <= budget and callback.measured_peak_bytes <= budget
    # The reported figure is a whole steady window's: the same as the next window's.
    assert callback.measured_peak_bytes == pytest.approx(steady, rel=0.01)
    assert callback.measured_peak_bytes == pytest.approx(callback.plan.predicted_peak_bytes, rel=0.05)
    assert recorded.losses == plain.losses  # bit-equal, dropout included
    # Without counting the gradients alive in later micro-batches the plan would not hold.
    assert max(plain.peaks) > budget


def test_accelerate_accumulation_window_holds_the_budget_and_is_reported():
    AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    model = build("gpt2", **SMALL).model
    ids = _ids(SMALL["batch_size"])
    step = lambda m: m(input_ids=ids, labels=ids).loss
    budget = _budget(model, step, torch.optim.Adam(model.parameters()))
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=WINDOW)
    prepare_remat(model, RematPlugin(budget=budget, cost="flops"), accelerator=accelerator)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    later = []
    for micro in range(4 * WINDOW):
        if micro >= 3 * WINDOW and micro % WINDOW == 0:
            window = PeakWindow(model, optimizer.optimizer)
        with accelerator.accumulate(model):
            accelerator.backward(step(model))
            optimizer.step()
            optimizer.zero_grad()
        if micro >= 3 * WINDOW and micro % WINDOW == WINDOW - 1:
            later.append(window.close())
    metrics = accelerator.remat_metrics
    assert remat_session(model) is None or remat_session(model).phase == "done"
    assert metrics["remat/num_checkpointed"] > 0
    assert metrics["remat/measured_peak_bytes"] <= budget and max(later) <= budget
    assert metrics["remat/measured_peak_bytes"] == pytest.approx(max(later), rel=0.01)
    assert metrics["remat/measured_peak_bytes"] == pytest.approx(metrics["remat/predicted_peak_bytes"], rel=0.05)
    AcceleratorState._reset_state(True)
