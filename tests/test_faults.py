"""Faults and wrong inputs (issue 25): spellings the docs use are accepted, wrong ones refused with
what is accepted, a user's exceptions surface as themselves, and after any failure the model is
exactly as it was (parameters, names, state_dict keys, forwards, classes)."""

import functools
import logging
import warnings

import lightning.pytorch as L
import pytest
import torch
from torch import nn

from lightning_remat import (Plan, ProfileOptions, StageAction, RematError, apply_plan, measure_step, plan_remat, profile_step,
                             remove_remat)
from lightning_remat.runtime.installing import installer
from lightning_remat.runtime.installing.apply import checkpointed_modules
from lightning_remat.runtime.installing.offload import offloaded_modules
from lightning_remat.runtime.measuring.user_hooks import part_of_model
from lightning_remat.models import build
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
    state_dict keys, each module's class, forward and mode, and which parameters have gradients."""
    return ([(n, p.detach().clone()) for n, p in model.named_parameters()],
            [(n, b.clone()) for n, b in model.named_buffers()], list(model.state_dict()),
            [(n, type(m), _forward(m), type(m).forward, m.training) for n, m in model.named_modules()],
            [(n, p.grad is None, p.requires_grad) for n, p in model.named_parameters()])


def _forward(module):
    """A module's instance forward: ours is a fresh ``partial`` of the same function each time it is installed."""
    forward = module.__dict__.get("forward")
    return (forward.func, forward.args) if isinstance(forward, functools.partial) else forward


def assert_unchanged(model, before):
    after = snapshot(model)
    for (n0, v0), (n1, v1) in zip(before[0] + before[1], after[0] + after[1]):
        assert n0 == n1 and torch.equal(v0, v1), n0
    assert [len(x) for x in before[:2]] == [len(x) for x in after[:2]]
    assert before[2:] == after[2:]


def test_policies_spelled_as_the_docs_spell_them_are_accepted_everywhere():
    names = ("sac:save_matmuls", "save_attention")
    assert ProfileOptions(policies=names).policies == ("save_matmuls", "save_attention")
    assert ProfileOptions(policies=(n for n in names)).policies == ("save_matmuls", "save_attention")
    assert AutoRemat(budget="1GB", policies=names).config.profile.policies == ("save_matmuls", "save_attention")
    assert RematPlugin(budget="1GB", policies="sac:save_matmuls").config().profile.policies == ("save_matmuls",)
    model = chain()
    plan = plan_remat(model, step_of(), budget="min", policies=("sac:save_matmuls",))
    assert plan.budget_bytes > 0
    apply_plan(model, Plan([StageAction.recompute("0", policy="sac:save_matmuls")]))
    assert installer.recomputed(model) == {"0": "save_matmuls"}


@pytest.mark.parametrize("bad", [True, 1, 2.5, object(), [True], ["save_matmuls", None], {"save_matmuls": 1}])
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
    assert callback.run.profiles == 1 and callback.plan is not None and callback.plan.checkpointed
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


# ------------------------------------------- 3: an exception anywhere in planning surfaces as itself


class Injected(Exception):
    """A user's own exception, raised from inside the model."""


def faults(call):
    """The exception injected at forward call ``call``: a user's, an empty RuntimeError, an out-of-memory
    error, in turn."""
    return (Injected(f"boom at call {call}"), RuntimeError(),
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))[call % 3]


def counted_calls(model, raise_at=None):
    """A hook on the first layer of every block (so recomputes count too), part of the model (it runs in
    planning's passes, as the model's own code does): the number of calls so far; at call ``raise_at``
    it raises ``faults(raise_at)``."""
    count, raised = [0], []

    def hook(module, args):
        count[0] += 1
        if count[0] == raise_at:
            raised.append(faults(raise_at))
            raise raised[-1]

    handles = [block[0].register_forward_pre_hook(part_of_model(hook)) for block in model]
    return count, raised, handles


