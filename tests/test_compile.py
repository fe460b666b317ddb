"""torch.compile in either order: plan then compile, and compile then plan (plain and Lightning).
Same losses and gradients as without recomputation, BatchNorm statistics updated once, less memory."""

import copy
import warnings

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_remat import AutoRemat, apply_plan, measure_step, plan_remat, profile_step
from lightning_remat.models import build
from lightning_remat.runtime.installing.apply import checkpointed_modules
from tests.lightning_gpt2 import LitGPT2, SteadyPeaks

warnings.filterwarnings("ignore", category=UserWarning)


class BNBlock(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.up, self.norm = nn.Linear(width, 4 * width), nn.BatchNorm1d(4 * width)
        self.act, self.down = nn.GELU(), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(self.act(self.norm(self.up(x))))


def test_plan_then_compile_with_inductor_keeps_losses_and_batchnorm_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(*[BNBlock() for _ in range(4)])
    reference = copy.deepcopy(model)
    x = torch.randn(256, 64)
    step = lambda m: m(x).square().mean()
    plan = plan_remat(model, step, "min", cost="flops")
    assert plan.checkpointed
    apply_plan(model, plan)
    compiled = torch.compile(model)  # inductor, on the CPU
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (compiled, reference)]
    for _ in range(3):
        losses = []
        for m, optimizer in zip((compiled, reference), optimizers):
            optimizer.zero_grad()
            loss = step(m)
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
        assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)
    for mine, theirs in zip(model.modules(), reference.modules()):
        if isinstance(mine, nn.BatchNorm1d):
            assert int(mine.num_batches_tracked) == int(theirs.num_batches_tracked) == 3  # once per step
            torch.testing.assert_close(mine.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(mine.running_var, theirs.running_var, rtol=1e-5, atol=1e-6)


def test_compile_then_plan_wraps_the_original_modules_and_the_compiled_step_uses_less_memory():
    torch.manual_seed(0)
    case = build("gpt2", layers=3, hidden=64, seq_len=128, batch_size=4, vocab=128)
    reference = copy.deepcopy(case.model)
    compiled = torch.compile(case.model, backend="aot_eager")
    before = measure_step(compiled, case.step).peak_bytes
    plan = plan_remat(compiled, case.step, "min", cost="flops")
    assert plan.checkpointed and not any("_orig_mod" in n for n in plan.checkpointed)
    apply_plan(compiled, plan)
    assert checkpointed_modules(case.model) == plan.checkpointed  # the original modules are wrapped
    after = measure_step(compiled, case.step).peak_bytes  # recompiled with the recompute
    assert after < 0.8 * before
    case.model.zero_grad(set_to_none=True)  # measure_step left its gradients
    torch.manual_seed(1)
    loss = case.step(compiled)
    loss.backward()
    torch.manual_seed(1)
    expected = case.step(reference)
    expected.backward()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    for mine, theirs in zip(case.model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)


SMALL = dict(layers=3, hidden=64, seq_len=64, batch_size=2, vocab=128)


class CompiledLM(LitGPT2):
    """GPT-2 compiled in ``__init__``, in ``configure_model``, or (``"fit"``) as a whole by the test."""

    def __init__(self, where: str):
        super().__init__(seq_len=SMALL["seq_len"])
        self.where = where
        if where == "__init__":
            self.model = torch.compile(self.model, backend="aot_eager")

    def configure_model(self):
        if self.where == "configure_model" and not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model, backend="aot_eager")


def _fit(tmp_path, lit, callbacks):
    if lit.where == "fit":  # the whole LightningModule compiled and given to fit
        lit = torch.compile(lit, backend="aot_eager")
    ids = torch.randint(0, SMALL["vocab"], (5 * SMALL["batch_size"], SMALL["seq_len"]),
                        generator=torch.Generator().manual_seed(1))
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path, deterministic=True)
    trainer.fit(lit, DataLoader(TensorDataset(ids), batch_size=SMALL["batch_size"]))


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory):
    """The losses of the same fit uncompiled and without recomputation (aot_eager runs the same ops)."""
    plain = SteadyPeaks()
    _fit(tmp_path_factory.mktemp("plain"), CompiledLM("not compiled"), [plain])
    return plain.losses


