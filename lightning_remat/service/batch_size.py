"""The largest batch that fits a memory budget with optimal recomputation (``docs/batch_size.md``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.batch_fit import DEFAULT_MAX_BATCH_SIZE, validate_search
from ..core.budget import format_budget, format_bytes
from ..core.config import DEFAULT_COST, ProfileOptions, RematConfig
from ..core.plan import Plan
from ..runtime.installing.apply import apply_plan
from ..runtime.installing.fingerprint import bound
from ..runtime.installing.installer import restore, snapshot
from ..runtime.profiling.candidates import CandidateSpec
from ..runtime.measuring.exclusive import exclusive
from ..runtime.measuring.measure import model_device
from ..runtime.targets.offload_link import check_offload_target
from ..runtime.measuring.trial import Trial
from .batch_search import BatchSearch, MakeStep, ShardedBatchSearch, too_small_at_one
from .channel import torch_distributed_channel
from .planning import fsdp2_sharded, refuse_fsdp1

@dataclass
class BatchSizeResult:
    """What ``find_remat_batch_size`` found and what the search cost (``largest_fitting``: before ``margin``).

    >>> plan = Plan([], 10**6, 2 * 10**6, 9 * 10**5, 0.2)
    >>> BatchSizeResult(32, 8, 32, plan, 10**6).ratio
    4.0
    """

    batch_size: int
    batch_size_without_remat: int
    largest_fitting: int
    plan: Plan
    budget_bytes: int
    measured_peak_bytes: int | None = None
    max_overhead: float = 0.35
    margin: float = 0.0
    steps_per_trial: int = 1
    trials: list[Trial] = field(default_factory=list)
    trial_steps: int = 0
    profile_batch_sizes: tuple[int, ...] = ()
    profile_passes: int = 0
    profile_samples: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """``batch_size / batch_size_without_remat`` (infinite when nothing fits without recomputation)."""
        if self.batch_size_without_remat <= 0:
            return math.inf
        return self.batch_size / self.batch_size_without_remat

    @property
    def predicted_overhead(self) -> float:
        """Recompute cost of the plan as a share of a step without recomputation."""
        return self.plan.predicted_overhead

    def __repr__(self) -> str:
        """The figures that answer the search, not every field (the plan and trials made it kilobytes)."""
        ratio = "inf" if math.isinf(self.ratio) else f"{self.ratio:.2f}x"
        peaks = {"predicted_peak": self.plan.predicted_peak_bytes, "measured_peak": self.measured_peak_bytes}
        shown = ", ".join(f"{k}={'-' if v is None else format_bytes(v)}" for k, v in peaks.items())
        shown += f", budget={format_budget(self.plan.requested_budget, self.budget_bytes)}"
        overhead = "-" if self.predicted_overhead is None else f"{self.predicted_overhead:.1%}"
        return (f"BatchSizeResult(batch_size={self.batch_size}, batch_size_without_remat={self.batch_size_without_remat}, "
                f"ratio={ratio}, {shown}, predicted_overhead={overhead})")

    def metrics(self) -> dict[str, float]:
        """The figures loggers receive, under ``remat/...``."""
        return {
            "remat/batch_size": float(self.batch_size),
            "remat/batch_size_without_remat": float(self.batch_size_without_remat),
            "remat/batch_size_ratio": float(self.ratio),
            "remat/predicted_overhead": float(self.predicted_overhead),
        }

    def table(self) -> Any:
        from ..report.render import batch_size_table

        return batch_size_table(self)

    def summary(self) -> str:
        from ..report.render import batch_size_table, to_text

        return to_text([batch_size_table(self)], width=100)


def search_setup(model: nn.Module, config: RematConfig, purpose: str) -> tuple[int, Plan]:
    """The budget in bytes, checked for a search (``purpose``), and the plan installed now (``apply_or_restore``)."""
    config.require_size(purpose)
    if config.profile.offload:
        # The error profile_step would raise, before any step runs (no accelerator target).
        check_offload_target(config.profile, model_device(model))
    return int(config.budget_bytes(model_device(model))), snapshot(model)


def apply_or_restore(model: nn.Module, plan: Plan | None, apply: bool, previous: Plan) -> None:
    """Install the search's ``plan``, or (``apply=False``) put back what was installed before the search."""
    if apply:
        apply_plan(model, plan)
    elif previous != snapshot(model):
        restore(model, previous)


