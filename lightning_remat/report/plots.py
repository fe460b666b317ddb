"""Budget sweeps and plots: peak memory against recompute overhead, memory over a step.

Plots need matplotlib (``pip install lightning-remat[plots]``); it is imported only when plotting,
with the non-interactive Agg backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..core.budget import format_bytes
from ..core.errors import BudgetTooSmallError
from ..core.memory_model import Profile
from ..core.solve import least_peak, solve
from .timeline import MemoryTimeline

_MIB = 2**20


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
        >>> from lightning_remat.core.memory_model import StageOption, StageProfile, Segment
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


def pyplot() -> Any:
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
    plt = pyplot()
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
                measured: Sequence[tuple[str, int, float]] = (), planned: Sequence[tuple[str, int, float]] = (),
                baseline_peak_bytes: int | None = None, budget_bytes: int | None = None,
                overhead_label: str = "FLOP overhead (%)") -> Path:
    """Plot peak memory against recompute overhead to a PNG.

    Args:
        curve: (peak bytes, overhead) of our plans for a sweep of budgets (predicted), drawn as a line.
        points: (label, peak bytes, overhead) of peers, one marker each.
        measured: (label, peak bytes, overhead) of our plans as measured, drawn as dots.
        planned: (label, peak bytes, overhead) of our plans as predicted (not run), drawn as hollow dots.
        baseline_peak_bytes: draws a vertical line at the peak without recomputation.
        budget_bytes: draws the budget as a dashed vertical line.

    Example:
        >>> import tempfile, os
        >>> out = plot_pareto(os.path.join(tempfile.mkdtemp(), "p.png"), [(2**20, 0.3), (2**21, 0.0)],
        ...                   points=[("every layer", 2**20, 0.33)])
        >>> out.stat().st_size > 1000
        True
    """
    plt = pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.5))
    draw_pareto(ax, curve, points, measured, baseline_peak_bytes, overhead_label, planned, budget_bytes)
    ax.set_title(title or "Peak memory vs recompute overhead")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_MARKERS = ("s", "^", "D", "v", "P", "X", "*")


def draw_pareto(ax: Any, curve, points, measured, baseline_peak_bytes, overhead_label, planned=(),
                 budget_bytes: int | None = None) -> None:
    valid = sorted((p, o) for p, o in curve if o == o)  # drop NaN (infeasible)
    if valid:
        ax.step([p / _MIB for p, _ in valid], [100 * o for _, o in valid], where="post", color="tab:blue",
                label="AutoRemat (predicted, budget sweep)")
    if measured:
        ax.scatter([p / _MIB for _, p, _ in measured], [100 * o for _, _, o in measured], color="tab:blue",
                   edgecolor="black", zorder=3, label="AutoRemat (measured)")
        for label, p, o in measured:
            ax.annotate(label, (p / _MIB, 100 * o), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if planned:
        ax.scatter([p / _MIB for _, p, _ in planned], [100 * o for _, _, o in planned], facecolor="none",
                   edgecolor="tab:blue", zorder=3, label="AutoRemat plan (predicted)")
    for k, (label, p, o) in enumerate(points):
        ax.scatter([p / _MIB], [100 * o], marker=_MARKERS[k % len(_MARKERS)], s=60, zorder=4, label=label)
    if baseline_peak_bytes:
        ax.axvline(baseline_peak_bytes / _MIB, color="grey", linestyle=":", linewidth=1)
    if budget_bytes:
        ax.axvline(budget_bytes / _MIB, color="tab:red", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("peak memory of a training step (MiB)")
    ax.set_ylabel(overhead_label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
