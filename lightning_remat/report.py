"""Where the memory of a training step goes, and how it moves over the step.

``memory_breakdown`` answers the common question "what uses my memory?": parameters, gradients,
optimizer state (Adam keeps two tensors per parameter; before the optimizer's first step, the
state it *will* create is counted, because every later step holds it), activations saved for
backward and temporaries, and the modules that save the most activation bytes.

``memory_timeline`` records the total memory after every operator of one forward and backward
pass (forward rising as activations are saved, backward falling as they are freed), and
``plot_memory_timeline`` draws it before and after a plan, so the effect of recomputation can be
seen. ``plot_pareto`` draws peak memory against recompute overhead for a sweep of budgets.

Plots need matplotlib (``pip install lightning-remat[plots]``); it is imported only when plotting,
with the non-interactive Agg backend.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from .apply import applied
from .budget import format_bytes
from .measure import _total, model_device, preserved_training_state
from .memory_model import Profile
from .plan import Plan
from .solve import BudgetTooSmallError, least_peak, solve

Step = Callable[[nn.Module], torch.Tensor]
_MIB = 2**20


class _TimelineTracker(MemTracker):
    """MemTracker that also records the total tracked memory after every operator.

    ``_update_peak_stats`` runs once after each dispatched operator (see
    ``torch.distributed._tools.mem_tracker``), when the operator's outputs are already tracked
    and the tensors freed before it are already gone, so the recorded value is the memory the
    step holds at that point.
    """

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.totals: list[int] = []
        self.in_backward: list[bool] = []

    def _update_peak_stats(self, peak_state):  # type: ignore[no-untyped-def]
        super()._update_peak_stats(peak_state)
        self.totals.append(int(_total(self._curr_mem_snap, self.device).get("Total", 0)))
        self.in_backward.append(bool(self._mod_tracker.is_bw))


@dataclass
class MemoryTimeline:
    """Total memory after each operator of one forward and backward pass.

    Attributes:
        label: what was run ("no recomputation", "plan: 3 modules", ...).
        bytes_after_op: tracked bytes after each operator, in execution order; they include the
            optimizer's state (counted ahead when the optimizer has not stepped yet).
        backward_start: index of the first operator of the backward pass (None if none ran).

    Example:
        >>> t = MemoryTimeline("demo", [10, 30, 20], backward_start=2)
        >>> t.peak_bytes, t.to_dict()["ops"]
        (30, 3)
    """

    label: str
    bytes_after_op: list[int]
    backward_start: int | None = None

    @property
    def peak_bytes(self) -> int:
        """The highest point of the timeline."""
        return max(self.bytes_after_op, default=0)

    def to_dict(self) -> dict[str, Any]:
        """A short JSON-safe summary (the per-operator series is left out)."""
        return {"label": self.label, "ops": len(self.bytes_after_op), "backward_start": self.backward_start,
                "peak_bytes": self.peak_bytes}


def _future_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of state the optimizer will create at its first step (0 if it has stepped already)."""
    if optimizer is None or optimizer.state:
        return 0
    from .profile import _optimizer_step_cost

    return _optimizer_step_cost(model, optimizer)[0]


def _tracked_step(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None,
                  names: Sequence[str]) -> _TimelineTracker:
    """One forward and backward pass under the timeline tracker, with ``names`` recomputed.

    Gradients, buffers, RNG state and the previous plan are put back afterwards.
    """
    device = model_device(model)
    tracker = _TimelineTracker(device)
    with preserved_training_state(model, optimizer), applied(model, names), warnings.catch_warnings():
        # MemTracker warns when a module's backward hook outlives the module's outputs.
        warnings.simplefilter("ignore")
        for p in model.parameters():
            p.grad = None
        tracker.track_external(model, *([optimizer] if optimizer is not None else []))
        with tracker:
            loss = step(model)
            loss.backward()
            del loss
    return tracker


