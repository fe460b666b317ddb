"""A batch's shape is every dimension that changes (issue 29): an image's height and width, the set of
tensors in a dict. Image batches whose height and width grow, and a dict batch where a key appears,
are planned again; every step's peak, measured with ``torch.profiler``'s allocation events
(``tests/torch_meter.py``, the package's planning work inside the step included), stays within the
budget, and losses equal those of the run without the package. Before layouts, an image batch was
read as batch x channels and a new key kept the shape: the run below went to 1.40x its budget.

Properties of ``Shape``/``ShapeBuckets`` and of ``resize_batch`` over generated shapes and batches.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_remat import profile_step
from lightning_remat.core.plan import Plan, StageAction
from lightning_remat.core.shapes import BATCH, SEQUENCE, Shape, ShapeBuckets
from lightning_remat.core.solve import solve
from lightning_remat.runtime.profiling.batch_shape import batch_shape, resize_batch
from lightning_remat.service.shape_plans import ShapePlans
from tests.torch_meter import TorchPeak, lightning_peaks

pytestmark = pytest.mark.xdist_group("shape-layouts")  # the module's fixtures: one worker

# ------------------------------------------------------------------------------ properties of shapes

SIZES = st.integers(1, 300)


@st.composite
def structures(draw):
    """A layout's structure: paths, and per path where the batch and sequence markers are."""
    paths = draw(st.lists(st.sampled_from(["0", "1", "x", "y.0", "y.1", "mask"]), min_size=1, max_size=4, unique=True))
    out = []
    for path in paths:
        rank = draw(st.integers(0, 4))
        marks = [None] * rank
        if rank and draw(st.booleans()):
            marks[0] = BATCH
            if rank >= 2 and draw(st.booleans()):
                marks[1] = SEQUENCE
        out.append((path, tuple(marks)))
    return tuple(out)


def shapes_of(structure):
    """Shapes of one structure: every size drawn, markers kept."""
    entries = [st.tuples(st.just(path), st.tuples(*[st.just(m) if m is not None else SIZES for m in marks]))
               for path, marks in structure]
    return st.builds(Shape, SIZES, SIZES, st.tuples(*entries))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_buckets_cover_and_covers_is_a_partial_order_whose_union_is_the_least_cover(data):
    structure = data.draw(structures())
    a, b, c = (data.draw(shapes_of(structure)) for _ in range(3))
    per_octave = data.draw(st.sampled_from([0, 1, 4, 16]))
    varying = data.draw(st.none() | st.sets(st.tuples(st.sampled_from([p for p, _ in structure]), st.integers(0, 3))))
    bucket = ShapeBuckets(per_octave).up(a, varying)
    assert bucket.covers(a) and bucket.comparable(a)
    capped = ShapeBuckets(per_octave, max_shape=b).up(a, varying)
    assert capped.covers(a) and (not b.covers(a) or b.covers(capped))  # never beyond a max_shape that covers a
    assert a.covers(a)
    assert not (a.covers(b) and b.covers(a)) or a == b
    assert not (a.covers(b) and b.covers(c)) or a.covers(c)
    union = a.union(b)
    assert union.covers(a) and union.covers(b)
    assert not (c.covers(a) and c.covers(b)) or c.covers(union)
    assert Shape.from_list(json.loads(json.dumps(a.to_list()))) == a
    assert str(a).startswith(f"{a.batch_size}x{a.seq_len}")


@settings(max_examples=60, deadline=None)
@given(structures(), structures())
def test_shapes_of_other_structures_never_cover_each_other(one, other):
    a, b = Shape(4, 8, tuple((p, tuple(m if m is not None else 5 for m in marks)) for p, marks in one)), \
        Shape(4, 8, tuple((p, tuple(m if m is not None else 5 for m in marks)) for p, marks in other))
    assert a.covers(b) == (a.structure == b.structure) == a.comparable(b)
    if not a.comparable(b):
        with pytest.raises(ValueError):
            a.union(b)


# A generated batch: b, s and other sizes from disjoint ranges, so that reading it back is unambiguous
# (a size that equals the batch size or the sequence length is read as one, by design).
B, S, OTHER = st.integers(2, 5), st.integers(6, 9), st.integers(10, 13)


