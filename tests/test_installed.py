"""What is installed is what the plan says (issue 29), checked after every install and at every step.

The defect this file was written for: a new batch shape planned on fake tensors ran the fake profile on
a twin of the model that shared the installer's records, so lifting the plan from the twin switched
the model's recompute off; the new shape got the same plan, so nothing was installed again, and every
later step ran without recomputation while the plan still named its modules (1.28-1.34x the budget).

The scenario: 4 residual MLP blocks over token embeddings, batches of 8 sequences of 32, 34 and 32
tokens (dynamic padding), SGD with momentum, and a budget at the least peak of the longest batch, so that both
shapes get the same plan (the case where the plan is not installed again). Every step's peak is
measured with ``torch.profiler``'s allocation events (``tests/torch_meter.py``), planning included.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_remat import InstallationMismatchError, apply_plan
from lightning_remat.core.plan import Plan, StageAction
from lightning_remat.runtime.installing.installer import install, uninstall
from lightning_remat.runtime.installing.records import RECORD, SEGMENTS, installed_hooks
from lightning_remat.runtime.installing.installer import check_installed, installed_actions, planned_actions
from lightning_remat.runtime.targets.fake import fake_model, new_fake_mode
from lightning_remat.service.shape_plans import ShapePlans
from tests.torch_meter import TorchPeak

LENGTHS = (32, 34, 32)
# checkpoint(preserve_rng_state=True) keeps the CPU RNG state (5056 bytes) per recomputed module from
# forward to backward, which the plan's prediction leaves out on the CPU (a GPU budget does not hold
# it): room for it, and not enough for a cheaper plan at the shorter batch.
RNG_STATES = 32 * 1024


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 16), *[Block() for _ in range(4)])


def _loss(model, ids):
    return model(ids).square().mean()


def _batches():
    torch.manual_seed(1)
    return [torch.randint(0, 64, (8, length)) for length in LENGTHS]


@pytest.fixture(scope="module")
def budget():
    """The least peak at the longest batch (planned on fake tensors), with room for the RNG states."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plan = ShapePlans(model, _loss, "min", optimizer=optimizer, fake=True).plan(_batches()[1])
    return plan.predicted_peak_bytes + RNG_STATES


def _installed_as_planned(model, plan):
    """Whether what runs on ``model`` is ``plan``, and recomputes something (the scenario's plans do)."""
    return installed_actions(model) == planned_actions(plan) and bool(installed_actions(model)["recompute"])


# ------------------------------------------------------------------------------ the fake twin


def test_a_fake_twin_carries_no_plan_and_leaves_the_models_records_forwards_and_hooks_untouched():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(5)])
    plan = Plan([StageAction.recompute("0", policy="save_matmuls"), StageAction.in_segment("1", ["1", "2"]),
                 StageAction.in_segment("2", ["1", "2"]), StageAction.offload("3")])
    install(model, plan, order=["0", "1", "2", "3", "4"])  # "3" is released by a forward hook on "4"
    calls = []
    model[4].register_forward_hook(lambda *_: calls.append(1))  # a user's hook
    seen = {name: (type(m), dict(m.__dict__), {k: (v, dict(v)) for k, v in vars(m).items()
                                                if "hooks" in k and isinstance(v, dict)})
            for name, m in model.named_modules()}
    ours = installed_hooks(model)
    assert ours and ours <= set(model[4]._forward_hooks)

    twin = fake_model(model, new_fake_mode())
    for name, m in twin.named_modules():
        assert RECORD not in m.__dict__ and SEGMENTS not in m.__dict__ and "forward" not in m.__dict__, name
        assert not getattr(type(m), "_remat_segmented", False), name
        for key, value in vars(m).items():
            if "hooks" in key and isinstance(value, dict):
                assert value is not seen[name][2][key][0] and not set(value) & ours, (name, key)
    assert len(twin[4]._forward_hooks) == 1  # the user's hook, in a dict of the twin's own
    # A plan put on the twin and lifted from it (what a fake profile does) is the twin's alone.
    apply_plan(twin, Plan([StageAction.offload("1"), StageAction.recompute("4")]))
    uninstall(twin)
    for name, m in model.named_modules():
        cls, state, hooks = seen[name]
        assert type(m) is cls and m.__dict__.keys() == state.keys(), name
        assert all(m.__dict__[k] is v for k, v in state.items()), name  # the same objects: records, forwards
        assert {k: (v, dict(v)) for k, v in vars(m).items() if "hooks" in k and isinstance(v, dict)} == hooks, name
    check_installed(model, plan)
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert calls == [1]


