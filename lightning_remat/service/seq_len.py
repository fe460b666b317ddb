"""The longest sequence that fits a memory budget with optimal recomputation, offload and chunking
(``docs/seq_len.md``): ``find_remat_batch_size``'s search, growing the sequence instead of the batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch
from torch import nn

from ..core.binding import Binding
from ..core.config import check_int
from ..core.budget import format_budget, format_bytes
from ..core.config import DEFAULT_COST, ProfileOptions, RematConfig
from ..core.plan import Plan
from ..runtime.installing.fingerprint import bound
from ..runtime.measuring.exclusive import exclusive
from .batch_size import apply_or_restore, search_setup
from .seq_search import LengthRow, LengthSearch

DEFAULT_MAX_SEQ_LEN = 2**20  # a million tokens
MAX_SEQ_LEN = 2**30  # far beyond any real search, so that a typo fails at once


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