@st.composite
def nested_batches(draw):
    """A batch of nested dicts, lists and tuples: images (floats, batch first), token ids and masks
    (integers, batch x sequence) or none, embeddings, labels, scalars, one tensor without a batch
    dimension at most, and non-tensor values."""
    b = draw(B)
    s = draw(S) if draw(st.booleans()) else 1
    leaves = [torch.zeros(b, draw(OTHER), draw(OTHER), draw(OTHER)), torch.zeros(b, dtype=torch.long)]
    if s > 1:
        leaves += [torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, draw(OTHER)), torch.ones(b, s)]
    leaves += draw(st.lists(st.sampled_from([torch.tensor(0.5), torch.zeros(draw(OTHER), draw(OTHER)), "text", 3]),
                            max_size=1))
    leaves = draw(st.permutations(leaves))
    containers = st.sampled_from([list, tuple, lambda items: {f"k{i}": v for i, v in enumerate(items)}])
    while len(leaves) > 1 and draw(st.booleans()):  # nest a run of leaves in a container
        i = draw(st.integers(0, len(leaves) - 2))
        j = draw(st.integers(i + 2, len(leaves)))
        leaves = [*leaves[:i], draw(containers)(leaves[i:j]), *leaves[j:]]
    return draw(containers)(leaves)


@settings(max_examples=80, deadline=None)
@given(nested_batches(), st.data())
def test_resize_batch_gives_the_shape_asked_for(batch, data):
    shape = batch_shape(batch)
    layout = tuple((path, tuple(n if n < 0 else data.draw(OTHER) for n in sizes)) for path, sizes in shape.layout)
    target = Shape(data.draw(B), data.draw(S) if shape.seq_len > 1 else 1, layout)
    assert batch_shape(resize_batch(batch, target)) == target
    plain = Shape(target.batch_size, target.seq_len)  # no layout: the batch size and sequence only
    assert batch_shape(resize_batch(batch, plain)) == Shape(plain.batch_size, plain.seq_len, shape.layout)


def test_an_image_batch_is_read_by_its_height_and_width_never_its_channels():
    images = (torch.zeros(8, 3, 32, 48), torch.zeros(8, dtype=torch.long))
    shape = batch_shape(images)
    assert (shape.batch_size, shape.seq_len, str(shape)) == (8, 1, "8x1 {0: bx3x32x48, 1: b}")
    taller = batch_shape((torch.zeros(8, 3, 40, 48), torch.zeros(8, dtype=torch.long)))
    assert taller.covers(shape) and not shape.covers(taller)
    with_key = batch_shape({"x": torch.zeros(8, 16), "context": torch.zeros(8, 16)})
    assert str(with_key) == "8x1 {context: bx16, x: bx16}"
    assert not with_key.covers(batch_shape({"x": torch.zeros(8, 16)}))
    with pytest.raises(ValueError, match="another layout"):
        resize_batch({"x": torch.zeros(8, 16)}, with_key)


def test_the_largest_shape_unites_only_shapes_of_one_structure_and_ranks_plan_the_largest():
    from tests.function_channel import FunctionChannel
    from lightning_remat.service.shape_keys import ShapeKeys

    image = lambda h, w: Shape(4, 1, (("0", (BATCH, 3, h, w)), ("1", (BATCH,))))  # noqa: E731
    keyed = Shape(4, 1, (("x", (BATCH, 16)),))
    keys = ShapeKeys("largest", max_shape=Shape(6, 1), per_octave=0)
    planned = [keys.planned(keys.meet(shape)) for shape in (image(16, 24), image(24, 16), keyed, image(8, 8))]
    assert planned == [image(16, 24).union(Shape(6, 1, image(16, 24).layout)), Shape(6, 1, image(24, 24).layout),
                       Shape(6, 1, keyed.layout), Shape(6, 1, image(24, 24).layout)]
    # Another rank's taller images: every rank plans them; another rank's other key: rank 0's, with a warning.
    def rank_with(layout):  # another rank with a batch of 4 and ``layout``
        return FunctionChannel(broadcast=lambda v: v, gather=lambda v: [v, layout if isinstance(v, tuple) else v])

    assert ShapeKeys().meet(image(16, 24), rank_with(image(32, 24).layout)) == image(32, 24)
    other = rank_with(keyed.layout)
    with pytest.warns(UserWarning, match="other layouts"):
        assert ShapeKeys().meet(image(16, 24), other) == image(16, 24)


