"""Lightning Fabric: ``plan_remat`` and ``apply_plan`` before ``fabric.setup`` and after it (on the
``_FabricModule`` and ``_FabricOptimizer`` it returns). A small GPT-2 trained in a Fabric loop on the
CPU holds a budget of static memory + 50% of its activations over steady steps (torch.profiler's
allocation events), the prediction is within 5% of that peak, and the losses equal those of the
same loop without the package."""

from __future__ import annotations

import pytest
import torch

from lightning_remat import apply_plan, plan_remat
from lightning_remat.models import build
from tests.torch_meter import TorchPeak, static_bytes

L = pytest.importorskip("lightning")

STEPS, FIRST_STEADY = 5, 2
SIZES = dict(layers=3, hidden=64, seq_len=64, batch_size=4, vocab=128)


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, SIZES["vocab"], (SIZES["batch_size"], SIZES["seq_len"]), generator=generator)
            for _ in range(STEPS)]


def _step(ids):
    return lambda model: model(input_ids=ids, labels=ids).loss


def _train(budget=None, when=None):
    """Losses and steady peaks of a Fabric loop; with ``when`` ("before"/"after" setup), planned then."""
    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = build("gpt2", **SIZES).model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches, plan = _batches(), None
    if when == "before":
        plan = plan_remat(model, _step(batches[0]), budget, optimizer=optimizer)
        apply_plan(model, plan)
    model, optimizer = fabric.setup(model, optimizer)
    if when == "after":
        plan = plan_remat(model, _step(batches[0]), budget, optimizer=optimizer)
        apply_plan(model, plan)
    losses, peaks, static = [], [], None
    for i, ids in enumerate(batches):
        optimizer.zero_grad()
        meter = None
        if i >= FIRST_STEADY:
            # After zero_grad: the profiler does not see frees of what was allocated before it started.
            static = static or static_bytes(model, optimizer)
            meter = TorchPeak(model, optimizer).start()
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
        if meter is not None:
            peaks.append(meter.stop())
    return losses, max(peaks), static, plan


@pytest.fixture(scope="module")
def plain():
    return _train()


@pytest.mark.parametrize("when", ["before", "after"])
def test_fabric_holds_the_budget_planned_before_or_after_setup_with_the_same_losses(plain, when):
    plain_losses, baseline, static, _ = plain
    budget = static + (baseline - static) // 2
    losses, steady, _, plan = _train(budget, when)
    assert plan.checkpointed
    # Names are the model's own either way: the wrapper is looked through.
    assert all(not name.startswith("_forward_module") for name in plan.checkpointed)
    assert steady <= budget, (steady, budget, baseline)
    assert abs(plan.predicted_peak_bytes - steady) <= 0.05 * steady, (plan.predicted_peak_bytes, steady)
    assert losses == plain_losses


def test_a_plan_made_on_the_fabric_module_applies_to_the_module_inside_and_back():
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = build("gpt2", **SIZES).model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, wrapped_optimizer = fabric.setup(model, optimizer)
    ids = _batches()[0]
    plan = plan_remat(wrapped, _step(ids), "min", optimizer=wrapped_optimizer)
    apply_plan(model, plan)  # the module inside, by the plan's names
    from lightning_remat.runtime.installing.apply import checkpointed_modules

    assert checkpointed_modules(wrapped) == checkpointed_modules(model) == list(plan.checkpointed)
