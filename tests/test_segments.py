"""Multi-stage segments at runtime: exact gradients, BatchNorm once, exact undo, predicted peaks."""

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_remat import Plan, StageAction, profile_step, solve
from lightning_remat.core.solve import plan_from_choices
from lightning_remat.models import build
from lightning_remat.runtime.installing.apply import (apply_plan, applied, checkpointed_modules, remove_remat,
                                                      segmented_modules)
from lightning_remat.runtime.measuring.tracking import Tracker, snapshot_by_category
from tests.tiny_hf import shallow_resnet


def _bn_dropout_chain(depth=6, width=16):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.3))
                           for _ in range(depth)]).train()


def _plan(checkpointed, segments):
    """A plan of actions: ``checkpointed`` recomputed alone, each of ``segments`` as one checkpoint."""
    return Plan([*(StageAction.recompute(n) for n in checkpointed),
                 *(StageAction.in_segment(s, segment) for segment in segments for s in segment)])


def _train(model, steps=2, seed=1):
    torch.manual_seed(seed)
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


def test_segments_give_bit_equal_gradients_and_batchnorm_statistics_once():
    plain = _bn_dropout_chain()
    segmented = copy.deepcopy(plain)
    apply_plan(segmented, _plan(["5"], [["0", "1", "2"], ["3", "4"]]))
    assert segmented_modules(segmented) == [["0", "1", "2"], ["3", "4"]] and checkpointed_modules(segmented) == ["5"]
    expected, got = _train(plain), _train(segmented)
    for a, b in zip(expected, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for (name, a), (_, b) in zip(plain.state_dict().items(), segmented.state_dict().items()):
        assert torch.equal(a, b), name  # running means, variances and counts: updated once per step


def test_apply_and_remove_restore_the_model_exactly():
    net = _bn_dropout_chain()
    keys = list(net.state_dict())
    names = [n for n, _ in net.named_modules()]
    apply_plan(net, _plan([], [["1", "2", "3"]]))
    assert type(net).__name__ == "Sequential" and len(net) == 6 and len(list(net)) == 4
    assert list(net.state_dict()) == keys and [n for n, _ in net.named_modules()] == names
    with applied(net, Plan([StageAction.recompute("0")])):  # the profiler lifts a plan and puts it back
        assert segmented_modules(net) == [] and checkpointed_modules(net) == ["0"]
    assert segmented_modules(net) == [["1", "2", "3"]]
    remove_remat(net)
    assert type(net) is nn.Sequential and len(list(net)) == 6 and segmented_modules(net) == []
    assert all("forward" not in m.__dict__ and "_remat_segments" not in m.__dict__ for m in net.modules())
    assert list(net.state_dict()) == keys


@pytest.mark.parametrize("segments, checkpointed, match", [
    ([["0", "2"]], [], "consecutive"),
    ([["0"]], [], "two or more"),
    ([["0", "1"], ["1", "2"]], [], "two segments"),
    ([["0", "1"]], ["1.0"], "alone and as part of a segment"),
    ([["0.0", "1.0"]], [], "items of one nn.Sequential"),
    ([["0", "9"]], [], "does not have"),
])
def test_bad_segments_are_refused_before_anything_changes(segments, checkpointed, match):
    net = _bn_dropout_chain()
    apply_plan(net, ["5"])
    with pytest.raises(ValueError, match=match):
        apply_plan(net, _plan(checkpointed, segments))
    assert checkpointed_modules(net) == ["5"] and segmented_modules(net) == []


def test_resnet_stage_loops_run_segments_with_equal_gradients():
    case = build("resnet50", batch_size=2, image_size=32, width=16)
    plain = case.model
    segmented = copy.deepcopy(plain)
    stages = "resnet.encoder.stages"
    apply_plan(segmented, _plan([], [[f"{stages}.1.layers.{i}" for i in range(4)],
                                      [f"{stages}.2.layers.{i}" for i in range(1, 4)]]))
    _assert_one_step_bit_equal(case.step, plain, segmented)


def _assert_one_step_bit_equal(step, plain, other):
    """One forward and backward of each: equal gradients and equal state (BatchNorm statistics)."""
    for model in (plain, other):
        torch.manual_seed(0)
        step(model).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), other.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), (_, b) in zip(plain.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_cnn_stem_is_a_stage_and_recomputing_it_cuts_the_least_peak_with_equal_gradients():
    """ResNet's stem (conv, BatchNorm, ReLU, max-pool) is found as a stage before the bottlenecks;
    recomputing it keeps gradients and BatchNorm statistics bit-equal and lowers the least peak."""
    from lightning_remat.runtime.profiling.candidates import find_stages

    case = shallow_resnet(image_size=64)  # ResNet-50 took 44-79 s
    stages = find_stages(case.model)
    assert stages[0] == "resnet.embedder" and stages[1] == "resnet.encoder.stages.0.layers.0"
    assert find_stages(nn.Sequential(*[nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU()) for _ in range(2)])) == ["0", "1"]
    assert find_stages(build("gpt2", batch_size=1, seq_len=8, layers=2, hidden=32).model)[0] == "transformer.h.0"
    plain, stem = case.model, copy.deepcopy(case.model)
    apply_plan(stem, ["resnet.embedder"])
    _assert_one_step_bit_equal(case.step, plain, stem)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with_stem = profile_step(copy.deepcopy(plain), case.step, optimizer=torch.optim.Adam(plain.parameters()))
        without = profile_step(copy.deepcopy(plain), case.step, optimizer=torch.optim.Adam(plain.parameters()),
                               candidates="ResNetBottleNeckLayer")
    plan = solve(with_stem, "min", cost="flops")
    assert "resnet.embedder" in plan.checkpointed
    assert plan.predicted_peak_bytes < solve(without, "min", cost="flops").predicted_peak_bytes


