"""The batch-size search on a model sharded with FSDP2 (``fully_shard``), 2 processes, gloo, CPU.

Every rank calls ``find_remat_batch_size``; every rank profiles and runs trials in lockstep (a rank
that skipped a pass would leave the other waiting in a collective) and returns the same batch size
and plan. The budget is per rank: it sits between the largest per-rank peak of a steady step at
batch 8 and at batch 9 without recomputation, so 8 is the largest batch without recomputation, and
with the plan applied a steady step at the batch found stays within it on every rank."""

import pytest
import torch
from tests.gloo_ranks import shard_gpt2, small_gpt2, spawn

pytestmark = pytest.mark.xdist_group("fsdp-multiprocess")

VOCAB, SEQ = 128, 32


def make_step(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(batch_size))
    return lambda model: model(input_ids=ids, labels=ids).loss


def _sharded_with_adam():
    model = small_gpt2().model
    shard_gpt2(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _steady_peak(model, optimizer, batch_size: int) -> int:
    """This rank's MemTracker peak of a real step once Adam's state exists."""
    from lightning_remat.runtime.measuring.measure import measure_step

    if not optimizer.state:
        measure_step(model, make_step(1), optimizer)
    return measure_step(model, make_step(batch_size), optimizer).peak_bytes


def _rank(rank: int) -> dict:
    import torch.distributed as dist

    import lightning_remat.runtime.profiling.profile as profiling
    from lightning_remat import find_remat_batch_size
    from lightning_remat.runtime.installing.apply import checkpointed_modules

    def largest(value: int) -> int:
        values = [None, None]
        dist.all_gather_object(values, value)
        return max(values)

    model, optimizer = _sharded_with_adam()
    peak_8, peak_9 = largest(_steady_peak(model, optimizer, 8)), largest(_steady_peak(model, optimizer, 9))
    budget = (peak_8 + peak_9) // 2
    del model, optimizer

    calls = []
    real = profiling.profile_step
    profiling.profile_step = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    model, optimizer = _sharded_with_adam()
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    result = find_remat_batch_size(model, make_step, budget, optimizer=optimizer, init_val=2, max_val=64,
                                   confirm_without_remat=True)
    unchanged = (all(torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, model.parameters()))
                 and not optimizer.state)
    profiling.profile_step = real
    # The plan is applied: a steady real step at the batch found, measured on this rank.
    steady = [_steady_peak(model, optimizer, result.batch_size) for _ in range(2)]
    return dict(budget=budget, peak_8=peak_8, peak_9=peak_9, batch_size=result.batch_size,
                without=result.batch_size_without_remat, plan=result.plan.checkpointed,
                wrapped=checkpointed_modules(model), trials=[(t.batch_size, t.fits, t.measured_peak_bytes)
                                                             for t in result.trials],
                measured=result.measured_peak_bytes, profiles=len(calls), steady=steady, unchanged=unchanged,
                notes=result.notes)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(_rank, tmp_path_factory.mktemp("fsdp-batch"))


@pytest.mark.distributed
def test_every_rank_finds_the_same_batch_and_plan(ranks):
    r0, r1 = ranks
    assert r0["batch_size"] == r1["batch_size"]
    assert r0["plan"] and r0["plan"] == r1["plan"] == r0["wrapped"] == r1["wrapped"]
    assert r0["trials"] == r1["trials"]  # the same trials, with the same (largest over the ranks) peaks
    assert r0["profiles"] == r1["profiles"] >= 2  # every rank profiled, in lockstep
    assert r0["unchanged"] and r1["unchanged"]  # trials put weights and optimizer state back


@pytest.mark.distributed
def test_the_batch_found_holds_the_per_rank_budget(ranks):
    budget = ranks[0]["budget"]
    assert ranks[0]["measured"] == ranks[1]["measured"] <= budget
    assert max(max(r["steady"]) for r in ranks) <= budget


@pytest.mark.distributed
def test_larger_than_the_largest_batch_without_recomputation(ranks):
    r0 = ranks[0]
    assert r0["peak_8"] <= r0["budget"] < r0["peak_9"]  # by measurement, 9 does not fit without recomputation
    assert r0["without"] == ranks[1]["without"] <= 8
    assert r0["batch_size"] > 8


def _mlp_search(other_rank):
    """A ``ShardedBatchSearch`` in one process whose "other rank" is simulated by ``gather``."""
    from dataclasses import replace

    from torch import nn

    from lightning_remat.core.config import RematConfig
    from lightning_remat.runtime.measuring.trial import Trial
    from lightning_remat.service.batch_search import ShardedBatchSearch
    from tests.function_channel import FunctionChannel

    def gather(value):
        if isinstance(value, tuple) and value and isinstance(value[0], Trial):
            return [value, (other_rank(value[0], replace), None)]
        return [value, value]

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32)) for _ in range(6)])

    def mlp_step(b):
        x = torch.randn(b, 32, generator=torch.Generator().manual_seed(b))
        return lambda m: m(x).square().mean()

    budget = 1_100_000
    search = ShardedBatchSearch(mlp_step, net, None, RematConfig(budget, cost="flops"), budget, 0.35, 1, "binsearch",
                                4, channel=FunctionChannel(gather=gather))
    search.fit_profiles(512)
    return search, budget


@pytest.mark.parametrize("failure", ["over budget", "out of memory"])
def test_a_trial_that_fails_on_any_rank_fails_on_all(failure):
    injected = []

    def other_rank(trial, replace):
        if injected or not trial.fits:  # the first trial that fits on this rank fails on the other
            return trial
        injected.append(trial.batch_size)
        if failure == "over budget":
            return replace(trial, measured_peak_bytes=budget + 1, fits=False)
        return replace(trial, measured_peak_bytes=None, out_of_memory=True, fits=False)

    search, budget = _mlp_search(other_rank)
    confirmed, measured = search.confirm(512, 25)
    assert injected
    failed = next(t for t in search.trials if t.batch_size == injected[0])
    assert not failed.fits and failed.out_of_memory == (failure == "out of memory")
    assert 0 < confirmed < injected[0] and measured <= budget


def test_an_error_on_another_rank_is_raised_on_every_rank():
    from torch import nn

    from lightning_remat.core.config import RematConfig
    from lightning_remat.core.errors import PlanningFailedError
    from lightning_remat.service.batch_search import ShardedBatchSearch
    from tests.function_channel import FunctionChannel

    def gather(value):  # the other rank failed while profiling
        return [value, (None, PlanningFailedError("profiling failed on rank 1: RuntimeError: boom"))]

    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    search = ShardedBatchSearch(lambda b: (lambda m: m(torch.ones(b, 4)).sum()), net, None, RematConfig(10**6), 10**6,
                                0.35, 1, "binsearch", 2, channel=FunctionChannel(gather=gather))
    with pytest.raises(PlanningFailedError, match="rank 1: RuntimeError: boom"):
        search.fit_profiles(64)
