"""The first step within the budget in every integration (issue 29): ``AutoRemat`` (the Lightning
Trainer), ``RematAccelerator`` / ``prepare_remat`` and ``RematTrainerCallback`` (the Hugging Face Trainer
with a LoRA model, gradient accumulation and a padding collator) plan the first step on fake tensors
before it runs. Each run's budget is below the peak of a plain first step (a first step without
recomputation, or profiled for real, breaks it) and above the least peak; every step's peak is
measured from ``torch.profiler``'s allocator events (``tests/torch_meter.py``: the package's planning
inside the step counts); the losses equal the run without the package.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_remat import profile_step
from lightning_remat.core.solve import solve
from tests.test_first_step import budget_between, fresh, token_batches, token_loss
from tests.tiny_hf import TrainerStepPeaks
from tests.torch_meter import TorchPeak, lightning_peaks, static_bytes


# ------------------------------------------------------------------------------ Lightning


def _lightning_run(callbacks, steps: int = 3):
    """(per-batch peaks, losses) of a Lightning run of the token model (Adam); the meter is the first
    callback, so its window holds ``AutoRemat``'s planning in ``on_train_batch_start``."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = fresh()[0]

        def training_step(self, batch, batch_idx):
            return token_loss(self.model, batch)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    meter = lightning_peaks()  # first among the callbacks: its window opens before planning
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[meter, *callbacks], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Lit(), DataLoader(token_batches(steps), batch_size=None))
    return meter.peaks, meter.losses


def test_autoremat_plans_the_first_step_before_it_runs_and_holds_the_budget():
    from lightning_remat import AutoRemat

    plain_peaks, plain_losses = _lightning_run([])
    budget, least, _ = budget_between(share=0.5)
    assert least < budget < plain_peaks[0], (least, budget, plain_peaks)
    callback = AutoRemat(budget=budget, verbose=False)
    peaks, losses = _lightning_run([callback])
    assert all(peak <= budget for peak in peaks), (budget, peaks, plain_peaks)
    assert losses == plain_losses
    counts = callback.shape_plans.counts
    assert counts.real_profiles == 0 and counts.fake_profiles == 1 and callback.plan.predicted_overhead > 0
    assert callback.measured_peak_bytes <= budget


def test_autoremat_calibrates_by_the_first_step_and_prices_time_from_a_measured_step():
    """Memory no profile sees (a callback holds a buffer through each step): the first step's
    measured peak is above its prediction, the plans are solved again with the difference before
    the second batch (a first step holds no optimizer state yet: the second, steady, step's
    measurement adds the rest), and from the third batch on every step holds the budget. With
    ``cost="time"`` the fake profiles are priced at the seconds per FLOP of the measured steady step."""
    import lightning.pytorch as L

    from lightning_remat import AutoRemat

    budget, _, _ = budget_between(share=0.6)

    class Holds(L.Callback):  # after AutoRemat: its buffer is not in any profile
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.kept = torch.empty(unseen, dtype=torch.uint8)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.kept = None

    plain = AutoRemat(budget=budget, cost="time", verbose=False)
    _lightning_run([plain], steps=1)
    state = 2 * sum(p.numel() * p.element_size() for p in fresh()[0].parameters())  # Adam's, absent at step 0
    unseen = budget - plain.plan.predicted_peak_bytes + state + 64 * 1024
    callback = AutoRemat(budget=budget, cost="time", verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the over-budget warnings of the first two steps
        peaks, _ = _lightning_run([callback, Holds()], steps=5)
    plans = callback.shape_plans
    assert peaks[0] > budget and all(peak <= budget for peak in peaks[2:]), (budget, unseen, peaks)
    assert plans.counts.calibrations >= 1 and plans.counts.fake_profiles == 1 and plans.counts.real_profiles == 0
    assert callback.plan.predicted_overhead > plain.plan.predicted_overhead
    profile = plans.profile_of(callback.plan)
    # Priced at the measured step's seconds per FLOP (before it: a placeholder of 1e-12).
    assert callback.plan.cost_kind == "time" and profile.baseline_costs.time > 1e-11 * profile.baseline_costs.flops


# ------------------------------------------------------------------------------ Accelerate


def _accelerate_run(monkeypatch, budget=None, steps: int = 3):
    """(peaks, losses) of an Accelerate loop whose loss is computed outside the model; with a budget,
    through ``RematAccelerator`` (``ACCELERATE_REMAT_BUDGET``), and its session."""
    from lightning_remat.accelerate import ENV_BUDGET, RematAccelerator, remat_session

    if budget is None:
        monkeypatch.delenv(ENV_BUDGET, raising=False)
    else:
        monkeypatch.setenv(ENV_BUDGET, str(budget))
    accelerator = RematAccelerator()
    model, optimizer = fresh()
    model, optimizer = accelerator.prepare(model, optimizer)
    peaks, losses = [], []
    for ids in token_batches(steps):
        meter = TorchPeak(model, optimizer).start()
        loss = model(ids).square().mean()  # the user's loss, outside the model
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        del loss
        peaks.append(meter.stop())
    return peaks, losses, remat_session(model)


def test_the_accelerate_session_plans_the_first_forward_before_it_runs(monkeypatch):
    plain_peaks, plain_losses, _ = _accelerate_run(monkeypatch)
    budget, least, _ = budget_between(share=0.5)
    assert least < budget < plain_peaks[0], (least, budget, plain_peaks)
    peaks, losses, session = _accelerate_run(monkeypatch, budget)
    assert all(peak <= budget for peak in peaks), (budget, peaks, plain_peaks)
    assert losses == plain_losses
    counts = session.shape_plans.counts
    assert counts.real_profiles == 0 and session.phase == "done" and session.metrics["remat/measured_peak_bytes"] <= budget


def test_prepare_remat_plans_from_the_model_s_own_loss_or_allows_for_the_user_s(monkeypatch):
    """The first plan's profile: a model that returns its own loss is profiled with it; one that
    returns outputs gets the surrogate backward and the allowance for the loss outside it."""
    from lightning_remat.accelerate import RematPlugin, prepare_remat, remat_session

    class OwnLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = fresh()[0]

        def forward(self, ids):
            return token_loss(self.net, ids)

    profiles = {}
    for name, model in (("own", OwnLoss()), ("outputs", fresh()[0])):
        session = remat_session(prepare_remat(model, RematPlugin(budget="min")))
        model(token_batches(1)[0])  # the first forward is planned in its pre-hook
        profiles[name] = session.shape_plans.profile_of(session.plan)
        session.remove()
    allowances = {name: [s for s in p.segments if "the user's loss" in s.name] for name, p in profiles.items()}
    assert not allowances["own"] and len(allowances["outputs"]) == 1
    profile, (allowance,) = profiles["outputs"], allowances["outputs"]
    # Two copies of the 8 x 64 x 32 float32 output, at the end of forward, above the model's own memory there.
    at_end = [s.peak_bytes for s in profile.segments if s.stages_alive == len(profile.stages) and s is not allowance]
    assert allowance.stages_alive == len(profile.stages) and allowance.peak_bytes == max(at_end) + 2 * 8 * 64 * 32 * 4


# ------------------------------------------------------------------------------ the Hugging Face Trainer


transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _lora_gpt2():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_dropout=0.0, target_modules=["c_attn"],
                                                      fan_in_fan_out=True))


