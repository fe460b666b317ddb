"""Real sharded training (FSDP2 ``fully_shard``, 2 processes, gloo, CPU).

plan_remat on a model already sharded profiles on every rank in lockstep and gives every rank the
same plan; the largest per-rank peak of a steady step (optimizer state alive) is within the
per-rank budget and within 5% of the prediction, and the losses are those of one unsharded process.
Planning before sharding (plan_remat and apply_plan, then fully_shard) keeps working."""

import copy

import pytest
import torch
from tests.gloo_ranks import count_profile_calls, shard_gpt2, small_gpt2, spawn

pytestmark = pytest.mark.xdist_group("fsdp-multiprocess")

STEPS = 4
_model, _shard = small_gpt2, shard_gpt2


def _train(model, step, optimizer):
    """Losses and MemTracker peaks of STEPS steps."""
    from lightning_remat.runtime.measuring.measure import measure_step

    runs = [measure_step(model, step, optimizer) for _ in range(STEPS)]
    return [r.loss for r in runs], [r.peak_bytes for r in runs]


def _rank(rank: int) -> dict:
    from lightning_remat import apply_plan, plan_remat
    from lightning_remat.runtime.installing.apply import checkpointed_modules

    calls = count_profile_calls()
    result = {}
    case = _model()
    if rank == 0:  # the reference: one unsharded process, the same batch, the same Adam steps
        reference = copy.deepcopy(case.model)
        result["reference"] = _train(reference, case.step, torch.optim.Adam(reference.parameters(), lr=1e-3))[0]

    # (1) sharded first, then planned: every rank profiles in lockstep.
    model = case.model
    _shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    least = plan_remat(model, case.step, "min", optimizer=optimizer, cost="flops")
    budget = int(least.predicted_peak_bytes + 0.4 * (least.baseline_peak_bytes - least.predicted_peak_bytes))
    plan = plan_remat(model, case.step, budget, optimizer=optimizer, cost="flops")
    apply_plan(model, plan)
    losses, peaks = _train(model, case.step, optimizer)
    result["sharded"] = dict(profiles=len(calls), plan=plan.checkpointed, wrapped=checkpointed_modules(model),
                             budget=budget, predicted=plan.predicted_peak_bytes, baseline=plan.baseline_peak_bytes,
                             losses=losses, steady=max(peaks[1:]), notes=plan.notes)

    # (2) planned on the unsharded model, applied, then sharded (the budget is the unsharded step's).
    case = _model()
    unsharded_adam = torch.optim.Adam(case.model.parameters(), lr=1e-3)  # its state counted whole, as planned
    plan = plan_remat(case.model, case.step, "min", optimizer=unsharded_adam, cost="flops")
    apply_plan(case.model, plan)
    _shard(case.model)
    optimizer = torch.optim.Adam(case.model.parameters(), lr=1e-3)
    losses, peaks = _train(case.model, case.step, optimizer)
    result["before"] = dict(plan=plan.checkpointed, wrapped=checkpointed_modules(case.model),
                            budget=plan.budget_bytes, losses=losses, steady=max(peaks[1:]))

    # (3) Accelerate's session (what RematAccelerator attaches after its FSDP2 prepare) on a model
    # sharded by hand: the user's loop observed, then planned on every rank, then measured.
    from lightning_remat.accelerate import RematPlugin, prepare_remat, remat_session

    case = _model()
    _shard(case.model)
    optimizer = torch.optim.Adam(case.model.parameters(), lr=1e-3)
    session = remat_session(prepare_remat(case.model, RematPlugin(budget=budget, cost="flops")))
    calls.clear()
    losses = []
    for _ in range(STEPS):
        loss = case.step(case.model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    case.step(case.model)  # the session lets go of the model at the next forward
    result["session"] = dict(profiles=len(calls), plan=session.plan.checkpointed, phase=session.phase,
                             wrapped=checkpointed_modules(case.model), metrics=session.metrics, losses=losses)
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(_rank, tmp_path_factory.mktemp("fsdp"))


@pytest.mark.distributed
def test_sharded_model_is_planned_on_every_rank_and_holds_the_budget(ranks):
    r0, r1 = ranks[0]["sharded"], ranks[1]["sharded"]
    assert r0["profiles"] == r1["profiles"] == 2  # every rank profiled, in lockstep
    assert r0["plan"] and r0["plan"] == r1["plan"] == r0["wrapped"] == r1["wrapped"]
    assert any("ranks in lockstep" in note for note in r0["notes"])
    steady = max(r0["steady"], r1["steady"])  # the largest per-rank peak, optimizer state alive
    assert steady <= r0["budget"] < r0["baseline"]
    assert steady == pytest.approx(r0["predicted"], rel=0.05)
    assert r0["losses"] == pytest.approx(ranks[0]["reference"], abs=1e-5)
    assert r1["losses"] == pytest.approx(ranks[0]["reference"], abs=1e-5)


@pytest.mark.distributed
def test_planned_before_sharding_keeps_working(ranks):
    r0, r1 = ranks[0]["before"], ranks[1]["before"]
    assert r0["plan"] and r0["plan"] == r1["plan"] == r0["wrapped"] == r1["wrapped"]
    # Sharding only lowers a rank's peak below the unsharded budget.
    assert max(r0["steady"], r1["steady"]) <= r0["budget"]
    assert r0["losses"] == pytest.approx(ranks[0]["reference"], abs=1e-5)


@pytest.mark.distributed
def test_accelerate_session_plans_a_sharded_model_on_every_rank(ranks):
    r0, r1 = ranks[0]["session"], ranks[1]["session"]
    assert r0["profiles"] == r1["profiles"] == 1
    assert r0["phase"] == r1["phase"] == "done"
    assert r0["plan"] and r0["plan"] == r1["plan"] == r0["wrapped"] == r1["wrapped"]
    metrics = r0["metrics"]
    assert metrics["remat/measured_peak_bytes"] == r1["metrics"]["remat/measured_peak_bytes"]  # the max over ranks
    assert metrics["remat/measured_peak_bytes"] <= metrics["remat/budget_bytes"]
    assert metrics["remat/measured_peak_bytes"] == pytest.approx(metrics["remat/predicted_peak_bytes"], rel=0.05)
    assert r0["losses"] == pytest.approx(ranks[0]["reference"], abs=1e-5)
    assert r1["losses"] == pytest.approx(ranks[0]["reference"], abs=1e-5)


def test_accelerate_fsdp1_is_refused_with_the_workaround():
    from lightning_remat.core.errors import UnsupportedShardingError
    from lightning_remat.integrations.accelerate.accelerator import _check_supported

    class FSDP1:
        distributed_type, is_fsdp2 = "FSDP", False

    class FSDP2:
        distributed_type, is_fsdp2 = "FSDP", True

    with pytest.raises(UnsupportedShardingError, match="fsdp_version=2") as info:
        _check_supported(FSDP1())
    assert isinstance(info.value, NotImplementedError) and "apply_plan" in str(info.value)
    _check_supported(FSDP2())  # accepted


def test_profiles_merge_term_by_term_and_must_have_the_same_stages():
    from lightning_remat.core.errors import UnsupportedShardingError
    from lightning_remat.core.memory_model import (Costs, Profile, Segment, StageAction, StageOption, StageProfile,
                                                   predict_peak)
    from lightning_remat.core.profile_algebra import merge_profiles

    def profile(stored, local, head, extra=()):
        options = (StageOption("keep", StageAction("a"), stored, local),
                   StageOption("whole", StageAction.recompute("a"), 10, local + 5, Costs(1.0, 7)))
        return Profile((StageProfile("a", options),), (Segment("head", 1, head), *extra), parameter_bytes=stored)

    a, b = profile(100, 150, 50), profile(120, 140, 60, (Segment("outside the model (the loss)", 1, 30),))
    merged = merge_profiles([a, b])
    keep, whole = merged.stages[0].options
    assert (keep.stored_bytes, keep.local_peak_bytes, whole.local_peak_bytes) == (120, 150, 155)
    assert [(s.name, s.peak_bytes) for s in merged.segments] == [("head", 60), ("outside the model (the loss)", 30)]
    assert merged.parameter_bytes == 120 and merged.baseline_peak_bytes == predict_peak(merged, [0])
    # The merged prediction bounds every rank's own.
    for choice in ([0], [1]):
        assert predict_peak(merged, choice) >= max(predict_peak(a, choice), predict_peak(b, choice))
    other = Profile((StageProfile("b", a.stages[0].options),), a.segments)
    with pytest.raises(UnsupportedShardingError, match="same shape"):
        merge_profiles([a, other])


def test_fake_profiling_of_a_sharded_model_is_refused_before_any_collective():
    from torch import nn

    from lightning_remat import ProfileOptions, RematConfig
    from lightning_remat.core.errors import UnsupportedShardingError
    from lightning_remat.service.planning import Planner
    from tests.function_channel import FunctionChannel

    def never(*args):
        raise AssertionError("no collective may start")

    planner = Planner(RematConfig("min", cost="flops", profile=ProfileOptions(fake=True)))
    with pytest.raises(UnsupportedShardingError, match="world_size"):
        planner.shared_plan(nn.Linear(2, 2), lambda m: m(torch.ones(1, 2)).sum(),
                            channel=FunctionChannel(broadcast=never, gather=never), lockstep=True)
