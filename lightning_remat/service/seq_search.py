"""The search behind ``find_remat_seq_len``: ``BatchSearch`` over sequence lengths, its answer resting on profiles
(each profile a new node of the parabola fit, ``core.shape_fit.LengthFit``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.binding import Binding
from ..core.budget import format_bytes
from ..core.config import RematConfig
from ..core.errors import BudgetTooSmallError
from ..core.shape_fit import LengthFit
from ..core.memory_model import Profile
from ..runtime.installing.tiled_mlp import TILE, parse
from .batch_search import BatchSearch, MakeStep


@dataclass(frozen=True)
class LengthRow:
    """One length: whether a plan fits (within ``max_overhead``), the least peak any plan reaches there and what
    binds it (``Binding.to_dict()``), the fitting plan's peak and overhead (None where none fits); ``profiled``
    False where the figures are the fit's prediction (``max_profiles`` reached)."""

    seq_len: int
    fits: bool
    least_peak_bytes: int
    binds: dict[str, Any] | None
    peak_bytes: int | None = None
    overhead: float | None = None
    profiled: bool = True

    @property
    def binds_text(self) -> str:
        """What binds in a few words: ``"stage layers.30 (own)"``, ``"head and loss (own)"``."""
        if not self.binds:
            return "-"
        binding = Binding.from_dict(self.binds)
        what = binding.name if binding.term == "stage" else binding.term
        return f"{what} ({binding.largest})"


