"""A case of the harness (model x integration x batch shapes x budget), its runs, and the invariants.

``run_case(case)``:

1. builds the case's batches (``zoo``) and runs them through its integration without the package:
   the reference (per-step peaks, losses, the user hook's calls);
2. draws the budget between the least peak and the plain peak: the least peak is the package's own
   ``plan_remat(..., "min")`` predicted peak at the batch whose plain step peaked highest, the plain
   peak the largest step peak of the reference; ``budget = low + fraction * (high - low)``;
3. runs the same batches through the integration with that budget, and checks every step:

- ``budget``: the step's peak (allocation events, the package's work in the step included) is within
  the budget; a step cut short by an error is measured up to it, so an error raised before the step
  runs costs nothing and one raised after the budget broke does not hide it;
- ``installed``: what is installed is what the plan in effect says (records and behaviour), after
  the backward and after the step;
- ``loss``: the step's loss equals the reference's (relative 1e-5);
- ``hooks``: a user's forward hook on the model saw as many calls as in the reference (profiling and
  fake passes are invisible to user code);
- ``refusal``: an error of the package's (``RematError``) is justified: the same step without the
  package did not fit the budget, and the budget is below the least peak ``plan_remat(..., "min")``
  predicts at the batch it stopped on (1% margin);
- ``crash``: any other exception, or a run that stopped early without one.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_remat import RematError, plan_remat
from lightning_remat.core.budget import format_bytes

from .runners import RUNNERS, trained
from .recorder import RunRecord
from .zoo import ZOO, ModelSpec

INVARIANTS = ("budget", "installed", "loss", "hooks", "refusal", "crash")
LOSS_TOLERANCE = 1e-5
REFUSAL_MARGIN = 0.01


def integrations_for(model: str) -> tuple[str, ...]:
    """The integrations a model runs under (the Hugging Face Trainer: the language models only)."""
    return tuple(name for name in RUNNERS if name != "hf_trainer" or model in ("token", "gpt2"))


# The CI's pairs: every model but the transformers GPT-2 (the long run's) under each of its integrations.
PAIRS = tuple((model, integration) for model in ZOO if model != "gpt2" for integration in integrations_for(model))


@dataclass(frozen=True)
class Case:
    """One generated case: what is run, at which budget (``fraction`` of the way from the least peak
    to the plain peak), on which shapes (``zoo.ModelSpec.fields``), from which seed."""

    model: str
    integration: str
    shapes: tuple[tuple[int, ...], ...]
    fraction: float
    seed: int = 0
    variant: str = ""
    snap: bool = False  # the budget lowered to the predicted peak of the plan made for it (no slack)

    def describe(self) -> str:
        spec = ZOO[self.model]
        shapes = ", ".join(spec.describe(shape) for shape in self.shapes)
        variant = f"[{self.variant}]" if self.variant else ""
        snap = " snapped to its plan's prediction" if self.snap else ""
        return (f"{self.model} x {self.integration}{variant}, budget at {self.fraction:.2f} of least..plain{snap}, "
                f"seed {self.seed}, {len(self.shapes)} steps: {shapes}")


@dataclass(frozen=True)
class Violation:
    invariant: str
    step: int | None
    detail: str

    def __str__(self) -> str:
        where = "" if self.step is None else f"step {self.step}: "
        return f"[{self.invariant}] {where}{self.detail}"


@dataclass
class Outcome:
    """A case's runs and what they broke."""

    case: Case
    budget: int = 0
    least: int = 0
    plain: int = 0
    reference: RunRecord | None = None
    run: RunRecord | None = None
    violations: list[Violation] = field(default_factory=list)
    seconds: float = 0.0
    harness_error: str = ""  # the run without the package failed: the case says nothing of the package
    warnings: list[str] = field(default_factory=list)  # the package's warnings during the run with it

    @property
    def silent(self) -> bool:
        """The budget broke and the package warned of nothing."""
        return "budget" in self.broken and not self.warnings

    @property
    def broken(self) -> list[str]:
        return sorted({v.invariant for v in self.violations}, key=INVARIANTS.index)

    def worst_ratio(self) -> float:
        peaks = [s.peak for s in (self.run.steps if self.run else []) if s.peak is not None]
        return max(peaks, default=0) / self.budget if self.budget else 0.0

    def report(self) -> str:
        lines = [self.case.describe(),
                 f"  budget {format_bytes(self.budget)} (least {format_bytes(self.least)}, plain "
                 f"{format_bytes(self.plain)}), worst step {self.worst_ratio():.3f}x the budget, {self.seconds:.1f} s"]
        if "budget" in self.broken:
            lines.append("  the package warned: " + (self.warnings[0][:200] if self.warnings else "nothing"))
        lines += [f"  {v}" for v in self.violations[:12]]
        if len(self.violations) > 12:
            lines.append(f"  ... {len(self.violations) - 12} more")
        return "\n".join(lines)


