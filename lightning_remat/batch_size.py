"""Automatic batch-size scaling: the largest batch that fits a memory budget with optimal recomputation.

``find_remat_batch_size`` is the counterpart of Accelerate's ``find_executable_batch_size`` and of
Lightning's ``BatchSizeFinder``, with recomputation in the loop. Instead of trying batch after batch
until one runs out of memory, it

1. profiles a training step at two small batch sizes (``start`` and ``2 * start``). Every term of
   the memory model (stored bytes, local peaks, segment peaks, recompute FLOPs) is an affine function
   ``a + b * batch`` of the batch size: activations grow with the batch, static memory (parameters,
   gradients, optimizer state) does not. ``ProfileFit`` fits the line through the two profiles and
   gives a ``Profile`` for any batch size without running it;
2. searches, on these predictions only, the largest batch whose optimal plan (``solve``) fits the
   budget with ``predicted_overhead <= max_overhead``, and the largest batch that fits with nothing
   recomputed (the keep-only plan), for the comparison;
3. confirms the choice with ``steps_per_trial`` real steps with the plan applied (``measure_step``;
   the budget is for steady-state steps, so an optimizer that has no state yet first creates it with
   an optimizer step on zero gradients, which runs no forward or backward). A trial fails on a real out-of-memory error (recognised as Accelerate's
   ``should_reduce_batch_size`` does: CUDA, ROCm, XPU, MPS, CPU and HPU messages) or when the
   measured peak exceeds the budget; the search then steps down, with the prediction corrected by
   the measured error, and confirms again;
4. applies ``margin`` (``floor(batch * (1 - margin))``) and, by default, the plan for the final batch.

Trial steps are counted, and so is the cost of the search Lightning's ``BatchSizeFinder`` would
run in ``"binsearch"`` mode for the same range (``lightning_binsearch_sizes``): it doubles from
``init_val`` until a failure, then bisects, and every trial is ``steps_per_trial`` real steps.

Example:
    >>> import torch
    >>> from torch import nn
    >>> torch.manual_seed(0) is not None
    True
    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)])
    >>> def make_step(batch_size):
    ...     x = torch.randn(batch_size, 32)
    ...     return lambda model: model(x).square().mean()
    >>> result = find_remat_batch_size(make_step, net, 600_000, start=4, max_batch_size=256)
    >>> result.batch_size > result.batch_size_without_remat > 0
    True
    >>> result.measured_peak_bytes <= 600_000
    True
    >>> from lightning_remat import remove_remat
    >>> _ = remove_remat(net)
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .apply import apply_plan, applied, checkpointed_modules
from .budget import MIN_BUDGET, format_bytes, parse_budget
from .candidates import CandidateSpec
from .measure import is_out_of_memory, measure_step, model_device, preserved_training_state
from .memory_model import Profile, Segment, check_cost_kind, predict_peak
from .plan import Plan
from .profile import profile_step
from .solve import BudgetTooSmallError, least_peak, plan_from_choices, solve

Step = Callable[[nn.Module], torch.Tensor]
MakeStep = Callable[[int], Step]

SEARCH_MODES = ("binsearch", "power")
DEFAULT_MAX_BATCH_SIZE = 8192  # Lightning's BatchSizeFinder max_val


class BatchSizeTooSmallBudgetError(BudgetTooSmallError):
    """Even a batch of one does not fit the budget (or not within ``max_overhead``).

    ``smallest_peak_bytes`` is the least peak any plan reaches at batch size 1.

    Example:
        >>> err = BatchSizeTooSmallBudgetError(100, 150, 80, "the least peak at batch size 1 is too high")
        >>> isinstance(err, BudgetTooSmallError), err.smallest_peak_bytes
        (True, 150)
    """

    def __init__(self, budget_bytes: int, smallest_peak_bytes: int, static_bytes: int, message: str):
        self.budget_bytes = budget_bytes
        self.smallest_peak_bytes = smallest_peak_bytes
        self.static_bytes = static_bytes
        ValueError.__init__(self, message)


def _release_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "empty_cache"):
            backend.empty_cache()


# --------------------------------------------------------------------------------------------------
# Profiles at any batch size


def _line(low: float, high: float, low_bs: int, high_bs: int, batch_size: int) -> float:
    if high_bs == low_bs:
        return low
    return low + (high - low) * (batch_size - low_bs) / (high_bs - low_bs)


class ProfileFit:
    """Profiles measured at one or two batch sizes, extended to any batch size.

    Every term of the memory model is fitted as ``a + b * batch`` through the two profiles: stored
    bytes, local and segment peaks (whose static part, the same in both, stays as it is), recompute
    and step costs. Static memory is taken as measured. Options or segments that only one profile
    has are dropped (options) or scaled in proportion to the batch beyond static memory (segments).
    With a single profile every term beyond static memory is taken as proportional to the batch.

    Example:
        >>> from lightning_remat import StageOption, StageProfile
        >>> keep = lambda s, p: StageOption("keep", (), s, p, 0.0, 0)
        >>> whole = lambda s, p, f: StageOption("whole", ("a",), s, p, 0.0, f)
        >>> def profile(b):
        ...     stage = StageProfile("a", (keep(100 * b, 1000 + 150 * b), whole(10 * b, 1000 + 60 * b, 5 * b)))
        ...     return Profile((stage,), (Segment("head", 1, 1000 + 20 * b),), parameter_bytes=1000,
        ...                    baseline_step_flops=30 * b)
        >>> fit = ProfileFit([(2, profile(2)), (4, profile(4))])
        >>> fit.at(10).stages[0].options[1] == profile(10).stages[0].options[1]
        True
        >>> fit.at(10).baseline_peak_bytes, fit.at(10).static_bytes
        (2500, 1000)
    """

    def __init__(self, profiles: Sequence[tuple[int, Profile]]):
        if not 1 <= len(profiles) <= 2:
            raise ValueError(f"ProfileFit takes one or two (batch size, profile) pairs, got {len(profiles)}")
        ordered = sorted(profiles, key=lambda item: item[0])
        if any(bs < 1 for bs, _ in ordered):
            raise ValueError(f"batch sizes must be >= 1, got {[bs for bs, _ in ordered]}")
        if len(ordered) == 2 and ordered[0][0] == ordered[1][0]:
            ordered = ordered[:1]
        self.batch_sizes = tuple(bs for bs, _ in ordered)
        self.profiles = tuple(p for _, p in ordered)
        low = self.profiles[0]
        names = [s.name for s in low.stages]
        for other in self.profiles[1:]:
            if [s.name for s in other.stages] != names:
                raise ValueError("the profiles have different stages: "
                                 f"{names} vs {[s.name for s in other.stages]}")

    @property
    def static_bytes(self) -> int:
        """Parameters, gradients, optimizer state and buffers (the same at every batch size)."""
        return self.profiles[-1].static_bytes

    def _pair(self, low_value: float, high_value: float | None, batch_size: int, offset: float = 0.0) -> float:
        if high_value is None or len(self.batch_sizes) == 1:
            # Proportional beyond ``offset`` (static memory for peaks, zero for the rest).
            return offset + (low_value - offset) * batch_size / self.batch_sizes[0]
        return _line(low_value, high_value, self.batch_sizes[0], self.batch_sizes[-1], batch_size)

    def at(self, batch_size: int) -> Profile:
        """The profile predicted for ``batch_size``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        low = self.profiles[0]
        high = self.profiles[-1] if len(self.profiles) == 2 else None
        static = low.static_bytes
        b = batch_size

        def nbytes(value: float) -> int:
            return int(math.ceil(value))

        stages = []
        for i, stage in enumerate(low.stages):
            other = high.stages[i] if high is not None else None
            options = []
            for option in stage.options:
                match = None
                if other is not None:
                    match = next((o for o in other.options if o.name == option.name), None)
                    if match is None:
                        continue
                options.append(replace(
                    option,
                    stored_bytes=nbytes(self._pair(option.stored_bytes, match and match.stored_bytes, b)),
                    local_peak_bytes=nbytes(self._pair(option.local_peak_bytes, match and match.local_peak_bytes, b, static)),
                    cost_seconds=max(0.0, self._pair(option.cost_seconds, match and match.cost_seconds, b)),
                    cost_flops=max(0, round(self._pair(option.cost_flops, match and match.cost_flops, b))),
                ))
            stages.append(replace(
                stage,
                options=tuple(options),
                saved_bytes=max(0, nbytes(self._pair(stage.saved_bytes, other and other.saved_bytes, b))),
                input_bytes=max(0, nbytes(self._pair(stage.input_bytes, other and other.input_bytes, b))),
                output_bytes=max(0, nbytes(self._pair(stage.output_bytes, other and other.output_bytes, b))),
                forward_seconds=max(0.0, self._pair(stage.forward_seconds, other and other.forward_seconds, b)),
                forward_flops=max(0, round(self._pair(stage.forward_flops, other and other.forward_flops, b))),
            ))
        segments = []
        high_segments = {(s.name, s.stages_alive): s for s in high.segments} if high is not None else {}
        for segment in low.segments:
            match = high_segments.get((segment.name, segment.stages_alive))
            if high is not None and match is None:
                peak = static + (segment.peak_bytes - static) * b / self.batch_sizes[0]
            else:
                peak = self._pair(segment.peak_bytes, match and match.peak_bytes, b, static)
            segments.append(Segment(segment.name, segment.stages_alive, nbytes(peak)))
        low_keys = {(s.name, s.stages_alive) for s in low.segments}
        for key, segment in high_segments.items():
            if key not in low_keys:
                peak = static + (segment.peak_bytes - static) * b / self.batch_sizes[-1]
                segments.append(Segment(segment.name, segment.stages_alive, nbytes(peak)))
        profile = replace(
            low,
            stages=tuple(stages),
            segments=tuple(segments),
            baseline_step_seconds=max(0.0, self._pair(low.baseline_step_seconds, high and high.baseline_step_seconds, b)),
            baseline_step_flops=max(0, round(self._pair(low.baseline_step_flops, high and high.baseline_step_flops, b))),
            notes=tuple(dict.fromkeys([*low.notes, *(high.notes if high is not None else ())])),
        )
        profile.baseline_peak_bytes = predict_peak(profile, [0] * len(stages))
        return profile


