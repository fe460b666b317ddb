"""The user's module hooks see the training forwards only: never a profiling, fake, trial or
prediction pass of the package (``runtime.measuring.user_hooks``); libraries' hooks keep running."""

from __future__ import annotations

import warnings
from collections import Counter

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_remat import AutoRemat, FakeProfileError, ShapePlans, profile_step
from lightning_remat.runtime.measuring.user_hooks import is_user_hook, user_hooks_suspended

ROWS = [64, 96, 64, 96]  # a new batch shape at step 1: planned on fake tensors


def blocks(width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                           for _ in range(4)])


def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 16, generator=generator) for rows in ROWS]


def counted(model: nn.Module) -> Counter:
    """Hooks of every kind on every block and on the first block's first layer, counting their calls."""
    calls: Counter = Counter()

    def count(kind: str, name: str):
        def hook(*args, **kwargs):
            calls[kind, name] += 1
        return hook

    for name, module in [*((str(i), b) for i, b in enumerate(model)), ("0.0", model[0][0])]:
        module.register_forward_pre_hook(count("pre", name))
        module.register_forward_pre_hook(count("pre+kwargs", name), with_kwargs=True)
        module.register_forward_hook(count("post", name))
        module.register_forward_hook(count("post+kwargs", name), with_kwargs=True)
        module.register_full_backward_hook(count("backward", name))
    return calls


def train(model: nn.Module, plans: ShapePlans | None) -> None:
    optimizer = torch.optim.Adam(model.parameters())
    if plans is not None:
        plans.optimizer = optimizer
    for x in batches():
        if plans is not None:
            plans.use(x)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, x).backward()
        optimizer.step()


def test_hooks_fire_as_without_the_package_under_shape_plans_and_one_that_reads_values_plans():
    plain, planned = blocks(), blocks()
    expected, calls = counted(plain), counted(planned)
    seen: list[float] = []
    planned[1].register_forward_hook(lambda module, args, output: seen.append(output.abs().mean().item()))
    train(plain, None)
    plans = ShapePlans(planned, loss_fn, "min", per_octave=0)
    train(planned, plans)  # on main: a FakeProfileError at the second shape, from the hook's .item()
    assert plans.counts.fake_profiles > 0 and plans.installed.checkpointed  # a new shape, planned on fake tensors
    # The value-reading hook saw the training forwards, with real values (a fake pass has none to read).
    assert len(seen) == len(ROWS) and all(v > 0 for v in seen)
    # A block's own hooks run once per training forward, recomputed or not; a child's forward hooks run
    # again when its block is recomputed (docs/limitations.md), its backward hook does not.
    recomputed = "0" in plans.installed.checkpointed
    children_again = {("pre", "0.0"), ("pre+kwargs", "0.0"), ("post", "0.0"), ("post+kwargs", "0.0")}
    for key, n in expected.items():
        assert n == len(ROWS), key
        if recomputed and key in children_again:
            assert calls[key] > n, key
        else:
            assert calls[key] == n, key


def test_library_hooks_run_in_the_package_passes_and_user_hooks_do_not():
    model = blocks()
    calls: Counter = Counter()

    def library(module, args, output):
        calls["library"] += 1

    def user(module, args, output):
        calls["user"] += 1

    library.__module__ = "transformers.modeling_utils"  # as transformers' enable_input_require_grads hook
    assert not is_user_hook(library) and is_user_hook(user)
    model[0].register_forward_hook(library)
    model[0].register_forward_hook(user)
    x = torch.randn(32, 16)
    profile_step(model, lambda m: loss_fn(m, x))
    profile_step(model, lambda m: loss_fn(m, x), fake=True)
    assert calls["user"] == 0 and calls["library"] > 2
    loss_fn(model, x)
    assert calls["user"] == 1


def test_suspended_hooks_come_back_in_their_order_with_kwargs_and_hooks_added_or_removed_meanwhile():
    net = nn.Linear(2, 2)
    order: list[str] = []

    def mark(label: str):
        def hook(*args):
            order.append(label)
        return hook

    net.register_forward_hook(mark("a"))
    net.register_forward_hook(lambda module, args, kwargs, output: order.append("b"), with_kwargs=True)
    net.register_forward_pre_hook(mark("pre"))
    removed = net.register_forward_hook(mark("removed"))
    with user_hooks_suspended(net), user_hooks_suspended(net):  # re-entrant
        net(torch.ones(1, 2))
        assert order == []
        handle = net.register_forward_hook(mark("c"))
        removed.remove()
    net(torch.ones(1, 2))
    assert order == ["pre", "a", "b", "c"]
    handle.remove()


def test_fake_profile_error_of_a_shape_the_package_plans_does_not_advise_the_setting_it_has():
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = blocks()

        def forward(self, x):
            scale = float(x.abs().max())  # reads a value: fake tensors cannot run it
            return self.net(x / scale)

    plans = ShapePlans(Reads(), loss_fn, "min", per_octave=0)
    plans.use(torch.randn(64, 16))  # the first batch is profiled for real (fake=False)
    with pytest.raises(FakeProfileError) as error:
        plans.use(torch.randn(96, 16))
    assert "fake=False is the setting already" in str(error.value)
    assert "Profile it for real (fake=False)" not in str(error.value)


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = blocks()

    def training_step(self, batch, batch_idx):
        return loss_fn(self.net, batch)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())


def _fit(callbacks: list, tmp_path) -> Counter:
    lit = Lit()
    calls = counted(lit.net)
    L.Trainer(accelerator="cpu", devices=1, max_steps=len(ROWS), callbacks=callbacks, logger=False,
              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
              default_root_dir=tmp_path).fit(lit, DataLoader(batches(), batch_size=None))
    return calls


def test_hooks_fire_as_without_the_package_under_autoremat(tmp_path):
    expected = _fit([], tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls = _fit([AutoRemat("min", cost="flops")], tmp_path)
    # The package's passes ran the backward hooks' autograd nodes (silenced), so the plans counted their memory.
    assert not [str(w.message) for w in caught if "above the budget" in str(w.message)]
    # Hooks on the blocks (their own hooks run once per forward, recomputed or not).
    blocks_only = {k: v for k, v in calls.items() if k[1] != "0.0"}
    assert blocks_only == {k: v for k, v in expected.items() if k[1] != "0.0"}
    assert all(v == len(ROWS) for v in blocks_only.values())