@pytest.mark.parametrize("target", [{}, {"fake": True, "gpu": "h100", "device": "cuda", "offload": True}],
                         ids=["real", "fake-offload"])
def test_an_exception_at_every_forward_call_of_planning_surfaces_as_itself(target):
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(3))
    model = chain()
    optimizer = torch.optim.Adam(model.parameters())
    plan = lambda: plan_remat(model, lambda m: m(x).square().mean(), "min", optimizer=optimizer, policies=None,
                              **target)
    count, _, handles = counted_calls(model)
    clean = plan()
    for handle in handles:
        handle.remove()
    assert count[0] > 20, count
    # Every kind of option is measured: policies, segments (the blocks chain in one Sequential), offload.
    profile = profile_step(model, lambda m: m(x).square().mean(), optimizer=optimizer,
                           options=ProfileOptions(policies=None, **target))
    actions = [o.action for stage in profile.stages for o in stage.options]
    whole = [a for a in actions if a.modules == (a.stage,) and a.policy is None and not a.offload_input]
    assert any(a.policy for a in actions) and whole and profile.span_groups, actions
    assert any(a.action == "offload" for a in actions) == bool(target), actions
    before = snapshot(model)
    for call in range(1, count[0] + 1):
        _, raised, handles = counted_calls(model, raise_at=call)
        with pytest.raises(BaseException) as caught:
            plan()
        assert raised and caught.value is raised[0], (call, caught.value)
        for handle in handles:
            handle.remove()
        assert_unchanged(model, before)
        assert not optimizer.state, call
    assert plan() == clean


class CountedCalls(nn.Module):
    """Counts its calls in Python (its forward not guarded by ``recomputing()``) and runs one more matmul on a
    later call (of a buffer: nothing saved for backward, the values stay): its recompute runs an op the forward
    did not."""

    def __init__(self, width: int):
        super().__init__()
        self.proj, self.calls = nn.Linear(width, width), 0
        self.register_buffer("eye", torch.eye(width))

    def forward(self, x):
        k = self.proj(x)
        if self.calls:
            self.eye @ self.eye
        self.calls += 1
        return torch.softmax(x @ k.transpose(1, 2), -1) @ k


def test_a_policy_whose_recompute_does_not_replay_the_forward_is_still_dropped_with_its_note():
    # A policy's recompute asks its storage for ops the forward did not run, which torch reports; only that
    # drops an option. (A transformers model's own KV cache, which grew the same way, is left out of a
    # recomputed layer's call, as Hugging Face's checkpointing does: tests/test_hf_cache.py.)
    model = nn.Sequential(nn.Linear(8, 8), CountedCalls(8), CountedCalls(8))
    x = torch.randn(2, 16, 8)

    def step(m):
        for c in m[1:]:
            c.calls = 0
        return m(x).square().mean()

    plan = plan_remat(model, step, "min", policies=("save_matmuls",))
    note = next(n for n in plan.notes if "did not replay" in n)
    assert "sac:save_matmuls (aten." in note and "not found in storage" in note
    assert not plan.policies


# -------------------------------- 4: a fallback plan's messages say what happened, never "0 B"