# ------------------------------------------------------------------------------ a CNN whose images grow


def sgd(model):
    """SGD with momentum: state per parameter, as Adam's, and a step that profiles in a fraction of the time."""
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def cnn():
    """A conv stem and two conv blocks (BatchNorm), pooled to ten classes."""
    torch.manual_seed(0)
    conv = lambda cin: nn.Sequential(nn.Conv2d(cin, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())  # noqa: E731
    return nn.Sequential(conv(3), *[conv(8) for _ in range(2)], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def image_loss(model, batch):
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


SIDES = [(16, 16), (24, 24), (16, 16), (32, 24)]  # the largest last: height and width grow apart


@pytest.fixture(scope="module")
def images():
    """The image batches and a budget between the least peak and the plain peak of the largest."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, h, w, generator=generator), torch.randint(0, 10, (4,), generator=generator))
               for h, w in SIDES]
    model = cnn()
    largest = profile_step(model, lambda m: image_loss(m, batches[-1]), optimizer=sgd(model))
    least = solve(largest, "min", "flops").predicted_peak_bytes
    return batches, least + (largest.baseline_peak_bytes - least) // 4


def _loop(batches, loss_fn, model, plans=None):
    """Per step of a hand-written loop: the peak (``TorchPeak`` over the whole step, ``plans.use``
    included) and the loss."""
    optimizer = sgd(model)
    if plans is not None:
        plans = plans(model, optimizer)
    peaks, losses = [], []
    torch.manual_seed(1)
    for batch in batches:
        meter = TorchPeak(model, optimizer).start()
        if plans is not None:
            plans.use(batch)
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        del loss
        peaks.append(meter.stop())
    return peaks, losses, plans


def test_shape_plans_plan_images_that_grow_in_height_and_width(images):
    batches, budget = images
    plain, plain_losses, _ = _loop(batches, image_loss, cnn())
    peaks, losses, plans = _loop(batches, image_loss, cnn(),
                                 lambda model, optimizer: ShapePlans(model, image_loss, budget, optimizer=optimizer))
    assert max(plain) > 1.2 * budget  # the largest images do not fit without recomputation
    assert all(peak <= budget for peak in peaks), [(side, p / budget) for side, p in zip(SIDES, peaks)]
    assert losses == plain_losses
    # One plan per size of image, each made for its own height and width (channels never rounded).
    assert sorted(str(key) for key in plans.plans) == [f"4x1 {{0: bx3x{h}x{w}, 1: b}}" for h, w in
                                                       [(16, 16), (24, 24), (32, 24)]]
    assert plans.counts.real_profiles == 0 and plans.counts.solves == 3


def _lightning_run(batches, callbacks):
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    class Images(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = cnn()

        def training_step(self, batch, batch_idx):
            return image_loss(self.net, batch)

        def configure_optimizers(self):
            return sgd(self)

    meter = lightning_peaks()  # first among the callbacks: its window opens before planning
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=len(batches), callbacks=[meter, *callbacks],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    torch.manual_seed(1)
    trainer.fit(Images(), DataLoader(batches, batch_size=None))
    return meter.peaks, meter.losses


def test_autoremat_plans_images_that_grow_and_a_resumed_run_finds_their_plans(images):
    from lightning_remat import AutoRemat

    batches, budget = images
    callback = AutoRemat(budget=budget, cost="flops", verbose=False)
    peaks, _ = _lightning_run(batches, [callback])
    assert all(peak <= budget for peak in peaks), [(side, p / budget) for side, p in zip(SIDES, peaks)]
    planned = callback.shape_plans.plans
    assert len(planned) == 3 and all(key.layout for key in planned)
    # The checkpoint's plans keep their shapes, layouts included (through JSON too): a resumed run
    # profiles none of them again.
    state = json.loads(json.dumps(callback.state_dict()))
    resumed = AutoRemat(budget=budget, cost="flops", verbose=False)
    resumed.load_state_dict(state)
    assert {key: plan.to_dict() for key, plan in resumed.run.saved.items()} == \
        {key: plan.to_dict() for key, plan in planned.items()}
    peaks, _ = _lightning_run(batches, [resumed])
    counts = resumed.shape_plans.counts
    assert counts.real_profiles == counts.fake_profiles == counts.solves == 0, counts
    assert all(peak <= budget for peak in peaks)


def test_a_checkpoint_written_before_layouts_still_loads():
    from lightning_remat import AutoRemat

    plan = Plan([StageAction.recompute("net.1")])
    callback = AutoRemat(budget="min", verbose=False)
    callback.load_state_dict({"plan": plan.to_dict(), "plans": [[4, 128, plan.to_dict()]]})
    assert list(callback.run.saved) == [Shape(4, 128)]
    assert callback.state_dict()["plans"] == [[4, 128, plan.to_dict()]]  # written as it was read


# ------------------------------------------------------------------------------ a dict batch gains a key


def fusion():
    """A trunk over ``x``; a side branch over ``context`` where the batch has that key."""
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 16))  # noqa: E731

    class Fusion(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Sequential(*[block() for _ in range(3)])
            self.side = nn.Sequential(*[block() for _ in range(3)])

        def forward(self, batch):
            hidden = self.trunk(batch["x"])
            if "context" in batch:
                hidden = hidden + self.side(batch["context"])
            return hidden.square().mean()

    return Fusion()


def fusion_loss(model, batch):
    return model(batch)


@pytest.fixture(scope="module")
def keyed():
    """Batches of 64 rows, ``context`` from the third on; a budget between the least and the plain
    peak of a batch with it."""
    generator = torch.Generator().manual_seed(0)
    x = lambda: torch.randn(64, 16, generator=generator)  # noqa: E731
    batches = [{"x": x()}, {"x": x()}, {"x": x(), "context": x()}, {"x": x()}, {"x": x(), "context": x()}]
    model = fusion()
    full = profile_step(model, lambda m: fusion_loss(m, batches[2]), optimizer=sgd(model))
    least = solve(full, "min", "flops").predicted_peak_bytes
    return batches, least + (full.baseline_peak_bytes - least) // 3


def test_a_dict_batch_where_a_key_appears_is_planned_again(keyed):
    batches, budget = keyed
    plain, plain_losses, _ = _loop(batches, fusion_loss, fusion())
    peaks, losses, plans = _loop(batches, fusion_loss, fusion(),
                                 lambda model, optimizer: ShapePlans(model, fusion_loss, budget, optimizer=optimizer))
    assert max(plain) > 1.2 * budget
    assert all(peak <= budget for peak in peaks), [p / budget for p in peaks]
    assert losses == plain_losses
    assert sorted(str(key) for key in plans.plans) == ["64x1 {context: bx16, x: bx16}", "64x1 {x: bx16}"]
    with_context = plans.plans[plans.key(batch_shape(batches[2]))]
    assert with_context.checkpointed and Shape.from_list(with_context.fingerprint["shape"]) == batch_shape(batches[2])


def test_accelerate_plans_a_dict_batch_where_a_key_appears_again(keyed, monkeypatch):
    from lightning_remat.accelerate import ENV_BUDGET, ENV_COST, RematAccelerator, remat_session

    batches, budget = keyed
    monkeypatch.setenv(ENV_BUDGET, str(budget))
    monkeypatch.setenv(ENV_COST, "flops")
    accelerator = RematAccelerator()
    model = fusion()
    model, optimizer = accelerator.prepare(model, sgd(model))
    peaks = []
    torch.manual_seed(1)
    for batch in batches:
        meter = TorchPeak(model, optimizer).start()
        accelerator.backward(model(batch))
        optimizer.step()
        optimizer.zero_grad()
        peaks.append(meter.stop())
    session = remat_session(model)
    assert all(peak <= budget for peak in peaks[1:]), [p / budget for p in peaks]  # the first step is observed
    assert sorted(str(key) for key in session.shape_plans.plans) == ["64x1 {0.0.context: bx16, 0.0.x: bx16}",
                                                                     "64x1 {0.0.x: bx16}"]
