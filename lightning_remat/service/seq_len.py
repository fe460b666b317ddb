"""The longest sequence that fits a memory budget with optimal recomputation, offload and chunking
(``docs/seq_len.md``): ``find_remat_batch_size``'s search (``BatchSearch``) growing the sequence instead of the batch,
its answer resting on profiles (each a new node of the parabola fit, ``core.shape_fit.LengthFit``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch
from torch import nn

from ..core.binding import Binding
from ..core.budget import format_budget, format_bytes
from ..core.config import DEFAULT_COST, ProfileOptions, RematConfig, check_int
from ..core.errors import BudgetTooSmallError
from ..core.memory_model import Profile
from ..core.plan import Plan
from ..core.shape_fit import LengthFit
from ..runtime.installing.fingerprint import bound
from ..runtime.installing.tiled_mlp import TILE, parse
from ..runtime.measuring.exclusive import exclusive
from .batch_search import BatchSearch, MakeStep
from .batch_size import apply_or_restore, search_setup
from .planning import Planner

DEFAULT_MAX_SEQ_LEN = 2**20  # a million tokens
MAX_SEQ_LEN = 2**30  # far beyond any real search, so that a typo fails at once


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


@dataclass
class SeqLenResult:
    """What ``find_remat_seq_len`` found: the longest length, its plan, what binds there and at the first length
    that does not fit, and every length profiled or predicted (``tried``, in order of length; ``profiled`` says which).

    Example:
        >>> plan = Plan([], 10**6, 2 * 10**6, 9 * 10**5, 0.2)
        >>> result = SeqLenResult(1024, plan, 10**6, first_failing=1088)
        >>> result.seq_len, result.first_failing, result.predicted_overhead
        (1024, 1088, 0.2)
    """

    seq_len: int
    plan: Plan
    budget_bytes: int
    first_failing: int | None = None
    multiple_of: int = 64
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    tried: list[LengthRow] = field(default_factory=list)
    measured_peak_bytes: int | None = None
    failing_knobs: list[dict[str, Any]] = field(default_factory=list)
    profiles: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def row(self, length: int | None) -> LengthRow | None:
        """The row at ``length`` (None where it was neither profiled nor predicted)."""
        return next((r for r in self.tried if r.seq_len == length), None)

    @property
    def predicted_overhead(self) -> float:
        """Recompute cost of the plan as a share of a step without recomputation."""
        return self.plan.predicted_overhead

    @property
    def binding(self) -> dict[str, Any] | None:
        """What binds the least peak at the answer (``Binding.to_dict()``)."""
        row = self.row(self.seq_len)
        return row.binds if row else self.plan.binding

    @property
    def failing_binding(self) -> dict[str, Any] | None:
        """What binds the least peak at the first length that does not fit (None at ``max_seq_len``)."""
        row = self.row(self.first_failing)
        return row.binds if row else None

    def __repr__(self) -> str:
        failing = self.row(self.first_failing)
        return (f"SeqLenResult(seq_len={self.seq_len}, predicted_peak={format_bytes(self.plan.predicted_peak_bytes)}, "
                f"budget={format_budget(self.plan.requested_budget, self.budget_bytes)}, first_failing="
                f"{self.first_failing}" + (f" (least peak {format_bytes(failing.least_peak_bytes)})" if failing else "")
                + f", predicted_overhead={self.predicted_overhead:.1%})")

    def summary(self) -> str:
        """The answer, what binds at it and past it, and a table of the lengths profiled, as plain text."""
        lines = [f"longest sequence: {self.seq_len} tokens (multiple of {self.multiple_of}, at most {self.max_seq_len}) "
                 f"within {format_budget(self.plan.requested_budget, self.budget_bytes)}: predicted peak "
                 f"{format_bytes(self.plan.predicted_peak_bytes)}, overhead {self.predicted_overhead:.1%}"
                 + (f", measured peak {format_bytes(self.measured_peak_bytes)}" if self.measured_peak_bytes else "")]
        for label, length in (("at", self.seq_len), ("past it, at", self.first_failing)):
            row = self.row(length)
            if row is not None and row.binds:
                lines.append(f"{label} {length} tokens (least peak {format_bytes(row.least_peak_bytes)}) "
                             + Binding.from_dict(row.binds).text())
        for knob in self.failing_knobs:
            peak = "not predicted" if knob["peak_bytes"] is None else format_bytes(knob["peak_bytes"])
            lines.append(f"  at {self.first_failing} tokens, {knob['knob']} ({knob['setting']}) reaches {peak}"
                         + (", within the budget" if knob["fits"] else ""))
        if self.first_failing is None:
            lines.append(f"max_seq_len={self.max_seq_len} reached: longer lengths were not searched")
        head = ("tokens", "fits", "least peak", "plan peak", "overhead", "what binds (least peak)")
        table = [(str(r.seq_len) + ("" if r.profiled else "*"), "yes" if r.fits else "no", format_bytes(r.least_peak_bytes),
                  format_bytes(r.peak_bytes) if r.peak_bytes is not None else "-",
                  f"{r.overhead:.1%}" if r.overhead is not None else "-", r.binds_text) for r in self.tried]
        widths = [max(len(x) for x in column) for column in zip(head, *table)]
        lines += ["  ".join(x.rjust(w) if i < 5 else x for i, (x, w) in enumerate(zip(line, widths))).rstrip()
                  for line in (head, *table)]
        if not all(r.profiled for r in self.tried):
            lines.append("* predicted from the profiled lengths, not profiled")
        lines.append(f"{self.profiles} profiles in {self.seconds:.1f} s" + "".join(f"; {n}" for n in self.notes))
        return "\n".join(lines)


_PROFILE_FIELDS = {f.name for f in fields(ProfileOptions)}


def _checked(init_val: int | None, multiple_of: int, max_seq_len: int, max_overhead: float | None,
             max_profiles: int, options: dict[str, Any]) -> tuple[int, float]:
    """The first length (a multiple of ``multiple_of``) and the overhead limit; ValueError/TypeError for bad input."""
    unknown = sorted(set(options) - _PROFILE_FIELDS)
    if unknown:
        raise TypeError(f"find_remat_seq_len() got unknown option(s) {unknown}: the options are ProfileOptions' fields "
                        f"({', '.join(sorted(_PROFILE_FIELDS))})")
    check_int("multiple_of", multiple_of, 1, MAX_SEQ_LEN, " (the lengths searched are its multiples)")
    check_int("max_seq_len", max_seq_len, multiple_of, MAX_SEQ_LEN, " (at least multiple_of)")
    # Three lengths at least: a line through two would under-predict attention that grows with the square.
    check_int("max_profiles", max_profiles, 3, 1000, " (the parabola of the fit needs three profiled lengths)")
    start = min(16 * multiple_of, max_seq_len) if init_val is None else init_val
    check_int("init_val", start, 1, max_seq_len, " (the first length profiled, at most max_seq_len)")
    if max_overhead is not None and (isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float))
                                     or not max_overhead >= 0):
        raise ValueError(f"max_overhead must be None or a number >= 0 (a share of the step's cost), got {max_overhead!r}")
    return max(multiple_of, start // multiple_of * multiple_of), math.inf if max_overhead is None else float(max_overhead)


@exclusive()
def find_remat_seq_len(model: nn.Module, make_step: Callable[[int], Any], budget: int | str, *,
                       optimizer: torch.optim.Optimizer | None = None, init_val: int | None = None,
                       max_seq_len: int = DEFAULT_MAX_SEQ_LEN, multiple_of: int = 64, max_overhead: float | None = None,
                       cost: str = DEFAULT_COST, confirm: bool = True, steps_per_trial: int = 1, max_trials: int = 5,
                       max_profiles: int = 12, advice: bool = False, apply: bool = True, verbose: bool = True,
                       **options: Any) -> SeqLenResult:
    """The longest sequence (tokens per sequence, a multiple of ``multiple_of``) whose step fits ``budget``.

    Three lengths are profiled, every memory term predicted at any length (a parabola in the length), the longest
    length predicted to fit searched as ``find_remat_batch_size`` searches the batch, and the lengths the answer
    rests on profiled until one fits and the next does not; on a real model ``confirm`` measures the answer with a
    real step. See ``docs/seq_len.md``.

    Args:
        make_step: ``make_step(seq_len)`` returns ``step(model) -> loss`` on a batch of that many tokens per sequence.
        budget: the peak memory of a training step: "80GB", "80 GiB", bytes, "80%" of the device.
        init_val: the first length profiled (default ``16 * multiple_of``); then twice and four times it.
        max_profiles: profiles at most (3 or more); once reached, the answer and the length after it are the fit's
            predictions (``LengthRow.profiled`` False): ``max_profiles=3`` answers from the first three lengths.
        max_overhead: the largest recompute cost accepted (a share of a step); None: any plan that fits.
        advice: evaluate the knobs (``BudgetTooSmallError.knobs``) at the first length that does not fit; each
            re-profiles the step (minutes for an 8B model on fake tensors), so none is evaluated by default.
        options: ``ProfileOptions`` fields, as ``plan_remat`` takes them: ``fake=True, gpu="h100",
            precision="bf16-true", offload=True, host_memory="1TB", chunk_loss=True, world_size=8``, ...

    Raises:
        BudgetTooSmallError: the budget is below static memory, or no length fits (the least peak is named).

    Example:
        >>> net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        >>> make_step = lambda n: (lambda m, x=torch.randn(n, 16): m(x).square().mean())
        >>> result = find_remat_seq_len(net, make_step, 300_000, multiple_of=16, max_seq_len=4096, verbose=False)
        >>> result.measured_peak_bytes <= 300_000 < result.row(result.first_failing).least_peak_bytes
        True
    """
    start, overhead = _checked(init_val, multiple_of, max_seq_len, max_overhead, max_profiles, options)
    config = RematConfig(budget, cost=cost, profile=ProfileOptions(**options))
    budget_bytes, previous = search_setup(model, config, "a sequence-length search")
    began = time.perf_counter()
    search = LengthSearch(make_step, model, optimizer, config, budget_bytes, overhead, steps_per_trial, start,
                          multiple_of, max_seq_len, max_profiles)
    search.verbose = verbose
    answer = search.search(confirm, max_trials)
    if answer == 0:
        apply_or_restore(model, None, False, previous)
        raise search.too_short()
    plan = search.plan_for(answer, True)
    assert plan is not None
    # The length after the answer, profiled (or predicted) not to fit; None at max_seq_len.
    failing = answer + multiple_of if answer + multiple_of <= max_seq_len else None
    knobs = search.knobs_at(failing) if advice and failing in search.rows else []
    plan = bound(plan, model)
    apply_or_restore(model, plan, apply, previous)
    return SeqLenResult(answer, plan, budget_bytes, failing, multiple_of, max_seq_len,
                        sorted(search.rows.values(), key=lambda r: r.seq_len), search.measured_peak_bytes, knobs,
                        search.profiles, time.perf_counter() - began, search.notes)
