"""The batch-size search on an FSDP2 model, every rank in lockstep; the result is rank 0's, the budget per rank."""

from __future__ import annotations

from typing import Any, Callable

from ..core.errors import PlanningFailedError
from ..core.memory_model import Profile
from ..core.plan import Plan
from ..runtime.measuring.measure import Step
from ..runtime.measuring.trial import Trial
from .batch_search import BatchSearch
from .channel import Channel
from .sharded import merge_profiles


def combine_trials(trials: list[Trial], budget: int) -> Trial:
    """One trial from every rank's: out of memory if any was, the largest peak.

    >>> t = combine_trials([Trial(4, (), 1, 10, False, True), Trial(4, (), 1, None, True, False)], budget=100)
    >>> t.out_of_memory, t.fits, t.measured_peak_bytes
    (True, False, None)
    """
    first = trials[0]
    oom = any(t.out_of_memory for t in trials)
    peaks = [t.measured_peak_bytes for t in trials]
    peak = None if any(p is None for p in peaks) else max(p for p in peaks if p is not None)
    fits = not oom and peak is not None and peak <= budget
    return Trial(first.batch_size, first.checkpointed, max(t.steps for t in trials), peak, oom, fits,
                 first.predicted_peak_bytes)


class ShardedBatchSearch(BatchSearch):
    """``BatchSearch`` run by every rank of an FSDP2 model in lockstep, talking through ``channel``."""

    def __init__(self, *args: Any, channel: Channel, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.channel = channel
        self.notes.append(f"searched on each of {self.channel.world_size} ranks in lockstep (the model is sharded "
                          "with FSDP2): the budget is per rank, profiles and trial peaks the largest over the ranks")

    def _all(self, compute: Callable[[], Any], action: str) -> list:
        """``compute()`` on every rank, gathered; an error (or an out-of-memory value) on any rank raised on all."""
        return self.channel.on_every_rank(compute, action=action, ended_early=_out_of_memory)

    def step_at(self, batch_size: int) -> Step:
        # make_step runs no collective: it runs on every rank and they compare notes before any pass,
        # so one rank's error is every rank's and the process group stays usable.
        made: list[Step] = []
        self._all(lambda: made.append(super(ShardedBatchSearch, self).step_at(batch_size)), "making the step")
        return made[0]

    def _profile_at(self, batch_size: int, warmup: int) -> Profile | None:
        profiles = self._all(lambda: super(ShardedBatchSearch, self)._profile_at(batch_size, warmup), "profiling")
        if any(p is None for p in profiles):  # out of memory on some rank: on all
            return None
        return merge_profiles(profiles)

    def run_trial(self, batch_size: int, plan: Plan) -> Trial:
        # The ranks computed their choice from the same figures; check before any collective runs.
        choice = (batch_size, tuple(plan.checkpointed), tuple(tuple(s) for s in plan.segments))
        choices = self.channel.gather(choice)
        if any(c != choices[0] for c in choices):
            raise PlanningFailedError(f"the ranks chose different trials (batch size, plan): {choices}; the "
                                      "batch-size search needs the same model and batch shapes on every rank")
        trials = self._all(lambda: super(ShardedBatchSearch, self).run_trial(batch_size, plan), "running a trial")
        return combine_trials(trials, self.budget_bytes)


def _out_of_memory(value: Any) -> bool:
    return value is None or bool(getattr(value, "out_of_memory", False))


def shared_budget(budget_bytes: int, channel: Channel) -> int:
    """The smallest of the ranks' budgets (a relative budget resolves per device)."""
    return min(channel.gather(budget_bytes))