@pytest.mark.parametrize("where", ["__init__", "configure_model", "fit"])
def test_autoremat_plans_a_module_compiled_in_init_configure_model_or_for_fit(tmp_path, where, plain_losses):
    lit = CompiledLM(where)
    ids = torch.randint(0, SMALL["vocab"], (SMALL["batch_size"], SMALL["seq_len"]))
    profile = profile_step(lit, lambda m: m.model(input_ids=ids, labels=ids).loss,
                           optimizer=torch.optim.Adam(lit.parameters()))
    budget = int(profile.static_bytes + 0.5 * profile.baseline_activation_bytes)
    callback, recorded = AutoRemat(budget=budget, cost="flops", verbose=False), SteadyPeaks()
    _fit(tmp_path, lit, [callback, recorded])
    assert callback.plan.checkpointed and checkpointed_modules(lit) == callback.plan.checkpointed
    assert not any("_orig_mod" in name for name in callback.plan.checkpointed)
    assert recorded.losses == pytest.approx(plain_losses, rel=1e-5) and len(plain_losses) == 4
    assert max(recorded.peaks) <= budget


# --------------------------------------------------------------------------------------------------
# Defects: BatchNorm statistics with graph breaks, dynamo poisoned by profiling, `_orig_mod.` names.


class Recording:
    """A torch.compile backend that keeps every graph dynamo hands it and runs it with aot_eager.

    (Not dynamo's graph as it is: backend="eager" runs a checkpoint region eagerly in torch's own
    higher-order op, where a BatchNorm's in-place statistics fail the recompute's version check,
    in plain torch as well. aot_eager runs the same ops through AOTAutograd, like inductor.)
    """

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def recomputes(self) -> bool:
        # A checkpointed call is captured as torch's checkpoint higher-order op.
        return any("checkpoint" in str(node.target) for gm in self.graphs for node in gm.graph.nodes)


class BreakingBNBlock(BNBlock):
    """A BatchNorm block whose forward graph-breaks after the norm (as a print or .item() would)."""

    def forward(self, x):
        h = self.norm(self.up(x))
        torch._dynamo.graph_break()
        return x + self.down(self.act(h))