class Chain(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = chain(blocks=3, width=32)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("budget", ["min", 4096])
def test_the_fallback_after_profiling_runs_out_of_memory_says_so_and_predicts_nothing(budget, caplog, monkeypatch):
    # The first batch is profiled on fake tensors before it runs (no real profiling pass, and a fake
    # twin runs no hook of the model's): its profiling pass is what runs out of memory here.
    from lightning_remat.service import shape_plans

    calls, profile_step = [], shape_plans.profiling.profile_step

    def out_of_memory_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return profile_step(*args, **kwargs)

    monkeypatch.setattr(shape_plans.profiling, "profile_step", out_of_memory_first)
    module, callback = Chain(), AutoRemat(budget=budget, verbose=True)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        fit(module, [callback], steps=3)
    assert calls == [1] and callback.plan.fallback
    assert callback.plan.checkpointed == ["net.0", "net.1", "net.2"] and callback.measured_peak_bytes > 0
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    fell_back = [m for m in said if "Installed the fallback plan" in m]
    assert len(fell_back) == 1 and "out of memory while profiling (OutOfMemoryError" in fell_back[0]
    assert "every candidate block recomputed whole (3 module(s))" in fell_back[0]
    assert "no peak is predicted" in fell_back[0]
    measured = next(m for m in said if m.startswith("AutoRemat: measured peak") or "lightning-remat: a steady" in m)
    assert "the fallback plan" in measured and "profiling ran out of memory" in measured
    # Never a figure for what was not predicted, nor advice that assumes a profile.
    for message in said:
        for wrong in ("0 B", "not predicted", "the profile did not see"):
            assert wrong not in message, message


# ------------------------------- 10: nested names refused; installing is all or nothing


def test_a_plan_naming_a_module_and_one_of_its_ancestors_is_refused_naming_both():
    model = chain()
    before = snapshot(model)
    for names, inner, outer in ((["0", ""], "'0'", "'' (the model itself)"), (["1.0", "1"], "'1.0'", "'1'")):
        with pytest.raises(RematError, match="nest") as caught:
            apply_plan(model, names)
        assert isinstance(caught.value, ValueError) and f"{inner} inside {outer}" in str(caught.value)
        assert_unchanged(model, before)
    with pytest.raises(RematError, match="'2' inside '' \\(the model itself\\)"):
        apply_plan(model, Plan([StageAction.offload(""), StageAction.offload("2")]))
    assert_unchanged(model, before)


class Stubborn(nn.Sequential):
    """A module that refuses a new ``forward`` attribute."""

    def __setattr__(self, name, value):
        if name == "forward":
            raise AttributeError(f"{type(self).__name__} keeps its own forward")
        super().__setattr__(name, value)


@pytest.mark.parametrize("previous", [[], ["1"]], ids=["bare", "with-a-plan"])
def test_a_module_that_refuses_its_new_forward_leaves_the_model_exactly_as_it_was(previous):
    model = chain(blocks=4)
    model[2] = Stubborn(*model[2])
    apply_plan(model, previous) if previous else None
    before, x = snapshot(model), torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    expected = model(x)
    plan = Plan([StageAction.recompute("0"), StageAction.recompute("1", policy="save_matmuls"),
                 StageAction.recompute("2"), StageAction.offload("3")])
    with pytest.raises(AttributeError, match="Stubborn keeps its own forward"):
        apply_plan(model, plan)
    assert_unchanged(model, before)
    assert checkpointed_modules(model) == previous and offloaded_modules(model) == []
    assert torch.equal(model(x), expected)
    remove_remat(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def _accelerate_run(skip):
    """A plain Accelerate loop on a chain; with ``skip`` its first batch runs forward and is skipped
    (no backward, no optimizer step), as a loop that drops a bad batch does."""
    from lightning_remat.accelerate import RematAccelerator, RematPlugin

    accelerator = RematAccelerator(remat_plugin=RematPlugin(budget="min"))
    model = chain(blocks=4, width=32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    for i in range(4):
        x = torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(i))
        loss = model(x).square().mean()
        if skip and i == 0:
            continue
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return accelerator.remat_plan, accelerator.remat_metrics


def test_an_accelerate_loop_that_skips_a_batch_plans_on_the_first_it_trains_on():
    plan, metrics = _accelerate_run(skip=True)
    plain_plan, plain_metrics = _accelerate_run(skip=False)
    # The skipped forward (whose graph the loop still held at the next one) is not the observed step.
    assert plan.checkpointed == plain_plan.checkpointed
    assert metrics["remat/predicted_peak_bytes"] == plain_metrics["remat/predicted_peak_bytes"]
    assert metrics["remat/measured_peak_bytes"] <= metrics["remat/budget_bytes"]
