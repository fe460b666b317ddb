"""A plan belongs to the model and batch it was made for: batches that grow mid-run, and a run
resumed with larger batches or another model, are planned again, and the budget holds. The new
shape is planned on fake-tensor profiles (``service.shape_plans``): no real step runs without
recomputation on the larger batch."""

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_remat.runtime.profiling.profile as profiling
from lightning_remat import AutoRemat, ProfileOptions, profile_step
from lightning_remat.models import build
from lightning_remat.runtime.measuring.measure import PeakWindow

VOCAB, BATCH = 128, 2


class Growing(Dataset):
    """Sequences of 32 tokens for the first ``short`` samples, then of 128."""

    def __init__(self, n=12, short=4):
        self.n, self.short = n, short

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        length = 32 if i < self.short else 128
        return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(i))


class LM(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = build("gpt2", layers=3, hidden=64, seq_len=128, batch_size=BATCH, vocab=VOCAB).model

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Peaks(L.Callback):
    def __init__(self):
        self.peaks, self.window = [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= 4:  # the long batches, after the re-plan and its measured step
            self.window = PeakWindow(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.window is not None:
            self.peaks.append(self.window.close())
            self.window = None


@pytest.fixture
def profiles(monkeypatch):
    """Every profile taken, as "real" or "fake"."""
    calls = []
    real = profiling.profile_step

    def counting(*args, **kwargs):
        options = kwargs.get("options")
        calls.append("fake" if kwargs.get("fake") or (options is not None and options.fake) else "real")
        return real(*args, **kwargs)

    monkeypatch.setattr(profiling, "profile_step", counting)
    return calls


def _trainer(tmp_path, callbacks, steps):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     default_root_dir=tmp_path)


def _budget_for_long_batches():
    lit = LM()
    ids = torch.randint(0, VOCAB, (BATCH, 128))
    profile = profile_step(lit, lambda m: m.model(input_ids=ids, labels=ids).loss,
                           optimizer=torch.optim.Adam(lit.parameters()), options=ProfileOptions())
    return int(profile.static_bytes + 0.5 * profile.baseline_activation_bytes)


def test_batches_that_grow_mid_run_are_planned_again_and_the_budget_holds(tmp_path, profiles):
    budget = _budget_for_long_batches()
    callback, peaks = AutoRemat(budget=budget, cost="flops", verbose=False), Peaks()
    _trainer(tmp_path, [callback, peaks], steps=6).fit(LM(), DataLoader(Growing(), batch_size=BATCH))
    # The short batch on fake tensors, before it runs (the anchor: what AutoRemat adds to it is carried
    # to the new shape); the long one on fake tensors at its own shape.
    assert profiles == ["fake", "fake"]
    assert callback.plan.fingerprint["batch_shapes"] == f"({BATCH}, 128)"
    assert peaks.peaks and max(peaks.peaks) <= budget


def test_a_resumed_run_with_larger_batches_plans_again(tmp_path, profiles):
    budget = _budget_for_long_batches()
    first = AutoRemat(budget=budget, cost="flops", verbose=False)
    trainer = _trainer(tmp_path, [first], steps=1)
    trainer.fit(LM(), DataLoader(Growing(n=4), batch_size=BATCH))  # short batches only
    trainer.save_checkpoint(tmp_path / "short.ckpt")
    assert profiles == ["fake"]
    resumed, peaks = AutoRemat(budget=budget, cost="flops", verbose=False), Peaks()
    _trainer(tmp_path, [resumed, peaks], steps=6).fit(LM(), DataLoader(Growing(short=0), batch_size=BATCH),
                                                     ckpt_path=tmp_path / "short.ckpt")
    # The saved plan was for short batches: planned again on a long one, on fake tensors.
    assert profiles == ["fake", "fake"]
    assert resumed.plan.fingerprint["batch_shapes"] == f"({BATCH}, 128)"
    assert peaks.peaks and max(peaks.peaks) <= budget