def least_peak(case: Case, batch: Any, budget: int | str = "min") -> int:
    """The least peak the package's own planner predicts for one step on ``batch`` (``budget="min"``;
    else the predicted peak of its plan for ``budget``), on the model and optimizer(s) the case's
    integration trains."""
    spec = ZOO[case.model]
    model, optimizer, options = trained(case.integration, case.variant, spec, case.seed)
    plan = plan_remat(model, lambda m: spec.loss(m, batch), budget, optimizer=optimizer,
                      candidates=spec.candidates_under(""), cost="flops", verbose=False, **options)
    return int(plan.predicted_peak_bytes)


def batches_of(case: Case) -> list[Any]:
    spec = ZOO[case.model]
    return [spec.batch(shape, case.seed, step) for step, shape in enumerate(case.shapes)]


def run_case(case: Case) -> Outcome:
    """Run ``case`` without and with the package and check the invariants over every step."""
    start = time.perf_counter()
    spec, runner, batches = ZOO[case.model], RUNNERS[case.integration], batches_of(case)
    outcome = Outcome(case)
    outcome.reference = reference = runner(spec, batches, None, case.seed, case.variant)
    if reference.error is not None:  # the harness's own failure, not the package's
        raise RuntimeError(f"the run without the package failed: {case.describe()}") from reference.error
    peaks = [step.peak for step in reference.steps]
    if not peaks:  # fewer batches than one accumulation window
        outcome.harness_error = "no optimizer step in the run without the package"
        return outcome
    hardest = max(range(len(peaks)), key=peaks.__getitem__)
    outcome.plain = peaks[hardest]
    try:
        outcome.least = least_peak(case, batches[hardest])
    except Exception as error:  # noqa: BLE001 - the planner failing is a finding
        outcome.violations.append(Violation("crash", None, f"plan_remat(budget='min') failed: {error!r}"[:300]))
        outcome.seconds = time.perf_counter() - start
        return outcome
    low, high = sorted((outcome.least, outcome.plain))
    outcome.budget = int(low + case.fraction * (high - low))
    if case.snap and outcome.budget >= outcome.least:  # no slack: a plan predicted low breaks the budget
        outcome.budget = least_peak(case, batches[hardest], outcome.budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome.run = runner(spec, batches, outcome.budget, case.seed, case.variant)
    # What the package said (a step over the budget should be named, with its cause, not pass silently).
    outcome.warnings = [str(w.message) for w in caught if "lightning_remat" in str(w.filename)
                        or str(w.message).startswith(("lightning-remat", "AutoRemat", "RematTrainerCallback"))]
    outcome.violations = check(case, outcome.budget, reference, outcome.run, batches)
    outcome.seconds = time.perf_counter() - start
    return outcome


def check(case: Case, budget: int, reference: RunRecord, run: RunRecord, batches: list[Any]) -> list[Violation]:
    """Every invariant over every step of ``run`` (against ``reference``, the run without the package)."""
    found = []
    for i, step in enumerate(run.steps):
        if step.peak is not None and step.peak > budget:
            found.append(Violation("budget", i, f"peak {format_bytes(step.peak)} = {step.peak / budget:.3f}x the "
                                   f"budget ({'cut short by the error' if not step.completed else 'whole step'})"))
        found += [Violation("installed", i, text) for text in step.mismatches]
        if not step.completed:
            continue
        expected = reference.steps[i]
        if not math.isclose(step.loss, expected.loss, rel_tol=LOSS_TOLERANCE, abs_tol=1e-7):
            found.append(Violation("loss", i, f"loss {step.loss!r}, without the package {expected.loss!r}"))
        if step.hook_calls != expected.hook_calls:
            found.append(Violation("hooks", i, f"a user hook on the model ran {step.hook_calls} time(s), "
                                   f"without the package {expected.hook_calls}"))
    found += _error_findings(case, budget, run, reference, batches)
    return found


def _refused_wrongly(case: Case, budget: int, step: int, reference: RunRecord, batches: list[Any]) -> str:
    """Why a ``RematError`` at optimizer step ``step`` was not justified ("" when it was): the step
    without the package fit the budget, or the budget is above the least peak the package's own
    planner predicts for its batches."""
    if step < len(reference.steps) and reference.steps[step].peak <= budget:
        return f"the same step without the package peaked at {format_bytes(reference.steps[step].peak)}"
    # The micro-batches of the optimizer step it stopped at: the largest of their least peaks.
    per_step = max(1, len(batches) // max(1, len(reference.steps)))
    window = batches[step * per_step:(step + 1) * per_step] or batches[-1:]
    least = max(least_peak(case, batch) for batch in window)
    if budget >= least * (1 + REFUSAL_MARGIN):
        return f"the least peak at this batch is {format_bytes(least)}, the budget {budget / least:.3f}x that"
    return ""


def _error_findings(case: Case, budget: int, run: RunRecord, reference: RunRecord,
                    batches: list[Any]) -> list[Violation]:
    error, step = run.error, run.error_step
    if error is None:
        done, expected = len([s for s in run.steps if s.completed]), len(reference.steps)
        return [] if done == expected else [Violation("crash", done, f"the run stopped after {done} of {expected} steps")]
    text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:300]
    if not isinstance(error, RematError):
        return [Violation("crash", step, text)]
    why = _refused_wrongly(case, budget, step, reference, batches)
    return [Violation("refusal", step, f"{text} ({why})")] if why else []
