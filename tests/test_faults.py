"""Faults and wrong inputs (issue 25): spellings the docs use are accepted, wrong ones refused with
what is accepted, a user's exceptions surface as themselves, and after any failure the model is
exactly as it was (parameters, names, state_dict keys, forwards, classes)."""

import warnings

import lightning.pytorch as L
import pytest
import torch
from torch import nn

from lightning_remat import ProfileOptions, measure_step, plan_remat, profile_step
from lightning_remat.integrations.accelerate import RematPlugin
from lightning_remat.integrations.lightning.callback import AutoRemat

warnings.filterwarnings("ignore", category=UserWarning)


def chain(blocks=3, width=16):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                           for _ in range(blocks)])


def step_of(width=16):
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(1))
    return lambda model: model(x).square().mean()


def snapshot(model):
    """Everything a failure must leave as it was: names and values of parameters and buffers,
    state_dict keys, each module's class and forward."""
    return ([(n, p.detach().clone()) for n, p in model.named_parameters()],
            [(n, b.clone()) for n, b in model.named_buffers()], list(model.state_dict()),
            [(n, type(m), m.__dict__.get("forward"), type(m).forward) for n, m in model.named_modules()])


def assert_unchanged(model, before):
    after = snapshot(model)
    for (n0, v0), (n1, v1) in zip(before[0] + before[1], after[0] + after[1]):
        assert n0 == n1 and torch.equal(v0, v1), n0
    assert [len(x) for x in before[:2]] == [len(x) for x in after[:2]]
    assert before[2:] == after[2:]


def test_policies_spelled_as_the_docs_spell_them_are_accepted_everywhere():
    names = ("sac:save_matmuls", "save_attention")
    assert ProfileOptions(policies=names).policies == ("save_matmuls", "save_attention")
    assert AutoRemat(budget="1GB", policies=names).config.profile.policies == ("save_matmuls", "save_attention")
    assert RematPlugin(budget="1GB", policies="sac:save_matmuls").config().profile.policies == ("save_matmuls",)
    model = chain()
    plan = plan_remat(model, step_of(), budget="min", policies=("sac:save_matmuls",))
    assert plan.budget_bytes > 0


@pytest.mark.parametrize("bad", [True, 1, 2.5, object(), [True], ["save_matmuls", None]])
def test_policies_that_are_not_names_are_refused_naming_what_is_accepted(bad):
    for make in (lambda: ProfileOptions(policies=bad), lambda: AutoRemat(budget="1GB", policies=bad),
                 lambda: RematPlugin(budget="1GB", policies=bad)):
        with pytest.raises(ValueError, match="save_matmuls") as caught:
            make()
        assert "not iterable" not in str(caught.value)
    model = chain()
    before = snapshot(model)
    with pytest.raises(ValueError, match="policies must be None"):
        plan_remat(model, step_of(), budget="min", policies=True)
    assert_unchanged(model, before)


# ------------------------------------------------------------------ 2: a batch training_step skips


BATCH = 256  # activations well above the parameters, so that a budget binds


class SkipsFirst(L.LightningModule):
    """A chain whose ``training_step`` skips batch 0, the Lightning way (returns None; under manual
    optimization, runs no backward)."""

    def __init__(self, manual=False):
        super().__init__()
        self.net = chain(blocks=4, width=32)
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            return None
        loss = self.net(batch[0]).square().mean()
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        self.manual_backward(loss)
        optimizer.step()
        return loss.detach()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]) if outputs else None)


def fit(module, callbacks, steps=4):
    from torch.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(torch.randn(BATCH * steps, 32, generator=torch.Generator().manual_seed(2))),
                      batch_size=BATCH)
    L.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=callbacks, logger=False,
              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
              deterministic=True).fit(module, data)


@pytest.mark.parametrize("manual", [False, True])
def test_a_batch_training_step_skips_is_not_profiled_and_the_next_one_is(manual):
    L.seed_everything(0)
    plain, plain_losses = SkipsFirst(manual), Losses()
    fit(plain, [plain_losses])
    probe = SkipsFirst(manual)
    x = torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(2))
    profile = profile_step(probe, lambda m: m.net(x).square().mean(), optimizer=torch.optim.Adam(probe.parameters()))
    budget = profile.static_bytes + profile.baseline_activation_bytes // 2

    L.seed_everything(0)
    module, losses, callback = SkipsFirst(manual), Losses(), AutoRemat(budget=budget, verbose=False)
    fit(module, [callback, losses])
    assert callback.profile_count == 1 and callback.plan is not None and callback.plan.checkpointed
    # The budget binds and holds on the measured steady step (profile_steps=1 after the planned batch).
    assert callback.measured_peak_bytes is not None and callback.measured_peak_bytes <= budget
    # The skipped batch trained (was skipped) as without the callback, and so did every later one.
    assert losses.losses[0] is None and losses.losses == plain_losses.losses


def test_measure_step_with_a_number_for_a_loss_says_what_it_needs():
    model = chain()
    before = snapshot(model)
    with pytest.raises(TypeError, match=r"got float .*not loss.item\(\)"):
        measure_step(model, lambda m: m(torch.randn(2, 16)).sum().item())
    assert_unchanged(model, before)
