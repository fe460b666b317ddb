"""plan_remat under torch.distributed (plain PyTorch, e.g. before FSDP2 or DDP): rank 0 decides,
every rank gets the same plan whatever the cost kind, or the same error."""

import pytest
import torch

from tests.gloo_ranks import count_profile_calls, spawn

# Every test here runs 2 gloo ranks.
pytestmark = pytest.mark.distributed


def _rank(rank: int, budget) -> dict:
    from lightning_remat import BudgetTooSmallError, plan_remat
    from lightning_remat.models import build

    calls = count_profile_calls()
    case = build("mlp", batch_size=256 + 64 * rank, depth=6, width=64)  # ranks see different batches
    result = {"profiles": 0}
    try:
        plan = plan_remat(case.model, case.step, budget, cost="time")  # measured time differs per rank
        result.update(checkpointed=plan.checkpointed, predicted=plan.predicted_peak_bytes)
    except BudgetTooSmallError as err:
        result.update(error=str(err), smallest=err.smallest_peak_bytes)
    result["profiles"] = len(calls)
    return result


def _run(tmp_path, budget):
    return spawn(_rank, tmp_path, budget)


def test_every_rank_gets_rank_zeros_plan(tmp_path):
    ranks = _run(tmp_path, "min")
    assert [r["profiles"] for r in ranks] == [1, 0]  # only rank 0 profiles
    assert ranks[0]["checkpointed"] and ranks[0]["checkpointed"] == ranks[1]["checkpointed"]
    assert ranks[0]["predicted"] == ranks[1]["predicted"]


def test_every_rank_raises_rank_zeros_error_with_its_figures(tmp_path):
    ranks = _run(tmp_path, 1000)
    assert ranks[0]["error"] == ranks[1]["error"] and "smallest reachable peak" in ranks[0]["error"]
    assert ranks[0]["smallest"] == ranks[1]["smallest"] > 1000


def _ddp_rank(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_remat import ProfileOptions, apply_plan, plan_remat, profile_step
    from lightning_remat.runtime.installing.apply import checkpointed_modules
    from lightning_remat.models import build
    from lightning_remat.runtime.measuring.measure import measure_step

    torch.manual_seed(0)
    case = build("mlp", batch_size=1024, depth=6, width=64)
    ddp = DDP(case.model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    plain = profile_step(case.model, case.step, optimizer=optimizer, options=ProfileOptions(gradient_buckets=True))
    # The wrapper itself goes in: rank 0 profiles the module inside (no all-reduce on one rank).
    plan = plan_remat(ddp, case.step, "min", optimizer=optimizer, cost="flops")
    budget = plan.budget_bytes
    apply_plan(ddp, plan)  # names are the inner module's, the wrapper is looked through
    steps = []
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        peak = measure_step(ddp, case.step, optimizer).peak_bytes
        steps.append(peak)
    grad = [p.grad.clone() for p in ddp.parameters()]
    result = dict(checkpointed=plan.checkpointed, applied=checkpointed_modules(ddp), budget=budget,
                  baseline=plan.baseline_peak_bytes, first_profile_baseline=plain.baseline_peak_bytes,
                  predicted=plan.predicted_peak_bytes, peaks=steps,
                  bucket_note=any("DDP" in n for n in plan.notes), grad_sum=float(sum(g.sum() for g in grad)))
    return result


def test_plan_remat_on_a_ddp_model_profiles_the_module_inside_and_counts_buckets(tmp_path):
    ranks = spawn(_ddp_rank, tmp_path)
    assert ranks[0]["checkpointed"] and ranks[0]["checkpointed"] == ranks[1]["checkpointed"], ranks
    # Profiled through the wrapper or not, the module inside is what is measured: the same baseline.
    assert ranks[0]["baseline"] == ranks[0]["first_profile_baseline"], ranks
    assert ranks[0]["applied"] == ranks[1]["applied"] == ranks[0]["checkpointed"]
    assert ranks[0]["bucket_note"]
    assert ranks[0]["grad_sum"] == pytest.approx(ranks[1]["grad_sum"])  # gradients all-reduced
    for r in ranks:
        steady = max(r["peaks"][1:])  # after Adam's state exists
        assert steady <= r["budget"], r
        assert abs(r["predicted"] - steady) <= 0.05 * steady
