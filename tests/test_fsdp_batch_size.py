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
    from lightning_remat.runtime.measure import measure_step

    if not optimizer.state:
        measure_step(model, make_step(1), optimizer)
    return measure_step(model, make_step(batch_size), optimizer).peak_bytes


def _rank(rank: int) -> dict:
    import torch.distributed as dist

    import lightning_remat.runtime.profile as profiling
    from lightning_remat import find_remat_batch_size
    from lightning_remat.runtime.apply import checkpointed_modules

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
    result = find_remat_batch_size(make_step, model, budget, optimizer=optimizer, start=2, max_batch_size=64,
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


def test_every_rank_finds_the_same_batch_and_plan(ranks):
    r0, r1 = ranks
    assert r0["batch_size"] == r1["batch_size"]
    assert r0["plan"] and r0["plan"] == r1["plan"] == r0["wrapped"] == r1["wrapped"]
    assert r0["trials"] == r1["trials"]  # the same trials, with the same (largest over the ranks) peaks
    assert r0["profiles"] == r1["profiles"] >= 2  # every rank profiled, in lockstep
    assert r0["unchanged"] and r1["unchanged"]  # trials put weights and optimizer state back


def test_the_batch_found_holds_the_per_rank_budget(ranks):
    budget = ranks[0]["budget"]
    assert ranks[0]["measured"] == ranks[1]["measured"] <= budget
    assert max(max(r["steady"]) for r in ranks) <= budget


def test_larger_than_the_largest_batch_without_recomputation(ranks):
    r0 = ranks[0]
    assert r0["peak_8"] <= r0["budget"] < r0["peak_9"]  # by measurement, 9 does not fit without recomputation
    assert r0["without"] == ranks[1]["without"] <= 8
    assert r0["batch_size"] > 8