def memory_timeline(model: nn.Module, step: Step, plan: Plan | Iterable[str] | None = None, *,
                    optimizer: torch.optim.Optimizer | None = None, label: str | None = None) -> MemoryTimeline:
    """Record the total memory after every operator of one forward and backward pass.

    Args:
        model: the model, in training mode.
        step: ``step(model)`` returns the loss; backward is run here.
        plan: a ``Plan`` or module names to recompute during this pass (None: nothing recomputed,
            whatever plan the model has applied is lifted for the pass and put back after).
        optimizer: its state is part of the memory of a steady-state step; if it has not stepped
            yet, the state its first step creates is added to every point.
        label: the legend entry (default: describes the plan).

    The model is left as it was: gradients, buffers, RNG state and the applied plan.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32)) for _ in range(4)])
        >>> x = torch.randn(512, 32)
        >>> before = memory_timeline(net, lambda m: m(x).sum())
        >>> after = memory_timeline(net, lambda m: m(x).sum(), ["0", "1", "2", "3"])
        >>> after.peak_bytes < before.peak_bytes
        True
    """
    names = list(plan.checkpointed if isinstance(plan, Plan) else (plan or []))
    tracker = _tracked_step(model, step, optimizer, names)
    offset = _future_optimizer_state(model, optimizer)
    backward_start = next((i for i, bw in enumerate(tracker.in_backward) if bw), None)
    if label is None:
        label = f"recompute {len(names)} module(s)" if names else "no recomputation"
    return MemoryTimeline(label, [t + offset for t in tracker.totals], backward_start)


@dataclass(frozen=True)
class ModuleMemory:
    """A candidate block and the activation bytes it saves for backward (nothing recomputed).

    Example:
        >>> ModuleMemory("transformer.h.0", "GPT2Block", 2**20, 0.25).saved_bytes
        1048576
    """

    name: str
    module_type: str
    saved_bytes: int
    share: float  # of the bytes saved by all candidate blocks