def _measured_peak(model, step, opt):
    tracker = Tracker()
    tracker.track_external(model, opt)
    with tracker:
        step(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return snapshot_by_category(tracker.get_tracker_snapshot("peak"), torch.device("cpu"))["Total"]


class _Bottleneck(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c))

    def forward(self, x):
        return torch.relu(x + self.b(self.a(x)))


class _Stage(nn.Module):
    """Like transformers' ResNetStage: loops over its Sequential of blocks itself."""

    def __init__(self, c, depth):
        super().__init__()
        self.layers = nn.Sequential(*[_Bottleneck(c) for _ in range(depth)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _SmallResNet(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.stages = nn.ModuleList([_Stage(c, 4), _Stage(c, 5)])
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean((2, 3)))


def _small_resnet_case():
    torch.manual_seed(0)
    model = _SmallResNet().train()
    x, y = torch.randn(8, 3, 24, 24), torch.randint(0, 10, (8,))
    return model, lambda m: nn.functional.cross_entropy(m(x), y)


def _mlp_case():
    case = build("mlp", batch_size=512, depth=12, width=32)
    return case.model, case.step


def _steady_profile(model, step):
    """An Adam whose state exists (one real step), and the model's profile with it."""
    opt = torch.optim.Adam(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return opt, profile_step(model, step, optimizer=opt)


@pytest.mark.parametrize("make", [_mlp_case, _small_resnet_case])
def test_predicted_peak_of_plans_with_segments_within_5_percent(make):
    model, step = make()
    opt, profile = _steady_profile(model, step)
    assert profile.span_groups and all(len(g) >= 2 for g in profile.span_groups)
    n = len(profile.stages)
    index = {s.name: i for i, s in enumerate(profile.stages)}
    group = [index[s] for s in profile.span_groups[-1]]
    plans = [solve(profile, "min", cost="flops"),
             # a long span, everything else recomputed alone; and spans among kept stages
             plan_from_choices(profile, [1] * n, 0, "flops", spans=[(group[0], group[-1])]),
             plan_from_choices(profile, [0] * n, 0, "flops", spans=[(group[0], group[1])])]
    assert plans[1].segments and plans[2].segments  # the least peak may or may not use one
    for plan in plans:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            apply_plan(model, plan)
            measured = _measured_peak(model, step, opt)
            remove_remat(model)
        assert plan.predicted_peak_bytes == pytest.approx(measured, rel=0.05), plan.segments


def test_profile_offers_no_groups_for_module_lists():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    x = torch.randn(4, 8)
    profile = profile_step(Stack(), lambda m: m(x).sum())
    assert len(profile.stages) == 3 and profile.span_groups == ()


def _checkpoint_sequential_spans(n, segments):
    # torch's checkpoint_sequential: segments - 1 checkpoints of n // segments items, the rest run plainly.
    size = n // segments
    return [(start, start + size - 1) for start in range(0, size * (segments - 1), size)]


class _CheckpointSequential(nn.Module):
    def __init__(self, chain, segments):
        super().__init__()
        self.chain, self.segments = chain, segments

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint_sequential
        return checkpoint_sequential(self.chain, self.segments, x, use_reentrant=False)


@pytest.mark.parametrize("segments", [2, 3, 4])
def test_checkpoint_sequentials_own_plan_is_predicted_exactly(segments):
    # The span terms are exact where memory is additive: checkpoint_sequential's plan, expressed as
    # our segments, is predicted to the byte of MemTracker's peak of checkpoint_sequential itself.
    case = build("mlp", batch_size=512, depth=12, width=32)
    model, x = case.model, torch.randn(512, 32, generator=torch.Generator().manual_seed(1))
    step = lambda m: m(x).square().mean()  # noqa: E731
    opt, profile = _steady_profile(model, step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        n = len(profile.stages)
        plan = plan_from_choices(profile, [0] * n, 0, "flops", spans=_checkpoint_sequential_spans(n, segments))
        theirs = _measured_peak(_CheckpointSequential(model, segments), step, opt)
        apply_plan(model, plan)
        ours = _measured_peak(model, step, opt)
        remove_remat(model)
        # Its plain tail is where its peak lies; with the tail recomputed stage by stage, the peak
        # lies in a segment's recompute (where the old terms counted the output gradient twice).
        spans = _checkpoint_sequential_spans(n, segments)
        tail = plan_from_choices(profile, [0] * (spans[-1][1] + 1) + [1] * (n - spans[-1][1] - 1), 0, "flops", spans=spans)
        apply_plan(model, tail)
        tail_peak = _measured_peak(model, step, opt)
        remove_remat(model)
    assert ours == theirs  # the same plan
    assert plan.predicted_peak_bytes == theirs, (plan.predicted_peak_bytes, theirs)
    assert tail.predicted_peak_bytes == tail_peak, (tail.predicted_peak_bytes, tail_peak)
