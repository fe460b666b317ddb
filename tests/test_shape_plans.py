"""Plans that follow the batch's shape (issue 21): the shape fit, and ``ShapePlans`` in a hand-written
loop under dynamic padding, where the longest batch arrives late.

The scenario every run test shares: a small GPT-2 (attention dropout: SDPA's math path on the CPU,
whose score matrices grow with the square of the sequence), 12 batches of 4 sequences padded to
their longest (32..127 tokens), the longest batch (128 tokens) first at step 8, Adam, and a budget
of static memory + 50% of the activations of the longest batch. Every step's peak is measured with
``torch.profiler``'s allocation events (``tests/torch_meter.py``), which also see the package's own
planning work inside the step.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_remat import profile_step
from lightning_remat.core.memory_model import Profile, Segment, StageAction, StageOption, StageProfile
from lightning_remat.core.predict import predict
from lightning_remat.core.shape_fit import ShapeFit, chord_weights
from lightning_remat.core.shapes import Shape, ShapeBuckets, ladder_down, ladder_up
from lightning_remat.core.solve import solve
from lightning_remat.models import build, padded_batches
from lightning_remat.runtime.measuring.measure import measure_step
from lightning_remat.runtime.profiling.batch_shape import batch_shape, resize_batch
from lightning_remat.service.shape_plans import ShapePlans
from tests.torch_meter import TorchPeak

SIZES = dict(layers=3, hidden=64, seq_len=128, vocab=128)
# The run tests share module fixtures (the runs): one worker runs them all under `-n 2 --dist loadgroup`.
pytestmark = pytest.mark.xdist_group("shape-plans")


def loss_fn(model, batch):
    return model(**batch).loss


# ------------------------------------------------------------------------------ the shape fit


def test_ladder_and_buckets_round_up_within_a_step():
    for n in range(1, 600):
        up, down = ladder_up(n, 16), ladder_down(n, 16)
        assert down <= n <= up and up <= n * (1 + 1 / 16) and ladder_up(up, 16) == up == ladder_down(up, 16)
    buckets = ShapeBuckets(16)
    assert len({buckets.up(Shape(4, s)) for s in range(32, 129)}) <= 2 * 16 + 1  # two octaves
    assert ShapeBuckets(16, max_shape=Shape(4, 100)).up(Shape(4, 99)) == Shape(4, 100)


def _node(moments, b, s):
    """A one-stage profile whose keep option peaks at the largest of ``moments`` (each
    ``(c, alpha, beta, gamma)``: ``c + b * (alpha + beta * s + gamma * s**2)``) and stores ``b * s * 8``."""
    peak = max(c + b * (alpha + beta * s + gamma * s * s) for c, alpha, beta, gamma in moments)
    keep = StageOption("keep", StageAction("a"), 8 * b * s, 1000 + int(peak))
    return Profile((StageProfile("a", (keep,)),), (Segment("head", 1, 1000 + 3 * b * s),), parameter_bytes=1000)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-5000, 5000), st.integers(0, 50), st.integers(0, 50), st.integers(0, 3)),
                min_size=1, max_size=4),
       st.integers(1, 16), st.integers(8, 256))
def test_an_interpolated_shape_is_never_predicted_below_the_truth(moments, batch_size, seq_len):
    # Each memory term is a maximum over the moments of a step of polynomials with non-negative
    # coefficients: convex in the sequence and in the batch, so the chord lies above it.
    nodes = {shape: _node(moments, shape.batch_size, shape.seq_len)
             for shape in (Shape(1, 8), Shape(1, 64), Shape(1, 256), Shape(16, 8), Shape(16, 100), Shape(16, 256))}
    fit = ShapeFit(nodes)
    target = Shape(batch_size, seq_len)
    assert fit.bounded(target)
    truth, predicted = _node(moments, batch_size, seq_len), fit.at(target)
    assert predicted.baseline_peak_bytes >= truth.baseline_peak_bytes
    # Linear terms are exact (bytes round up: a float sum may land a byte above).
    assert 0 <= predicted.stages[0].options[0].stored_bytes - truth.stages[0].options[0].stored_bytes <= 1


def test_chord_weights_are_a_convex_combination_and_exact_at_a_node():
    nodes = [Shape(2, 32), Shape(2, 128), Shape(4, 48), Shape(4, 64), Shape(4, 128)]
    weights = chord_weights(nodes, Shape(3, 100))
    assert weights is not None and all(w > 0 for w in weights.values()) and math.isclose(sum(weights.values()), 1.0)
    assert chord_weights(nodes, Shape(4, 64)) == {Shape(4, 64): 1.0}
    assert chord_weights(nodes, Shape(4, 40)) is None and chord_weights(nodes, Shape(5, 64)) is None


def test_missing_nodes_bracket_the_shape():
    fit = ShapeFit({Shape(4, 76): _node([(0, 1, 1, 1)], 4, 76)})
    for target in (Shape(4, 85), Shape(4, 50), Shape(3, 76), Shape(9, 300)):
        grown = fit
        for shape in fit.missing_nodes(target):
            grown = grown.with_node(shape, _node([(0, 1, 1, 1)], shape.batch_size, shape.seq_len))
        assert grown.bounded(target), target
    assert fit.missing_nodes(Shape(4, 76)) == []


def test_batch_shape_and_resize():
    batch = padded_batches(steps=1, longest_at=None)[0]
    shape = batch_shape(batch)
    length = batch["input_ids"].shape[1]
    assert str(shape) == f"4x{length} {{attention_mask: bxs, input_ids: bxs, labels: bxs}}"
    wider = resize_batch(batch, Shape(6, shape.seq_len + 5))  # batch size and sequence only: the same layout
    assert batch_shape(wider) == Shape(6, shape.seq_len + 5, shape.layout)
    assert torch.equal(wider["attention_mask"][:4, :shape.seq_len], batch["attention_mask"])


# ------------------------------------------------------------------------------ ShapePlans on a small model


def _token_model():
    torch.manual_seed(0)
    block = lambda: torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))  # noqa: E731
    return torch.nn.Sequential(torch.nn.Embedding(64, 16), *[block() for _ in range(4)])


def _token_loss(model, ids):
    return model(ids).square().mean()


def test_plan_for_largest_changes_the_plan_only_when_the_largest_shape_grows():
    lengths = (40, 24, 64, 16, 48, 64, 100, 30)
    plans = ShapePlans(_token_model(), _token_loss, budget="min", plan_for="largest")
    keys = []
    for n in lengths:
        plans.use(torch.randint(0, 64, (2, n)))
        keys.append(plans.key(Shape(2, n)))
    assert all(b.covers(a) and b.covers(Shape(2, n)) for a, b, n in zip(keys, keys[1:], lengths[1:]))
    assert sorted(plans.plans) == [Shape(2, 40), Shape(2, 64), Shape(2, 100)] and plans.counts.installs <= 3
    declared = ShapePlans(_token_model(), _token_loss, budget="min", plan_for="largest", max_shape=(2, 100))
    for n in lengths:
        declared.use(torch.randint(0, 64, (2, n)))
    assert list(declared.plans) == [Shape(2, 100)] and declared.counts.installs == 1
    # The first batch on fake tensors (the anchor, at its own shape), and the shape planned.
    assert declared.counts.real_profiles == 0 and declared.counts.fake_profiles == 2, declared.counts
    compiled = _token_model()
    compiled[1] = torch.compile(compiled[1])
    assert ShapePlans(compiled, _token_loss, budget="min").plan_for == "largest"


def test_plan_for_is_largest_for_a_model_compiled_in_place():
    """``module.compile()`` (no wrapper module) and Lightning's compiled LightningModule (its
    ``_compiler_ctx``) run compiled too: each new shape would recompile, so one plan for the largest."""
    in_place = _token_model()
    in_place[1].compile()
    assert ShapePlans(in_place, _token_loss, budget="min").plan_for == "largest"
    lightning_compiled = _token_model()
    lightning_compiled._compiler_ctx = {"compiler": "dynamo"}
    assert ShapePlans(lightning_compiled, _token_loss, budget="min").plan_for == "largest"
    assert ShapePlans(_token_model(), _token_loss, budget="min").plan_for == "shape"


def test_ranks_run_the_plan_of_the_largest_batch_of_any_rank():
    from tests.function_channel import FunctionChannel

    # Another rank whose batch is always twice as long: every rank plans for the longer one.
    twice = FunctionChannel(broadcast=lambda value: value, gather=lambda value: [value, 2 * value if value else value])
    plans = ShapePlans(_token_model(), _token_loss, budget="min", channel=twice, per_octave=0)
    for n in (16, 24):
        plans.use(torch.randint(0, 64, (2, n)))
    assert sorted(plans.plans) == [Shape(4, 32), Shape(4, 48)]
    assert plans.counts.real_profiles == 0  # rank 0's own batch, at its own shape, on fake tensors


# ------------------------------------------------------------------------------ the meter


def test_step_peak_agrees_with_memtracker_on_a_plain_step():
    torch.manual_seed(0)
    model = build("gpt2", **SIZES).model
    optimizer = torch.optim.Adam(model.parameters())
    batch = padded_batches(steps=1, longest_at=None)[0]
    measure_step(model, lambda m: loss_fn(m, batch), optimizer)  # the optimizer's state exists
    torch.manual_seed(1)
    tracked = measure_step(model, lambda m: loss_fn(m, batch), optimizer).peak_bytes
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    meter = TorchPeak(model, optimizer)
    meter.start()
    loss_fn(model, batch).backward()
    optimizer.step()
    assert abs(meter.stop() - tracked) <= 8 * 1024, (tracked,)  # 1-5 KiB apart here


# ------------------------------------------------------------------------------ a hand-written loop


@pytest.fixture(scope="module")
def scenario():
    torch.manual_seed(0)
    model = build("gpt2", **SIZES).model
    batches = padded_batches(steps=12, batch_size=4, longest_at=8)
    longest = batches[8]
    profile = profile_step(model, lambda m: loss_fn(m, longest), optimizer=torch.optim.Adam(model.parameters()))
    budget = profile.static_bytes + (profile.baseline_peak_bytes - profile.static_bytes) // 2
    return batches, budget


def _train(batches, before_step=None):
    """Train a fresh model on ``batches`` (Adam, dropout drawn from seed 1); per step: the peak
    (``TorchPeak``, ``before_step`` inside the window), the loss and the gradients."""
    torch.manual_seed(0)
    model = build("gpt2", **SIZES).model
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    plans = before_step(model, optimizer) if before_step else None
    use = plans.use if plans is not None else None
    return (*_measured_steps(model, optimizer, batches, lambda batch: loss_fn(model, batch), before=use), plans)


def _measured_steps(model, optimizer, batches, forward, backward=lambda loss: loss.backward(), before=None):
    """Per step of ``batches``: the peak (``TorchPeak`` open over the whole step, ``before(batch)``
    included), the loss and the gradients."""
    peaks, losses, grads = [], [], []
    for batch in batches:
        meter = TorchPeak(model, optimizer)
        meter.start()
        if before is not None:
            before(batch)
        loss = forward(batch)
        backward(loss)
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        del loss
        peaks.append(meter.stop())
    return peaks, losses, grads


@pytest.fixture(scope="module")
def plain_runs(scenario):
    batches, budget = scenario
    reference = _train(batches)
    ours = _train(batches, lambda model, optimizer: ShapePlans(model, loss_fn, budget, optimizer=optimizer))
    return reference, ours


def test_plain_loop_holds_the_budget_every_step_with_no_real_profile(scenario, plain_runs):
    batches, budget = scenario
    reference, (peaks, _, _, plans) = plain_runs
    table = [(tuple(b["input_ids"].shape), ref, ours) for b, ref, ours in zip(batches, reference[0], peaks)]
    assert max(reference[0]) > 1.5 * budget  # without recomputation the longest batch would not fit
    assert all(peak <= budget for peak in peaks), (budget, table)
    assert plans.counts.real_profiles == 0 and plans.counts.steps == len(batches)
    # Fake profiles: the first batch's shape, then nodes on the ladder (4 per doubling) the data reached.
    assert plans.counts.fake_profiles <= 1 + 2 * 4 * 2, plans.counts
    assert plans.counts.solves == len(plans.plans) <= len(batches)


def test_plain_loop_trains_exactly_as_without_the_package(plain_runs):
    reference, ours = plain_runs
    assert ours[1] == reference[1]
    for step, (expected, got) in enumerate(zip(reference[2], ours[2])):
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), step


# A plan made between nodes is made on a bound above the truth by the chord's margin (0.25% of the
# peak at most here): it is the optimal plan for a budget lower by at most this much.
CHORD_TOLERANCE = 0.005


def test_each_plan_is_the_optimal_plan_of_its_shape(scenario, plain_runs):
    """At two buckets, one a node of the fit and one predicted between nodes, the plan made from the
    fit against plans solved on a fake profile of a batch at the bucket's shape (what plans are made
    on: the first batch is profiled on fake tensors too): at the node, the optimal plan; between
    nodes, a plan within the budget whose predicted peak is at or above the profile's, and at most
    as costly as the optimal plan for a budget 0.5% lower. A real profile at the bucket agrees up to
    the batch's own tensors, which MemTracker counts in a real step here (the batch is made before
    it; the allocator's events do not see them). A short batch pays less recompute than the longest."""
    batches, budget = scenario
    plans = plain_runs[1][3]
    longest_shape = batch_shape(resize_batch(batches[0], Shape(4, 128)))  # the batches' layout, at 4x128
    longest = plans.plans[plans.key(longest_shape)]
    assert all(plan.predicted_overhead < longest.predicted_overhead
               for key, plan in plans.plans.items() if key.seq_len <= 112)
    between = [k for k, how in plans.sources.items() if how == "chord" and plans.plans[k].checkpointed]
    torch.manual_seed(0)
    model = build("gpt2", **SIZES).model
    optimizer = torch.optim.Adam(model.parameters())
    for key in (longest_shape, between[0]):
        batch = resize_batch(batches[0], key)
        exact = profile_step(model, lambda m: loss_fn(m, batch), optimizer=optimizer, fake=True)
        real = profile_step(model, lambda m: loss_fn(m, batch), optimizer=optimizer)
        ours = plans.plans[key]
        measured = predict(exact, ours.actions, "flops")  # the plan priced on the profile at its shape
        cost, optimal = measured.overhead, solve(exact, budget, "flops").predicted_overhead
        assert measured.peak_bytes <= ours.predicted_peak_bytes <= budget, key
        inputs = sum(t.numel() * t.element_size() for t in batch.values())
        assert 0 <= predict(real, ours.actions, "flops").peak_bytes - measured.peak_bytes <= inputs, key
        if plans.sources[key] in ("node", "profile"):  # exact profiles
            assert math.isclose(cost, optimal, abs_tol=1e-9), key
        else:
            tighter = solve(exact, int(budget * (1 - CHORD_TOLERANCE)), "flops").predicted_overhead
            assert optimal - 1e-9 <= cost <= tighter + 1e-9, (key, cost, optimal, tighter)