@dataclass
class MemoryBreakdown:
    """Where the memory of one training step goes.

    Attributes:
        parameter_bytes, buffer_bytes, gradient_bytes: the model's tensors (all gradients, as
            after backward).
        optimizer_state_bytes: the optimizer's state; when the optimizer has not stepped yet, the
            state its first step will create (``optimizer_state_counted_ahead`` is then True).
        activation_bytes, temporary_bytes: measured at the highest point of forward and backward:
            tensors created in forward (mostly saved for backward) and tensors created in backward.
        at_peak: the split of that highest point by category, as MemTracker reports it (gradients
            there are only those computed so far).
        forward_backward_peak_bytes: that highest point, optimizer state included.
        peak_bytes: the peak of a whole steady-state training step (forward, backward and the
            optimizer step), as the profile predicts it; this is what a budget is compared with.
        saved_activation_bytes: bytes saved for backward by all candidate blocks together.
        top_modules: the candidate blocks that save the most, largest first.

    Example:
        >>> b = MemoryBreakdown(parameter_bytes=4, gradient_bytes=4, optimizer_state_bytes=8,
        ...                     activation_bytes=20, peak_bytes=40)
        >>> b.static_bytes, b.to_dict()["peak_bytes"]
        (16, 40)
    """

    parameter_bytes: int = 0
    buffer_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_state_bytes: int = 0
    optimizer_state_counted_ahead: bool = False
    activation_bytes: int = 0
    temporary_bytes: int = 0
    at_peak: dict[str, int] = field(default_factory=dict)
    forward_backward_peak_bytes: int = 0
    peak_bytes: int = 0
    saved_activation_bytes: int = 0
    top_modules: list[ModuleMemory] = field(default_factory=list)
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)

    @property
    def static_bytes(self) -> int:
        """Parameters, buffers, gradients and optimizer state: what no recomputation can free."""
        return self.parameter_bytes + self.buffer_bytes + self.gradient_bytes + self.optimizer_state_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict."""
        data = asdict(self)
        data["static_bytes"] = self.static_bytes
        return data

    def table(self) -> Any:
        """The breakdown as a ``rich.table.Table``."""
        from rich.table import Table

        table = Table(title=f"Memory of one training step ({self.device})", title_justify="left")
        table.add_column("what")
        table.add_column("size", justify="right")
        table.add_column("share of peak", justify="right")
        table.add_column("at the forward/backward peak", justify="right")

        def share(nbytes: int) -> str:
            return f"{nbytes / self.peak_bytes:.0%}" if self.peak_bytes else "-"

        ahead = " (created by the first step)" if self.optimizer_state_counted_ahead else ""
        rows = [
            ("parameters", self.parameter_bytes, "Parameter"),
            ("buffers", self.buffer_bytes, "Buffer"),
            ("gradients", self.gradient_bytes, "Gradient"),
            (f"optimizer state{ahead}", self.optimizer_state_bytes, "Optstate"),
            ("activations (created in forward)", self.activation_bytes, "Activation"),
            ("temporaries (created in backward)", self.temporary_bytes, "Temp"),
        ]
        for what, nbytes, key in rows:
            if key == "Buffer" and not nbytes:
                continue
            at_peak = self.at_peak.get(key)
            table.add_row(what, format_bytes(nbytes), share(nbytes), "-" if at_peak is None else format_bytes(at_peak))
        table.add_section()
        table.add_row("peak of a training step", format_bytes(self.peak_bytes), "100%",
                      format_bytes(self.forward_backward_peak_bytes))
        return table

    def modules_table(self) -> Any:
        """The top modules by saved activation bytes as a ``rich.table.Table``."""
        from rich.table import Table

        table = Table(title="Blocks that save the most activations for backward", title_justify="left")
        table.add_column("module")
        table.add_column("type")
        table.add_column("saved for backward", justify="right")
        table.add_column("share", justify="right")
        for m in self.top_modules:
            table.add_row(m.name, m.module_type, format_bytes(m.saved_bytes), f"{m.share:.0%}")
        return table

    def print(self, console: Any = None) -> None:
        """Print both tables with rich (to ``console``, default stdout)."""
        from rich.console import Console

        console = console or Console()
        console.print(self.table())
        if self.top_modules:
            console.print(self.modules_table())
        for note in self.notes:
            console.print(f"note: {note}")


def breakdown_from_profile(profile: Profile, tracker_totals: dict[str, int] | None = None,
                           counted_ahead: bool = False, top: int = 10) -> MemoryBreakdown:
    """Build a ``MemoryBreakdown`` from a profile and (optionally) the category split of a measured peak.

    Example:
        >>> from lightning_remat.memory_model import StageOption, StageProfile
        >>> keep = StageOption("keep", (), 100, 150, 0.0, 0)
        >>> p = Profile((StageProfile("a", (keep,), saved_bytes=100, module_type="Block"),), (),
        ...             parameter_bytes=10, gradient_bytes=10, baseline_peak_bytes=170)
        >>> b = breakdown_from_profile(p)
        >>> b.top_modules[0].name, b.peak_bytes, b.static_bytes
        ('a', 170, 20)
    """
    at_peak = dict(tracker_totals or {})
    saved_total = sum(s.saved_bytes for s in profile.stages)
    ranked = sorted(profile.stages, key=lambda s: s.saved_bytes, reverse=True)[:top]
    modules = [ModuleMemory(s.name, s.module_type, int(s.saved_bytes), s.saved_bytes / saved_total if saved_total else 0.0)
               for s in ranked]
    activation = int(at_peak.get("Activation", 0))
    temporary = int(at_peak.get("Temp", 0))
    fw_bw_peak = int(at_peak.get("Total", 0))
    if counted_ahead and at_peak:
        # The state does not exist yet while this step runs; in every later step it does.
        at_peak["Optstate"] = at_peak.get("Optstate", 0) + profile.optimizer_state_bytes
        fw_bw_peak += profile.optimizer_state_bytes
    return MemoryBreakdown(
        parameter_bytes=profile.parameter_bytes, buffer_bytes=profile.buffer_bytes,
        gradient_bytes=profile.gradient_bytes, optimizer_state_bytes=profile.optimizer_state_bytes,
        optimizer_state_counted_ahead=counted_ahead, activation_bytes=activation, temporary_bytes=temporary,
        at_peak=at_peak, forward_backward_peak_bytes=fw_bw_peak, peak_bytes=profile.baseline_peak_bytes,
        saved_activation_bytes=int(saved_total), top_modules=modules, device=profile.device, notes=list(profile.notes),
    )


def memory_breakdown(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None = None, *,
                     profile: Profile | None = None, top: int = 10, show: bool = True,
                     console: Any = None) -> MemoryBreakdown:
    """Where the memory of one training step of ``model`` goes; printed with rich and returned.

    Args:
        model: the model, in training mode.
        step: ``step(model)`` returns the loss of a forward pass on a representative batch.
        optimizer: its state counts: the state it holds or, before its first step, the state
            that step will create (Adam: two tensors the size of each parameter).
        profile: a ``profile_step`` result for this model, step and optimizer, to avoid profiling
            again (None: profile here).
        top: how many modules to list by saved activation bytes.
        show: print the tables (with rich) to ``console`` (default stdout).

    The model, its gradients, buffers, RNG state and the optimizer are left as they were.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
        >>> opt = torch.optim.Adam(net.parameters())
        >>> b = memory_breakdown(net, lambda m: m(torch.randn(32, 64)).sum(), opt, show=False)
        >>> b.optimizer_state_bytes >= 2 * b.parameter_bytes, len(b.top_modules), b.peak_bytes > b.static_bytes
        (True, 4, True)
    """
    if profile is None:
        from .profile import profile_step

        profile = profile_step(model, step, optimizer=optimizer)
    counted_ahead = optimizer is not None and not optimizer.state
    tracker = _tracked_step(model, step, optimizer, [])
    peak = {getattr(k, "value", k): int(v) for k, v in _total(tracker.get_tracker_snapshot("peak"), model_device(model)).items()}
    peak["Temp"] = peak.get("Temp", 0) + peak.pop("Other", 0)
    result = breakdown_from_profile(profile, peak, counted_ahead, top)
    if show:
        result.print(console)
    return result


@dataclass(frozen=True)
class ParetoPoint:
    """One budget of a sweep: the plan's predicted peak and overhead (or that nothing fits).

    Example:
        >>> ParetoPoint(100, 90, 0.25, 3).feasible
        True
    """

    budget_bytes: int
    predicted_peak_bytes: int
    predicted_overhead: float
    modules: int
    feasible: bool = True


def pareto_sweep(profile: Profile, points: int = 10, cost: str = "flops") -> list[ParetoPoint]:
    """Solve for ``points`` budgets evenly spaced from the least reachable peak to the baseline peak.

    Uses the profile only (predicted figures); each budget is one ``solve``.

    Example:
        >>> from lightning_remat.memory_model import StageOption, StageProfile, Segment
        >>> keep = StageOption("keep", (), 100, 150, 0.0, 0)
        >>> whole = StageOption("whole", ("a",), 10, 160, 1.0, 5)
        >>> p = Profile((StageProfile("a", (keep, whole)),) * 2, (Segment("head", 2, 50),),
        ...             baseline_peak_bytes=250, baseline_step_flops=100)
        >>> [(pt.predicted_peak_bytes, pt.predicted_overhead) for pt in pareto_sweep(p, 3)]
        [(160, 0.05), (160, 0.05), (250, 0.0)]
    """
    low, high = least_peak(profile), max(profile.baseline_peak_bytes, least_peak(profile))
    budgets = [low] if points <= 1 else [int(round(low + (high - low) * k / (points - 1))) for k in range(points)]
    sweep = []
    for budget in budgets:
        try:
            plan = solve(profile, budget, cost=cost)
        except BudgetTooSmallError as err:
            sweep.append(ParetoPoint(budget, err.smallest_peak_bytes, float("nan"), 0, False))
            continue
        sweep.append(ParetoPoint(budget, plan.predicted_peak_bytes, plan.predicted_overhead, len(plan.checkpointed)))
    return sweep


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def plot_memory_timeline(timelines: Sequence[MemoryTimeline], path: str | Path, title: str = "") -> Path:
    """Plot total memory over one training step for each timeline (e.g. before and after a plan) to a PNG.

    Example:
        >>> import tempfile, os
        >>> out = plot_memory_timeline([MemoryTimeline("a", [1, 3 * 2**20, 2**20], 2)],
        ...                            os.path.join(tempfile.mkdtemp(), "t.png"))
        >>> out.read_bytes()[:4] == b"\\x89PNG"
        True
    """
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, timeline in enumerate(timelines):
        color = colors[k % len(colors)]
        ys = [b / _MIB for b in timeline.bytes_after_op]
        ax.plot(range(len(ys)), ys, color=color, linewidth=1.2,
                label=f"{timeline.label} (peak {format_bytes(timeline.peak_bytes)})")
        if timeline.backward_start is not None:
            ax.axvline(timeline.backward_start, color=color, linestyle=":", linewidth=1)
    ax.set_xlabel("operator (forward, then backward from the dotted line)")
    ax.set_ylabel("memory (MiB)")
    ax.set_title(title or "Memory over one training step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_pareto(path: str | Path, curve: Sequence[tuple[int, float]], *, title: str = "",
                points: Sequence[tuple[str, int, float]] = (),
                measured: Sequence[tuple[str, int, float]] = (), baseline_peak_bytes: int | None = None,
                overhead_label: str = "FLOP overhead (%)") -> Path:
    """Plot peak memory against recompute overhead to a PNG.

    Args:
        curve: (peak bytes, overhead) of our plans for a sweep of budgets (predicted), drawn as a line.
        points: (label, peak bytes, overhead) of peers, one marker each.
        measured: (label, peak bytes, overhead) of our plans as measured, drawn as dots.
        baseline_peak_bytes: draws a vertical line at the peak without recomputation.

    Example:
        >>> import tempfile, os
        >>> out = plot_pareto(os.path.join(tempfile.mkdtemp(), "p.png"), [(2**20, 0.3), (2**21, 0.0)],
        ...                   points=[("every layer", 2**20, 0.33)])
        >>> out.stat().st_size > 1000
        True
    """
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.5))
    _draw_pareto(ax, curve, points, measured, baseline_peak_bytes, overhead_label)
    ax.set_title(title or "Peak memory vs recompute overhead")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_MARKERS = ("s", "^", "D", "v", "P", "X", "*")


def _draw_pareto(ax: Any, curve, points, measured, baseline_peak_bytes, overhead_label) -> None:
    valid = sorted((p, o) for p, o in curve if o == o)  # drop NaN (infeasible)
    if valid:
        ax.step([p / _MIB for p, _ in valid], [100 * o for _, o in valid], where="post", color="tab:blue",
                label="AutoRemat (predicted, budget sweep)")
    if measured:
        ax.scatter([p / _MIB for _, p, _ in measured], [100 * o for _, _, o in measured], color="tab:blue",
                   edgecolor="black", zorder=3, label="AutoRemat (measured)")
        for label, p, o in measured:
            ax.annotate(label, (p / _MIB, 100 * o), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for k, (label, p, o) in enumerate(points):
        ax.scatter([p / _MIB], [100 * o], marker=_MARKERS[k % len(_MARKERS)], s=60, zorder=4, label=label)
    if baseline_peak_bytes:
        ax.axvline(baseline_peak_bytes / _MIB, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("peak memory of a training step (MiB)")
    ax.set_ylabel(overhead_label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