# ------------------------------------------------------------------------------ every step, every integration


def test_shape_plans_keeps_the_plan_installed_when_a_new_shape_gets_the_same_plan(budget):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plans = ShapePlans(model, _loss, budget, optimizer=optimizer, fake=True)
    peaks = []
    for ids in _batches():
        meter = TorchPeak(model, optimizer).start()
        plan = plans.use(ids)
        assert _installed_as_planned(model, plan), (ids.shape, installed_actions(model), plan.checkpointed)
        _loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peaks.append(meter.stop())
    # Both shapes got one plan, installed once: the case in which nothing is installed again.
    assert plans.counts.installs == 1 and len(plans.plans) == 2, plans.counts
    assert max(peaks) <= budget, (peaks, budget)


def test_an_installation_undone_behind_the_plans_back_stops_the_next_step_naming_both():
    model = _model()
    plans = ShapePlans(model, _loss, "min", fake=True)
    ids = _batches()[0]
    plan = plans.use(ids)
    victim = plan.checkpointed[0]
    module = model.get_submodule(victim)
    del module.__dict__[RECORD], module.forward  # stripped by someone else
    with pytest.raises(InstallationMismatchError, match=r"the plan says .*installed is") as caught:
        plans.use(ids)  # the same shape: its plan is "installed already", and is checked all the same
    assert victim in caught.value.planned["recompute"] and victim not in caught.value.installed["recompute"]
    # A forward put in place of ours (the record left behind) does not run the plan either.
    apply_plan(model, plan)
    module.forward = module.__dict__[RECORD].original
    with pytest.raises(InstallationMismatchError, match=repr(victim)):
        plans.use(ids)


def _lightning_run(callback):
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from lightning_remat.runtime.installing.installer import installation_mismatch

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model()

        def training_step(self, batch, batch_idx):
            return _loss(self.model, batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    class Watch(L.Callback):
        """Opens each step's peak window before AutoRemat plans; after AutoRemat, reads what is installed."""

        def __init__(self):
            self.peaks, self.mismatches, self.meter = [], [], None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.meter = TorchPeak(pl_module, trainer.optimizers).start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.peaks.append(self.meter.stop())
            self.mismatches.append(installation_mismatch(pl_module, callback.plan))

    watch = Watch()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=len(LENGTHS), callbacks=[watch, callback],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(Lit(), DataLoader(_batches(), batch_size=None))
    return watch


def test_autoremat_runs_every_step_under_its_plan_as_planned(budget):
    from lightning_remat import AutoRemat

    callback = AutoRemat(budget=budget, cost="flops", fake=True, verbose=False)
    watch = _lightning_run(callback)
    assert watch.mismatches == [None] * len(LENGTHS) and callback.plan.checkpointed
    assert callback.shape_plans.counts.installs == 1 and len(callback.shape_plans.plans) == 2
    assert max(watch.peaks) <= budget, (watch.peaks, budget)


def test_the_accelerate_session_runs_every_planned_step_under_its_plan_as_planned(budget, monkeypatch):
    from lightning_remat.accelerate import ENV_BUDGET, ENV_COST, RematAccelerator, remat_session

    monkeypatch.setenv(ENV_BUDGET, str(budget))
    monkeypatch.setenv(ENV_COST, "flops")
    accelerator = RematAccelerator()
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    session = remat_session(model)
    peaks, planned = [], []
    for ids in _batches():
        meter = TorchPeak(model, optimizer).start()
        loss = _loss(model, ids)  # the session installs the plan for this shape before the forward runs
        planned.append(session.plan is not None and _installed_as_planned(model, session.plan))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
        peaks.append(meter.stop())
    # The first step is planned before it runs (fake tensors) and observed under that plan (planned
    # again from it, at its end): every step runs under its plan.
    assert planned == [True, True, True] and session.shape_plans.counts.installs == 1, session.shape_plans.counts
    assert max(peaks) <= budget, (peaks, budget)