# ------------------------------------------------------------------------------ Lightning and Accelerate


def _assert_run(peaks, losses, grads, reference, budget, counts, batches):
    table = [(tuple(b["input_ids"].shape), ref, ours) for b, ref, ours in zip(batches, reference[0], peaks)]
    assert len(peaks) == len(batches) and all(peak <= budget for peak in peaks), (budget, table)
    assert counts.real_profiles <= 1, counts
    assert losses == reference[1]
    for step, (expected, got) in enumerate(zip(reference[2], grads)):
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), step


def _lightning_peaks():
    """A callback: every training batch's ``TorchPeak`` (``peaks``; put it first among the callbacks, so
    that its window opens before any other's ``on_train_batch_start``, where planning runs), its loss
    and the gradients each optimizer step applies."""
    import lightning.pytorch as L

    class Peaks(L.Callback):
        def __init__(self):
            self.peaks, self.losses, self.grads, self.meter = [], [], [], None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.meter = TorchPeak(pl_module, trainer.optimizers).start()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads.append([p.grad.clone() for p in pl_module.parameters()])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # After the optimizer step (and its zero_grad).
            self.peaks.append(self.meter.stop())
            self.losses.append(float(outputs["loss"]))

    return Peaks()


def _lightning_run(batches, callbacks):
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    class LitPadded(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = build("gpt2", **SIZES).model

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    meter = _lightning_peaks()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=len(batches), callbacks=[meter, *callbacks],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    lit = LitPadded()
    torch.manual_seed(1)
    trainer.fit(lit, DataLoader(batches, batch_size=None))
    return meter.peaks, meter.losses, meter.grads


def test_lightning_autoremat_follows_the_batch_shape(scenario):
    from lightning_remat import AutoRemat

    batches, budget = scenario
    reference = _lightning_run(batches, [])
    callback = AutoRemat(budget=budget, cost="flops", verbose=False)
    peaks, losses, grads = _lightning_run(batches, [callback])
    _assert_run(peaks, losses, grads, reference, budget, callback.shape_plans.counts, batches)
    assert max(reference[0]) > 1.5 * budget
    assert callback.shape_plans.counts.real_profiles == 0 and len(callback.shape_plans.plans) > 3
    assert callback.measured_peak_bytes <= budget


def _accelerate_run(batches, monkeypatch, budget=None):
    from lightning_remat.accelerate import ENV_BUDGET, ENV_COST, RematAccelerator, remat_session

    if budget is not None:
        monkeypatch.setenv(ENV_BUDGET, str(budget))
        monkeypatch.setenv(ENV_COST, "flops")
    accelerator = RematAccelerator()
    torch.manual_seed(0)
    model = build("gpt2", **SIZES).model
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    torch.manual_seed(1)
    steps = _measured_steps(model, optimizer, batches, lambda batch: model(**batch).loss, accelerator.backward)
    return steps, remat_session(model)


def test_accelerate_session_follows_the_batch_shape(scenario, monkeypatch):
    batches, budget = scenario
    reference, _ = _accelerate_run(batches, monkeypatch)
    (peaks, losses, grads), session = _accelerate_run(batches, monkeypatch, budget)
    _assert_run(peaks, losses, grads, reference, budget, session.shape_plans.counts, batches)
    # The first step ran as written (observed), and calibrates fake profiles: no real profiling pass.
    assert session.shape_plans.counts.real_profiles == 0 and len(session.shape_plans.plans) > 3
    assert session.metrics["remat/measured_peak_bytes"] <= budget