def _rows(n: int = 8):
    """Sequences of 40..64 tokens, and a collator that pads each batch to its longest."""
    generator = torch.Generator().manual_seed(2)
    lengths = torch.randint(40, 65, (n,), generator=generator).tolist()
    rows = [{"input_ids": torch.randint(1, 128, (k,), generator=generator)} for k in lengths]

    def collate(features):
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.stack([torch.nn.functional.pad(f["input_ids"], (0, width - len(f["input_ids"]))) for f in features])
        mask = (torch.arange(width)[None, :] < torch.tensor([len(f["input_ids"]) for f in features])[:, None]).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    return rows, collate




def _trainer_run(tmp_path, *callbacks, steps: int = 1):
    rows, collate = _rows()
    peaks = TrainerStepPeaks()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=steps,
        report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        seed=0, train_sampling_strategy="sequential")
    trainer = transformers.Trainer(model=_lora_gpt2(), args=args, train_dataset=rows, data_collator=collate,
                                   callbacks=[peaks, *callbacks])
    trainer.train()
    return peaks, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_the_trainer_with_lora_accumulation_and_padding_holds_the_budget_from_the_first_step(tmp_path, monkeypatch):
    from lightning_remat import RematTrainerCallback
    from lightning_remat.accelerate import ENV_BUDGET

    monkeypatch.delenv(ENV_BUDGET, raising=False)
    plain, plain_losses = _trainer_run(tmp_path)
    # The least peak: a fake profile of the first micro-batch, later micro-batches' gradients alive.
    rows, collate = _rows()
    batch, model = collate(rows[:2]), _lora_gpt2()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    least = solve(profile_step(model, lambda m: m(**batch).loss, optimizer=optimizer, fake=True,
                               accumulation_steps=2), "min", "flops").predicted_peak_bytes
    budget = (least + plain.peaks[0]) // 2
    callback = RematTrainerCallback(budget=budget)
    planned, losses = _trainer_run(tmp_path, callback)
    assert all(peak <= budget for peak in planned.peaks), (budget, planned.peaks, plain.peaks)
    assert plain.peaks[0] > budget and losses == plain_losses
    counts = callback.session.shape_plans.counts
    assert counts.real_profiles == 0 and callback.plan.predicted_overhead > 0