class LengthSearch(BatchSearch):
    """``BatchSearch`` where what grows is the sequence: the fit is a ``LengthFit`` and the lengths found are
    profiled (the profile is the truth; with ``confirm`` on a real model a trial measures the answer too)."""

    def __init__(self, make_step: MakeStep, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 config: RematConfig, budget_bytes: int, max_overhead: float, steps_per_trial: int, start: int,
                 multiple_of: int, max_seq_len: int, max_profiles: int):
        super().__init__(make_step, model, optimizer, config, budget_bytes, max_overhead, steps_per_trial,
                         "binsearch", start)
        self.unit = multiple_of
        self.max_seq_len = max_seq_len
        self.max_profiles = max_profiles
        self.verdicts: dict[int, bool] = {}  # profiled (or trialled) length -> whether a plan fits there
        self.rows: dict[int, LengthRow] = {}
        self.measured_peak_bytes: int | None = None

    # 1. Profiles: each a node of the fit and a verdict.
    def profile_length(self, length: int) -> bool:
        """Profile ``length`` (a real out-of-memory error: it does not fit); whether a plan fits there."""
        profile = self._profile_at(length, warmup=1 if self.fit is None else 0)
        if profile is None:
            self.notes.append(f"sequence length {length} ran out of memory on the device while profiling")
            self.verdicts[length] = False
            return False
        if self.fit is None:
            self._check_static(profile)
            if any(parse(v)[1] == 2 for s in profile.stages for o in s.options for k, v in o.action.extra if k == TILE):
                # Measured on Llama-3-8B: from 8K-32K tokens, 128K predicted 5.25 GiB high; from 16K-64K, exact.
                self.notes.append(f"at {length} tokens the tiled MLPs run in 2 chunks, whose peak falls at another "
                                  "moment than at 4 or more: predictions from it err high; start at 4 x the hidden size")
        elif len(self.fit.nodes) == 1:
            self._check_it_grows(next(iter(self.fit.nodes.items())), (length, profile))
        self.fit = LengthFit({length: profile}) if self.fit is None else self.fit.with_node(length, profile)
        self.plans.clear()  # predictions change with every node
        self.verdicts[length] = self._row(length, profile).fits
        return self.verdicts[length]

    def _row(self, length: int, profile: Profile, profiled: bool = True) -> LengthRow:
        plan = self.plan_for(length, True)
        least = self._solve(profile, "min")  # within the host's memory where it offloads
        self.rows[length] = LengthRow(length, plan is not None, least.predicted_peak_bytes, least.binding,
                                      plan.predicted_peak_bytes if plan else None,
                                      plan.predicted_overhead if plan else None, profiled)
        return self.rows[length]

    @property
    def profiles(self) -> int:
        return sum(r.profiled for r in self.rows.values())

    def _check_static(self, profile: Profile) -> None:
        if self.budget_bytes < profile.static_bytes:
            raise BudgetTooSmallError(self.budget_bytes, self._solve(profile, "min").predicted_peak_bytes,
                                      profile.static_bytes, message=(
                f"The budget of {format_bytes(self.budget_bytes)} ({self.budget_bytes} bytes) is below the static "
                f"memory of the step, {format_bytes(profile.static_bytes)} (parameters, gradients and optimizer "
                "state), which no sequence length changes: no length fits. Raise the budget above it."))

    def _check_it_grows(self, first: tuple[int, Profile], second: tuple[int, Profile]) -> None:
        (low, a), (high, b) = sorted([first, second], key=lambda item: item[0])
        if a.baseline_peak_bytes == b.baseline_peak_bytes and a.baseline_costs.flops == b.baseline_costs.flops:
            raise ValueError(
                f"make_step(seq_len) ignores the length: the steps at {low} and {high} tokens have the same peak "
                f"({format_bytes(a.baseline_peak_bytes)}) and FLOPs. It must return a step on a batch of that many "
                "tokens per sequence, as make_step(batch_size) does for find_remat_batch_size.")

    # 2. The search: predictions steer, profiles decide.
    def longest_predicted(self) -> int:
        """The longest multiple of ``unit`` predicted to fit, below the shortest length profiled not to fit."""
        failing = min((n for n, fits in self.verdicts.items() if not fits), default=self.max_seq_len + self.unit)
        limit = min(self.max_seq_len, failing - self.unit)
        if limit < self.unit:
            return 0
        fitting = max((n for n, fits in self.verdicts.items() if fits and n <= limit), default=0)
        return max(fitting, self.largest(True, limit))

    def settle(self) -> int:
        """The longest length profiled to fit whose next multiple is profiled not to (or is past the limit)."""
        while True:
            answer = self.longest_predicted()
            check = answer if answer and answer not in self.verdicts else answer + self.unit
            if answer == 0 and self.unit in self.verdicts or check > self.max_seq_len or check in self.verdicts:
                return answer
            if self.profiles >= self.max_profiles:
                return self._predicted(answer)
            self.profile_length(check)

    def _predicted(self, answer: int) -> int:
        """``answer`` as the fit predicts it, with rows predicted at it and at the next multiple (where not profiled).

        Exact where every term is a polynomial of degree two at most in the length and the three nodes nearest
        were profiled with chunks of the same size (``core.shape_fit.LengthFit``)."""
        assert self.fit is not None
        for length in (answer, answer + self.unit):
            if self.unit <= length <= self.max_seq_len and length not in self.rows:
                self._row(length, self.fit.at(length), profiled=False)
        made = ", ".join(str(n) for n in self.fit.nodes)
        self.notes[:] = [n for n in self.notes if not n.startswith("max_profiles=")]
        self.notes.append(f"max_profiles={self.max_profiles} reached: the answer and the length after it are predicted "
                          f"from the profiles at {made}")
        return answer

    def search(self, confirm: bool, max_trials: int) -> int:
        """Profile ``start``, twice and four times it, settle, and (real models, ``confirm``) measure the answer."""
        top = self.max_seq_len // self.unit * self.unit  # every length profiled is a multiple of ``unit``
        for length in list(dict.fromkeys(min(top, self.start * k) for k in (1, 2, 4)))[:self.max_profiles]:
            self.profile_length(length)
        while True:
            answer = self.settle()
            if answer == 0 or not confirm or self.config.profile.fake:
                return answer
            if len(self.trials) >= max_trials:
                self.notes.append(f"max_trials={max_trials} reached: sequence length {answer} is not confirmed")
                return answer
            plan = self.plan_for(answer, True)
            assert plan is not None
            trial = self.run_trial(answer, plan)
            self.trials.append(trial)
            if trial.fits:
                self.measured_peak_bytes = trial.measured_peak_bytes
                return answer
            measured = "out of memory" if trial.out_of_memory else format_bytes(trial.measured_peak_bytes or 0)
            self.notes.append(f"sequence length {answer} measured {measured} against its predicted "
                              f"{format_bytes(plan.predicted_peak_bytes)}: searched below it")
            self.verdicts[answer] = False

    def knobs_at(self, length: int) -> list[dict[str, Any]]:
        """The knobs (``service.knobs``) at a profiled ``length``: each re-profiles the step, so only on request."""
        from .knobs import KnobContext, knob_figures
        from .planning import Planner

        assert self.fit is not None and length in self.fit.nodes
        context = KnobContext(Planner(self.config, verbose=False), self.model, self.step_at(length), self.optimizer,
                              self.fit.nodes[length], self.budget_bytes)
        return knob_figures(context)

    def too_short(self) -> BudgetTooSmallError:
        """Nothing fits even at ``multiple_of`` tokens: the error naming the least peak there."""
        row = self.rows.get(self.unit) or min(self.rows.values(), key=lambda r: r.seq_len)
        overhead = "" if math.isinf(self.max_overhead) else f" within max_overhead={self.max_overhead:.0%}"
        binds = Binding.from_dict(row.binds).text() if row.binds else ""
        return BudgetTooSmallError(self.budget_bytes, row.least_peak_bytes, self.fit.static_bytes if self.fit else 0,
                                   message=(
            f"No sequence length fits the budget of {format_bytes(self.budget_bytes)} ({self.budget_bytes} bytes)"
            f"{overhead}: at {row.seq_len} tokens the least peak any plan reaches is "
            f"{format_bytes(row.least_peak_bytes)} ({binds}). Raise the budget or lower multiple_of."))