# --------------------------------------------------------------------------------------------------
# Lightning's binsearch, for the comparison


def lightning_binsearch_sizes(init_val: int, largest_fitting: int, max_trials: int = 25,
                              max_val: int = DEFAULT_MAX_BATCH_SIZE) -> list[int]:
    """The batch sizes Lightning's ``BatchSizeFinder(mode="binsearch")`` tries, in order.

    A transcription of ``lightning.pytorch.tuner.batch_size_scaling._run_binsearch_scaling`` (Lightning
    2.6) where exactly the sizes up to ``largest_fitting`` succeed: it doubles from ``init_val`` until
    a size fails, then bisects between the last success and the failure. Every size tried is one
    trial of ``steps_per_trial`` real steps. (The dataset-length cap is left out.)

    Example:
        >>> lightning_binsearch_sizes(2, 40)
        [2, 4, 8, 16, 32, 64, 48, 40, 44, 42, 41]
        >>> len(lightning_binsearch_sizes(2, 40)) * 3  # steps with the default steps_per_trial=3
        33
    """
    if init_val < 1:
        raise ValueError(f"init_val must be >= 1, got {init_val}")
    low, high, count = 1, None, 0
    new_size = init_val
    tried: list[int] = []
    while True:
        if new_size >= max_val:
            break
        tried.append(new_size)
        if new_size <= largest_fitting:
            count += 1
            if count >= max_trials:
                break
            low = new_size
            if high:
                if high - low <= 1:
                    break
                next_size = (high + low) // 2
            else:
                next_size = int(new_size * 2.0)
            next_size = min(next_size, max_val)
            changed = next_size != new_size
            new_size = next_size
            if not changed:
                break
        else:
            high = new_size
            new_size = min((high + low) // 2, max_val)
            if high - low <= 1:
                break
    return tried


# --------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class Trial:
    """One real trial: ``steps`` training steps at ``batch_size`` with ``checkpointed`` modules recomputed.

    Example:
        >>> Trial(32, ("h.0",), 2, 1_000_000, False, True).fits
        True
    """

    batch_size: int
    checkpointed: tuple[str, ...]
    steps: int
    measured_peak_bytes: int | None
    out_of_memory: bool
    fits: bool
    predicted_peak_bytes: int = 0


@dataclass
class BatchSizeResult:
    """What ``find_remat_batch_size`` found and what the search cost.

    Attributes:
        batch_size: the batch to train with (after ``margin``).
        batch_size_without_remat: the largest batch that fits the budget with nothing recomputed
            (0 when none does); predicted, and confirmed by real steps when asked.
        largest_fitting: the largest batch that fits with recomputation, before ``margin``.
        plan: the least-cost recompute plan for ``batch_size`` under the budget.
        budget_bytes: the budget searched against.
        measured_peak_bytes: the peak of the last successful confirmation trial (at ``largest_fitting``),
            None when no trial was run.
        trials: every real trial, in order.
        trial_steps: real training steps run at candidate batch sizes (all trials).
        profile_batch_sizes: the batch sizes profiled; ``profile_passes`` forward/backward passes
            the profiler ran at them, ``profile_samples`` the samples those passes processed.
        binsearch_sizes: the sizes Lightning's binsearch would try for the same range (from
            ``start`` up to ``largest_fitting``), ``binsearch_trial_steps`` its real steps.

    Example:
        >>> plan = Plan(["h.0"], 10**6, 2 * 10**6, 9 * 10**5, 0.2)
        >>> r = BatchSizeResult(batch_size=32, batch_size_without_remat=8, largest_fitting=32, plan=plan,
        ...                     budget_bytes=10**6)
        >>> r.ratio, r.predicted_overhead
        (4.0, 0.2)
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
    binsearch_sizes: list[int] = field(default_factory=list)
    binsearch_trial_steps: int = 0
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

    @property
    def trial_samples(self) -> int:
        """Samples processed by the real trial steps."""
        return sum(t.batch_size * t.steps for t in self.trials)

    @property
    def binsearch_samples(self) -> int:
        """Samples Lightning's binsearch would process for the same range."""
        return sum(self.binsearch_sizes) * self.steps_per_trial

    def metrics(self) -> dict[str, float]:
        """The figures loggers receive, under ``remat/...``.

        Example:
            >>> plan = Plan([], 10, 10, 10, 0.0)
            >>> BatchSizeResult(4, 2, 4, plan, 10).metrics()["remat/batch_size_ratio"]
            2.0
        """
        return {
            "remat/batch_size": float(self.batch_size),
            "remat/batch_size_without_remat": float(self.batch_size_without_remat),
            "remat/batch_size_ratio": float(self.ratio),
            "remat/predicted_overhead": float(self.predicted_overhead),
        }

    def table(self) -> Any:
        """A ``rich.table.Table`` of the result and what the search cost.

        Example:
            >>> plan = Plan(["h.0"], 10**6, 2 * 10**6, 9 * 10**5, 0.2)
            >>> BatchSizeResult(32, 8, 32, plan, 10**6).table().row_count
            9
        """
        from rich.table import Table

        table = Table(title="Batch size with optimal recomputation", show_header=True)
        table.add_column("")
        table.add_column("value", justify="right")
        ratio = "inf" if math.isinf(self.ratio) else f"{self.ratio:.2f}x"
        measured = "-" if self.measured_peak_bytes is None else format_bytes(self.measured_peak_bytes)
        table.add_row("batch size (with recomputation)", str(self.batch_size))
        table.add_row("largest batch without recomputation", str(self.batch_size_without_remat))
        table.add_row("ratio", ratio)
        table.add_row("predicted overhead", f"{self.predicted_overhead:.1%} ({self.plan.cost_kind}; max {self.max_overhead:.0%})")
        table.add_row("modules recomputed", str(len(self.plan.checkpointed)))
        table.add_row("budget", format_bytes(self.budget_bytes))
        table.add_row("predicted peak / measured peak", f"{format_bytes(self.plan.predicted_peak_bytes)} / {measured}")
        table.add_row("real trial steps (Lightning binsearch)",
                      f"{self.trial_steps} ({self.binsearch_trial_steps} over {len(self.binsearch_sizes)} trials)")
        table.add_row("profiled batch sizes (passes)", f"{list(self.profile_batch_sizes)} ({self.profile_passes})")
        return table

    def summary(self) -> str:
        """The table as plain text.

        Example:
            >>> plan = Plan([], 10, 10, 10, 0.0)
            >>> "ratio" in BatchSizeResult(4, 2, 4, plan, 10).summary()
            True
        """
        from rich.console import Console

        console = Console(width=100, record=True, file=_NullFile(), color_system=None)
        console.print(self.table())
        return console.export_text()


class _NullFile:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


# --------------------------------------------------------------------------------------------------
# The search


def _validate(max_overhead: float, margin: float, steps_per_trial: int, start: int, max_batch_size: int,
              mode: str, max_trials: int) -> None:
    if not isinstance(max_overhead, (int, float)) or isinstance(max_overhead, bool) or not max_overhead >= 0:
        raise ValueError(f"max_overhead must be a number >= 0 (a share of the step's cost, 0.35 = 35%), got {max_overhead!r}")
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1) (the share the found batch size is reduced by), got {margin!r}")
    for name, value in (("steps_per_trial", steps_per_trial), ("start", start), ("max_batch_size", max_batch_size),
                        ("max_trials", max_trials)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if start > max_batch_size:
        raise ValueError(f"start ({start}) must not exceed max_batch_size ({max_batch_size})")
    if mode not in SEARCH_MODES:
        raise ValueError(f"mode must be one of {SEARCH_MODES}, got {mode!r}")


class _Counter:
    def __init__(self) -> None:
        self.passes = 0
        self.samples = 0

    def wrap(self, step: Step, batch_size: int) -> Step:
        def counted(model: nn.Module) -> torch.Tensor:
            self.passes += 1
            self.samples += batch_size
            return step(model)
        return counted


def _snapshot_to_cpu(value: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else copy.deepcopy(t), value)


class _RestoreAfterTrial:
    """Put back parameters, optimizer state, gradients, buffers and RNG after real trial steps.

    Copies are kept on the CPU so a trial on an accelerator does not hold a second copy there.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model = model
        self.optimizer = optimizer

    def __enter__(self) -> None:
        self.parameters = [(p, p.detach().to("cpu", copy=True)) for p in self.model.parameters()]
        self.optimizer_state = _snapshot_to_cpu(self.optimizer.state_dict()) if self.optimizer is not None else None
        self.preserved = preserved_training_state(self.model, self.optimizer)
        self.preserved.__enter__()

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for p, saved in self.parameters:
                p.copy_(saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self.optimizer_state)
            if not self.optimizer_state["state"]:
                self.optimizer.state.clear()
        self.preserved.__exit__(*exc)
        self.parameters = []
        self.optimizer_state = None


def _create_optimizer_state(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer) -> int:
    """Make ``optimizer`` create its state; returns the real training steps that took (0 or 1)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        return 0
    except TypeError:  # an optimizer that needs a closure (LBFGS): one real step instead
        measure_step(model, step, optimizer)
        return 1
    finally:
        for p in params:
            p.grad = None


def _run_trial(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None, batch_size: int,
               names: Sequence[str], steps_per_trial: int, budget: int, predicted: int) -> Trial:
    device = model_device(model)
    steps = 0
    peaks: list[int] = []
    oom = False
    try:
        with _RestoreAfterTrial(model, optimizer), applied(model, names):
            if optimizer is not None and not optimizer.state:
                # The budget is for steady-state steps, which hold the optimizer's state: create it
                # with an optimizer step on zero gradients (everything is put back afterwards).
                steps += _create_optimizer_state(model, step, optimizer)
            for _ in range(steps_per_trial):
                steps += 1
                peaks.append(measure_step(model, step, optimizer).peak_bytes)
    except Exception as exception:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
        if not is_out_of_memory(exception):
            raise
        oom = True
    finally:
        _release_memory(device)
    peak = max(peaks) if peaks else None
    fits = not oom and peak is not None and peak <= budget
    return Trial(batch_size, tuple(names), steps, peak, oom, fits, predicted)


def _largest(fits: Callable[[int], bool], start: int, high_limit: int, mode: str) -> int:
    """Largest batch in [1, high_limit] with ``fits`` (assumed monotone), 0 when even 1 does not fit.

    Searched on predictions only (no real step): doubling from ``start``, then bisection
    (``"binsearch"``), or the largest ``start * 2**k`` (``"power"``).
    """
    if high_limit < 1:
        return 0
    size = min(start, high_limit)
    if not fits(size):
        # Halve down to a size that fits, then (binsearch) bisect up to the failure.
        failed = size
        while size > 1:
            size //= 2
            if fits(size):
                break
        else:
            if not fits(1):
                return 0
            size = 1
        if mode == "power":
            return size
        low, high = size, failed
    else:
        low = size
        while True:
            nxt = min(low * 2, high_limit)
            if nxt == low:
                return low
            if not fits(nxt):
                high = nxt
                break
            low = nxt
        if mode == "power":
            return low
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


def find_remat_batch_size(
    make_step: MakeStep,
    model: nn.Module,
    budget: int | str,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    start: int = 2,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    max_overhead: float = 0.35,
    steps_per_trial: int = 1,
    margin: float = 0.0,
    cost: str = "flops",
    mode: str = "binsearch",
    max_trials: int = 25,
    candidates: CandidateSpec = None,
    confirm: bool = True,
    confirm_without_remat: bool = False,
    apply: bool = True,
) -> BatchSizeResult:
    """The largest batch size whose training step fits ``budget`` with optimal recomputation.

    Args:
        make_step: ``make_step(batch_size)`` returns a step closure ``step(model) -> loss`` on a batch
            of ``batch_size`` samples (as ``profile_step`` and ``measure_step`` take it). It is
            called once per batch size profiled or tried.
        model: the model, in training mode. Left with the plan for the result applied (``apply``).
        budget: the peak memory of a training step: "10GB", "10 GiB", bytes, "80%" of the device.
        optimizer: counted in the budget (its state and its step). Trial steps step it for real;
            parameters, optimizer state, gradients, buffers and RNG are put back afterwards.
        start: the first batch size, as Lightning's ``init_val``; the model is profiled at ``start``
            and ``2 * start``.
        max_batch_size: the largest batch size considered (Lightning's ``max_val``).
        max_overhead: the largest recompute cost accepted, as a share of the cost of a step
            without recomputation (0.35 = 35%); 0 means no recomputation.
        steps_per_trial: real steps per confirmation trial. An optimizer without state creates it
            first with one optimizer step on zero gradients (no forward or backward), since the
            budget is for steady-state steps.
        margin: the found batch is reduced to ``floor(batch * (1 - margin))``, at least 1.
        cost: ``"flops"`` (counted, deterministic) or ``"time"`` (measured) prices recomputation.
        mode: ``"binsearch"`` finds the largest batch; ``"power"`` the largest ``start * 2**k``.
        max_trials: the most confirmation trials run before giving up with the last size that passed
            (or the largest predicted one, noted, when none did).
        candidates: as ``find_stages``: None for automatic stages, or module classes / name patterns.
        confirm: run real trial steps at the chosen batch (recommended; without it the result is a
            prediction only).
        confirm_without_remat: confirm the batch without recomputation by real steps too.
        apply: apply the plan for the final batch to ``model``.

    Returns:
        A ``BatchSizeResult``: the batch size, the plan, the largest batch without recomputation,
        the measured peak and what the search cost in real steps next to Lightning's binsearch.

    Raises:
        ValueError: for a bad argument (max_overhead < 0, margin outside [0, 1), a budget of "min", ...).
        BatchSizeTooSmallBudgetError: (a ``BudgetTooSmallError``) even a batch of one does not fit the
            budget, or not within ``max_overhead``; it names the least peak at batch size 1.

    Example:
        >>> import torch
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)) for _ in range(3)])
        >>> make_step = lambda b: (lambda m, x=torch.randn(b, 16): m(x).square().mean())
        >>> find_remat_batch_size(make_step, net, 10**6, margin=1.5)
        Traceback (most recent call last):
        ...
        ValueError: margin must be in [0, 1) (the share the found batch size is reduced by), got 1.5
    """
    _validate(max_overhead, margin, steps_per_trial, start, max_batch_size, mode, max_trials)
    check_cost_kind(cost)
    device = model_device(model)
    parsed = parse_budget(budget, device=device)
    if parsed == MIN_BUDGET:
        raise ValueError('budget="min" has no meaning for a batch-size search: give a size such as "10GB", '
                         'a number of bytes or a percentage such as "80%"')
    budget_bytes = int(parsed)
    counter = _Counter()
    previous_plan = checkpointed_modules(model)
    notes: list[str] = []

    # 1. Profile at two small batch sizes (stepping down on a real out-of-memory error).
    def profile_at(batch_size: int, warmup: int) -> Profile | None:
        try:
            return profile_step(model, counter.wrap(make_step(batch_size), batch_size), optimizer=optimizer,
                                warmup=warmup, candidates=candidates)
        except Exception as exception:  # noqa: BLE001
            if not is_out_of_memory(exception):
                raise
            _release_memory(device)
            return None

    low_bs = start
    low = profile_at(low_bs, warmup=1)
    while low is None and low_bs > 1:
        low_bs //= 2
        low = profile_at(low_bs, warmup=1)
    if low is None:
        raise BatchSizeTooSmallBudgetError(
            budget_bytes, 0, 0, "a training step at batch size 1 ran out of memory while profiling; "
            "no batch size can be trained on this device")
    profiles = [(low_bs, low)]
    for second_bs in (min(2 * low_bs, max_batch_size), low_bs // 2):
        if second_bs < 1 or second_bs == low_bs:
            continue
        second = profile_at(second_bs, warmup=0)
        if second is not None:
            profiles.append((second_bs, second))
            break
    fit = ProfileFit(profiles)
    static = fit.static_bytes
    if cost == "flops" and _flops_unattributed(fit.profiles[-1]):
        # FLOPs are attributed to modules by their names as seen from the module ``step`` calls; when
        # the step calls a submodule (``self.net(x)`` in a LightningModule) no stage gets any, and
        # every plan would look free. Measured time still prices recomputation.
        cost = "time"
        notes.append("no FLOPs were attributed to the candidate modules (the step does not call the model "
                     "itself); recomputation is priced by measured time instead")

    # 2. Predictions: which batch sizes fit, with and without recomputation.
    # ``correction(b)`` is what the measurements taught: bytes the model under-predicts at batch b.
    # (batch size, measured - predicted) of failed trials, with and without recomputation.
    corrections: dict[bool, list[tuple[int, int]]] = {True: [], False: []}

    def correction(batch_size: int, recompute: bool) -> float:
        top = fit.batch_sizes[-1]
        extra = 0.0
        for failed_bs, error in corrections[recompute]:
            # The error is zero at the profiled sizes and ``error`` at the failed size; in between
            # it is interpolated (the error of a convex peak curve stays below that chord), beyond
            # it is extended along the same line.
            span = max(1, failed_bs - top)
            extra = max(extra, error * max(0, batch_size - top) / span)
        return extra

    plans: dict[tuple[int, bool], Plan | None] = {}

    def plan_for(batch_size: int, recompute: bool) -> Plan | None:
        key = (batch_size, recompute)
        if key not in plans:
            profile = fit.at(batch_size)
            effective = int(budget_bytes - correction(batch_size, recompute))
            plan: Plan | None
            if recompute:
                try:
                    plan = solve(profile, max(1, effective), cost=cost)
                except BudgetTooSmallError:
                    plan = None
                if plan is not None and plan.predicted_overhead > max_overhead + 1e-12:
                    plan = None
            else:
                plan = plan_from_choices(profile, [0] * len(profile.stages), max(1, effective), cost)
                if plan.predicted_peak_bytes > effective:
                    plan = None
            if plan is not None:
                plan.budget_bytes = budget_bytes
                plan.requested_budget = str(budget)
            plans[key] = plan
        return plans[key]

    def largest(recompute: bool, limit: int) -> int:
        return _largest(lambda b: plan_for(b, recompute) is not None, start, limit, mode)

    found = largest(True, max_batch_size)
    if found == 0:
        raise _too_small_at_one(fit, budget_bytes, max_overhead, cost)

    # 3. Confirm with real steps. A trial over the budget corrects the prediction by the measured
    # error; a real out-of-memory error (the device holds less than the budget) turns the rest of the
    # search into a bisection between the largest size that passed and the smallest that failed.
    trials: list[Trial] = []
    measured: int | None = None
    confirmed, failed = 0, max_batch_size + 1
    out_of_memory_seen = False
    if confirm:
        while len(trials) < max_trials:
            predicted = largest(True, failed - 1)
            if predicted <= confirmed:
                break
            candidate = predicted
            if out_of_memory_seen:
                base = confirmed if confirmed else min(fit.batch_sizes[-1], failed - 1)
                candidate = min(predicted, max(confirmed + 1, (base + failed) // 2))
            plan = plan_for(candidate, True)
            assert plan is not None
            trial = _run_trial(model, make_step(candidate), optimizer, candidate, plan.checkpointed, steps_per_trial,
                               budget_bytes, plan.predicted_peak_bytes)
            trials.append(trial)
            if trial.fits:
                confirmed, measured = candidate, trial.measured_peak_bytes
                continue
            failed = candidate
            if trial.out_of_memory:
                out_of_memory_seen = True
                notes.append(f"batch size {candidate} ran out of memory on the device below the budget")
            elif trial.measured_peak_bytes is not None:
                corrections[True].append((candidate, trial.measured_peak_bytes - plan.predicted_peak_bytes))
                plans.clear()
        if confirmed == 0:
            remaining = largest(True, failed - 1)
            if remaining == 0:
                raise _too_small_at_one(fit, budget_bytes, max_overhead, cost)
            notes.append(f"no trial passed within max_trials={max_trials}; batch size {remaining} is a prediction")
            confirmed = remaining
    else:
        confirmed = found
        notes.append("not confirmed by real steps (confirm=False): the batch size is a prediction")

    # The same search with nothing recomputed, for the comparison (never above the batch found).
    without = largest(False, confirmed)
    if confirm_without_remat and without > 0:
        while len(trials) < 2 * max_trials and without > 0:
            plan = plan_for(without, False)
            assert plan is not None
            trial = _run_trial(model, make_step(without), optimizer, without, [], steps_per_trial, budget_bytes,
                               plan.predicted_peak_bytes)
            trials.append(trial)
            if trial.fits:
                break
            if trial.measured_peak_bytes is not None:
                corrections[False].append((without, trial.measured_peak_bytes - plan.predicted_peak_bytes))
            plans.clear()
            without = largest(False, without - 1)

    # 4. Margin, and the plan for the final batch.
    final = max(1, int(math.floor(confirmed * (1 - margin))))
    final_plan = plan_for(final, True)
    if final_plan is None:  # cannot happen for a monotone model; keep the confirmed plan's modules
        final_plan = plan_for(confirmed, True)
    assert final_plan is not None
    if apply:
        apply_plan(model, final_plan)
    elif previous_plan != checkpointed_modules(model):
        apply_plan(model, previous_plan)

    binsearch = lightning_binsearch_sizes(start, confirmed, max_val=max_batch_size + 1)
    return BatchSizeResult(
        batch_size=final,
        batch_size_without_remat=without,
        largest_fitting=confirmed,
        plan=final_plan,
        budget_bytes=budget_bytes,
        measured_peak_bytes=measured,
        max_overhead=float(max_overhead),
        margin=float(margin),
        steps_per_trial=steps_per_trial,
        trials=trials,
        trial_steps=sum(t.steps for t in trials),
        profile_batch_sizes=fit.batch_sizes,
        profile_passes=counter.passes,
        profile_samples=counter.samples,
        binsearch_sizes=binsearch,
        binsearch_trial_steps=len(binsearch) * steps_per_trial,
        notes=notes + [f"static memory {format_bytes(static)} (parameters, gradients, optimizer state)"],
    )


def _flops_unattributed(profile: Profile) -> bool:
    recomputing = [o for s in profile.stages for o in s.options[1:]]
    return bool(recomputing) and profile.baseline_step_flops > 0 and all(o.cost_flops == 0 for o in recomputing)


def _too_small_at_one(fit: ProfileFit, budget_bytes: int, max_overhead: float, cost: str) -> BatchSizeTooSmallBudgetError:
    profile = fit.at(1)
    smallest = least_peak(profile)
    if smallest > budget_bytes:
        message = (f"The budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes) is too small even at batch size 1: "
                   f"the smallest peak any recompute plan reaches at batch size 1 is {format_bytes(smallest)} "
                   f"({smallest} bytes), of which {format_bytes(profile.static_bytes)} is parameters, gradients and "
                   f"optimizer state. Raise the budget to at least that.")
    else:
        cheapest = solve(profile, budget_bytes, cost=cost)
        message = (f"At batch size 1 the cheapest plan within the budget of {format_bytes(budget_bytes)} costs "
                   f"{cheapest.predicted_overhead:.1%} recomputation ({cost}), above max_overhead={max_overhead:.1%}. "
                   f"Raise max_overhead or the budget.")
    return BatchSizeTooSmallBudgetError(budget_bytes, smallest, profile.static_bytes, message)
