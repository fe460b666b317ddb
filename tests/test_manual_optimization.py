"""Lightning manual optimization with two optimizers, planned by AutoRemat, and ``plan_remat`` with a
list of optimizers: every optimizer's state and step counted. A small GPT-2 whose transformer
blocks train with AdamW and the rest with Adam, stepped by ``training_step`` itself, holds a budget
of static memory + 50% of its activations over steady steps (torch.profiler's allocation events, from
the step's zero_grad to the end of its optimizer steps), the prediction is within 5% of that peak,
and the losses equal those of the same run without the callback."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_remat import AutoRemat, plan_remat
from lightning_remat.models import build
from lightning_remat.runtime.profiling.optimizer_step import optimizer_step_cost
from tests.torch_meter import TorchPeak, static_bytes

SIZES = dict(layers=3, hidden=64, seq_len=64, batch_size=4, vocab=128)
STEPS, FIRST_STEADY = 5, 2  # batch 0 planned, batch 1 measured by the callback, then steady ones


def _split(model):
    blocks = list(model.transformer.h.parameters())
    ids = {id(p) for p in blocks}
    return blocks, [p for p in model.parameters() if id(p) not in ids]


class TwoOptimizers(L.LightningModule):
    """GPT-2 under manual optimization: AdamW on the blocks, Adam on embeddings, norms and head.

    Measures its own steady steps: from the zero_grad at the start of ``training_step`` (after it,
    the previous step's gradients are gone) to the end of the batch (``peaks``)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.model = build("gpt2", **SIZES).model
        self.peaks, self.static, self.meter = [], None, None

    def train_dataloader(self):
        ids = torch.randint(0, SIZES["vocab"], (STEPS * SIZES["batch_size"], SIZES["seq_len"]),
                            generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(ids), batch_size=SIZES["batch_size"])

    def configure_optimizers(self):
        blocks, rest = _split(self.model)
        return torch.optim.AdamW(blocks, lr=1e-3), torch.optim.Adam(rest, lr=1e-3)

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        if batch_idx >= FIRST_STEADY and self.meter is None:
            self.static = self.static or static_bytes(self, self.trainer.optimizers)
            self.meter = TorchPeak(self, self.trainer.optimizers).start()
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.manual_backward(loss)
        first.step()
        second.step()
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.meter is not None:
            self.peaks.append(self.meter.stop())
            self.meter = None


def _fit(*callbacks):
    module = TwoOptimizers()
    losses = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[*callbacks, Losses()])
    trainer.fit(module)
    return module, losses


def test_autoremat_plans_manual_optimization_with_two_optimizers():
    plain, plain_losses = _fit()
    baseline = max(plain.peaks)
    budget = plain.static + (baseline - plain.static) // 2
    callback = AutoRemat(budget=budget, verbose=False)
    planned, losses = _fit(callback)
    plan = callback.plan
    assert plan is not None and plan.checkpointed
    steady = max(planned.peaks)
    assert steady <= budget, (steady, budget, baseline)
    assert abs(plan.predicted_peak_bytes - steady) <= 0.05 * steady, (plan.predicted_peak_bytes, steady)
    assert callback.measured_peak_bytes <= budget
    assert losses == plain_losses


def test_autoremat_plans_manual_optimization_on_fake_tensors():
    """The fake twin's ``self.optimizers()`` reaches the trainer as the module's does (the twin once
    lost it: "not attached to a Trainer"), and the fake plan holds its budget as the real one does."""
    plain, plain_losses = _fit()
    budget = plain.static + (max(plain.peaks) - plain.static) // 2
    callback = AutoRemat(budget=budget, fake=True, cost="flops", verbose=False)
    planned, losses = _fit(callback)
    plan = callback.plan
    assert plan is not None and plan.checkpointed
    steady = max(planned.peaks)
    assert steady <= budget, (steady, budget)
    assert abs(plan.predicted_peak_bytes - steady) <= 0.05 * steady, (plan.predicted_peak_bytes, steady)
    assert losses == plain_losses


def test_plan_remat_counts_every_optimizer_in_a_list_or_tuple():
    model = build("gpt2", **SIZES).model
    blocks, rest = _split(model)
    first, second = torch.optim.AdamW(blocks), torch.optim.Adam(rest)
    ids = torch.randint(0, SIZES["vocab"], (SIZES["batch_size"], SIZES["seq_len"]))
    step = lambda m: m(input_ids=ids, labels=ids).loss  # noqa: E731
    alone = plan_remat(model, step, "min", optimizer=first)
    both = plan_remat(model, step, "min", optimizer=[first, second])
    assert plan_remat(model, step, "min", optimizer=(first, second)).predicted_peak_bytes == both.predicted_peak_bytes
    # The second optimizer's state (Adam: two tensors per parameter, and its step count) is counted too.
    second_state = optimizer_step_cost(second).state_bytes
    assert second_state >= 2 * sum(p.numel() * p.element_size() for p in rest)
    assert both.predicted_peak_bytes >= alone.predicted_peak_bytes + second_state
    assert not first.state and not second.state  # profiling changed nothing


def test_two_backward_passes_in_one_step_are_profiled_as_they_run():
    """A training_step with two manual_backward calls (a GAN's two phases) runs the model twice, each
    graph freed at its backward: profiled so (the second run's first place is fresh: nothing of the
    first run alive), the prediction of a mixed plan equals the peak of the step run by hand."""
    from lightning_remat import apply_plan, measure_step, profile_step, solve
    from lightning_remat.integrations.lightning.step import manual_step_closure

    class TwoPhases(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
                                             for _ in range(4)])

        def training_step(self, batch, batch_idx):
            self.manual_backward(self.net(batch).square().mean())
            self.manual_backward(self.net(batch.flip(0)).abs().mean())

    def by_hand(module):  # the same step, without Lightning or the package
        module.net(x).square().mean().backward()
        return module.net(x.flip(0)).abs().mean()

    module, x = TwoPhases(), torch.randn(64, 32)
    optimizer = torch.optim.Adam(module.parameters())
    profile = profile_step(module, manual_step_closure(module, x), optimizer=optimizer)
    assert [(s.name, s.call, s.fresh) for s in profile.stages] == \
        [(f"net.{i}", 0, False) for i in range(4)] + [(f"net.{i}", 1, i == 0) for i in range(4)]
    plan = solve(profile, (solve(profile, "min", cost="flops").predicted_peak_bytes + profile.baseline_peak_bytes) // 2,
                 cost="flops")
    apply_plan(module, plan)
    measured = max(measure_step(module, by_hand, optimizer).peak_bytes for _ in range(2))
    # The closure's returned loss (its backward does nothing) adds a few bytes over the step by hand.
    assert 0 <= plan.predicted_peak_bytes - measured <= 64, (plan.predicted_peak_bytes, measured)
    assert [action.stage for action in plan.actions] == [f"net.{i}" for i in range(4)]
    assert plan.predicted_peak_bytes <= plan.baseline_peak_bytes