@pytest.mark.parametrize("mode", ["eager", "compiled", "compiled_graph_break"])
def test_batchnorm_statistics_are_updated_once_per_step_when_recomputed(mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = BreakingBNBlock if mode == "compiled_graph_break" else BNBlock
    model = nn.Sequential(*[block(16) for _ in range(3)])
    reference = copy.deepcopy(model)
    apply_plan(model, ["0", "2"])
    run = model if mode == "eager" else torch.compile(model, backend="aot_eager")
    x = torch.randn(8, 16)
    steps = 3
    for _ in range(steps):
        run(x).square().mean().backward()
        reference(x).square().mean().backward()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(model.modules(), reference.modules()):
        if isinstance(mine, nn.BatchNorm1d):
            assert int(mine.num_batches_tracked) == int(theirs.num_batches_tracked) == steps
            torch.testing.assert_close(mine.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(mine.running_var, theirs.running_var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first_call", ["measure_step", "plan_remat"])
def test_a_compiled_model_compiles_whole_after_being_measured_or_planned(first_call):
    # Dynamo marks code first met under a dispatch mode (MemTracker, FlopCounterMode) as never to
    # compile: the model then runs eagerly, apart from code it has not met yet (a plan's wrapper).
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[BNBlock(16) for _ in range(4)])
    backend = Recording()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(128, 16)  # rows enough that recomputing saves more than the RNG state it keeps
    step = lambda m: m(x).square().mean()
    if first_call == "measure_step":
        measure_step(compiled, step)  # the compiled model's first call, under MemTracker
        assert backend.graphs == []  # ran eagerly
        step(compiled).backward()
        assert len(backend.graphs) == 1  # the whole model in one graph (it has no graph break)
        return
    plan = plan_remat(compiled, step, "min", cost="flops")
    assert plan.checkpointed and backend.graphs == []  # profiled eagerly: nothing compiled yet
    apply_plan(compiled, plan)
    step(compiled).backward()
    assert len(backend.graphs) == 1 and backend.recomputes()  # one graph, the recompute inside
    assert torch._dynamo.eval_frame._stance.stance == "default"


class FusedBlock(BNBlock):
    """A block that calls a compiled function (as a hand-fused activation would be)."""

    def __init__(self, width, fused):
        super().__init__(width)
        self.fused = fused

    def forward(self, x):
        return x + self.down(self.fused(self.norm(self.up(x))))


def test_a_compiled_function_inside_the_model_compiles_after_planning():
    torch._dynamo.reset()
    torch.manual_seed(0)
    backend = Recording()
    fused = torch.compile(lambda h: torch.tanh(h) * h, backend=backend)
    model = nn.Sequential(*[FusedBlock(16, fused) for _ in range(3)])
    reference = copy.deepcopy(model)
    x = torch.randn(128, 16)  # rows enough that recomputing saves more than the RNG state it keeps
    step = lambda m: m(x).square().mean()
    plan = plan_remat(model, step, "min", cost="flops")  # the function's first calls, under our trackers
    assert plan.checkpointed and backend.graphs == []
    apply_plan(model, plan)
    loss = step(model)
    loss.backward()
    assert backend.graphs  # compiled at the first real step
    expected = step(reference)
    expected.backward()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


def test_trackers_hold_the_eager_stance_nested_and_give_it_back_after_an_error():
    from lightning_remat.runtime.measuring.tracking import PeakOnlyTracker, Tracker

    stance = lambda: torch._dynamo.eval_frame._stance.stance
    outer, inner = Tracker(), PeakOnlyTracker()
    with outer:
        with inner:
            assert stance() == "force_eager"
        assert stance() == "force_eager"  # the outer tracker is still active
    assert stance() == "default"
    with pytest.raises(ZeroDivisionError):
        with Tracker():
            1 / 0
    assert stance() == "default"


class TwoStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.blocks = nn.ModuleList([BNBlock(16) for _ in range(2)])

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_find_stages_names_the_uncompiled_modules_of_a_compiled_model():
    from lightning_remat import find_stages

    model = TwoStages()
    expected = find_stages(model)
    assert expected == ["blocks.0", "blocks.1"]
    assert find_stages(torch.compile(model, backend="eager")) == expected
    assert find_stages(torch.compile(model, backend="eager"), candidates="blocks.*") == expected
    model.blocks[1] = torch.compile(model.blocks[1], backend="eager")
    assert find_stages(model) == expected
    assert find_stages(model, candidates=BNBlock) == expected
    outer = nn.Sequential(torch.compile(TwoStages(), backend="eager"))
    assert find_stages(outer) == ["0.blocks.0", "0.blocks.1"]


class TinyBNModule(L.LightningModule):
    def __init__(self, backend):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.compile(nn.Sequential(*[BNBlock(16) for _ in range(3)]), backend=backend)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_autoremat_plans_a_compiled_lightning_module_on_its_original_names_and_it_compiles(tmp_path):
    torch._dynamo.reset()
    backend = Recording()
    lit = TinyBNModule(backend)
    callback = AutoRemat(budget="min", cost="flops", verbose=False)
    x = torch.randn(4 * 128, 16, generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[callback], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path)
    trainer.fit(lit, DataLoader(TensorDataset(x), batch_size=128))  # recomputing saves more than the RNG state
    assert callback.plan.checkpointed and all(n.startswith("net.") for n in callback.plan.checkpointed)
    assert not any("_orig_mod" in n for n in callback.plan.checkpointed)
    assert checkpointed_modules(lit) == callback.plan.checkpointed
    assert len(backend.graphs) == 1 and backend.recomputes()  # compiled whole, with the recompute
    norms = [m for m in lit.modules() if isinstance(m, nn.BatchNorm1d)]
    assert norms and all(int(m.num_batches_tracked) == 3 for m in norms)  # once per step