@exclusive()
def find_remat_batch_size(
    model: nn.Module,
    make_step: MakeStep,
    budget: int | str,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    init_val: int = 2,
    max_val: int = DEFAULT_MAX_BATCH_SIZE,
    max_overhead: float = 0.35,
    steps_per_trial: int = 1,
    margin: float = 0.0,
    cost: str | None = DEFAULT_COST,
    mode: str = "binsearch",
    max_trials: int = 25,
    candidates: CandidateSpec = None,
    policies: Any = (),
    confirm: bool = True,
    confirm_without_remat: bool = False,
    apply: bool = True,
    offload: bool = False,
    verbose: bool = True,
) -> BatchSizeResult:
    """The largest batch size whose training step fits ``budget`` with optimal recomputation.

    Two small batches are profiled, every term fitted as ``a + b * batch``, the largest fitting batch searched on
    predictions and confirmed with real steps (arguments: Lightning's and ``plan_remat``'s; docs/batch_size.md).

    Args:
        make_step: ``make_step(batch_size)`` returns ``step(model) -> loss`` on a batch of that size.
        budget: the peak memory of a training step: "10GB", bytes, "80%" of the device.
        init_val: the first batch size; the model is profiled at ``init_val`` and ``2 * init_val``.
        max_overhead: the largest recompute cost accepted, as a share of a step (0 = no recomputation).
        margin: the found batch is reduced to ``floor(batch * (1 - margin))``, at least 1.
        mode: ``"binsearch"`` finds the largest batch; ``"power"`` the largest ``init_val * 2**k``.
        confirm: run real trial steps (without it the result is a prediction only).

    Raises:
        BatchSizeTooSmallBudgetError: even a batch of one does not fit within ``max_overhead``.

    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)])
    >>> make_step = lambda b: (lambda m, x=torch.randn(b, 32): m(x).square().mean())
    >>> result = find_remat_batch_size(net, make_step, 600_000, init_val=4, max_val=256)
    >>> result.batch_size > result.batch_size_without_remat > 0, result.measured_peak_bytes <= 600_000
    (True, True)
    """
    validate_search(max_overhead, margin, steps_per_trial, init_val, max_val, mode, max_trials)
    config = RematConfig(budget, cost=cost, profile=ProfileOptions(candidates=candidates, offload=offload,
                                                                   policies=policies))
    budget_bytes, previous = search_setup(model, config, "a batch-size search")
    refuse_fsdp1(model, "find_remat_batch_size")
    channel = torch_distributed_channel()
    sharded = fsdp2_sharded(model) and channel.distributed
    args = (max_overhead, steps_per_trial, mode, init_val)
    # Sharded with FSDP2: every rank searches in lockstep, within the smallest of the ranks' budgets (per device).
    search = (ShardedBatchSearch(make_step, model, optimizer, config, min(channel.gather(budget_bytes)), *args,
                                 channel=channel) if sharded else
              BatchSearch(make_step, model, optimizer, config, budget_bytes, *args))
    search.verbose = verbose
    budget_bytes = search.budget_bytes
    fit = search.fit_profiles(max_val)
    found = search.largest(True, max_val)
    if found == 0:
        raise too_small_at_one(fit, budget_bytes, max_overhead, search.cost)
    measured: int | None = None
    if confirm:
        confirmed, measured = search.confirm(max_val, max_trials)
    else:
        confirmed = found
        search.notes.append("not confirmed by real steps (confirm=False): the batch size is a prediction")
    without = search.largest_without_remat(confirmed, confirm_without_remat, max_trials)

    # Margin, and the plan for the final batch (the confirmed one's if a monotone model ever says no).
    final = max(1, int(math.floor(confirmed * (1 - margin))))
    final_plan = search.plan_for(final, True) or search.plan_for(confirmed, True)
    assert final_plan is not None
    final_plan = bound(final_plan, model)
    if sharded:
        # Sharded: every rank decided on the same figures; rank 0's decision is the one kept.
        final, without, confirmed, measured, plan_dict = channel.broadcast(
            (final, without, confirmed, measured, final_plan.to_dict()))
        final_plan = Plan.from_dict(plan_dict)
    apply_or_restore(model, final_plan, apply, previous)
    return BatchSizeResult(
        batch_size=final, batch_size_without_remat=without, largest_fitting=confirmed, plan=final_plan,
        budget_bytes=budget_bytes, measured_peak_bytes=measured, max_overhead=float(max_overhead),
        margin=float(margin), steps_per_trial=steps_per_trial, trials=search.trials,
        trial_steps=sum(t.steps for t in search.trials), profile_batch_sizes=fit.batch_sizes,
        profile_passes=search.passes, profile_samples=search.samples,
        notes=search.notes + [f"static memory {format_bytes(fit.static_bytes)} (parameters, gradients, optimizer state)"],
    )
