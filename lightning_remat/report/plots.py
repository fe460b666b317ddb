"""Budget sweeps and plots; matplotlib (``lightning-remat[plots]``) is imported only when plotting."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..core.budget import format_bytes
from ..core.errors import BudgetTooSmallError
from ..core.memory_model import Profile
from ..core.solve import least_peak, solve
from .breakdown import MemoryTimeline

_MIB = 2**20


@dataclass(frozen=True)
class ParetoPoint:
    """One budget of a sweep: the plan's predicted peak and overhead (or that nothing fits)."""

    budget_bytes: int
    predicted_peak_bytes: int
    predicted_overhead: float
    modules: int
    feasible: bool = True


def pareto_sweep(profile: Profile, points: int = 10, cost: str = "flops") -> list[ParetoPoint]:
    """Predicted plans for ``points`` distinct budgets evenly spaced from the least peak to the baseline peak."""
    low, high = least_peak(profile), max(profile.baseline_peak_bytes, least_peak(profile))
    # One row per distinct budget: where recomputation cannot lower the peak (low == high) that is one row.
    budgets = sorted({low} if points <= 1 else {int(round(low + (high - low) * k / (points - 1))) for k in range(points)})
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


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write a figure to a PNG at ``path`` (its folder made) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def timeline_figure(timelines: Sequence[MemoryTimeline], title: str = "", budget_bytes: int | None = None) -> Any:
    """Measured memory over one training step for each timeline (a matplotlib ``Figure``), peaks marked, budget
    dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, timeline in enumerate(timelines):
        color = colors[k % len(colors)]
        ys = [b / _MIB for b in timeline.bytes_after_op]
        ax.plot(range(len(ys)), ys, color=color, linewidth=1.2, label=timeline.label)
        if timeline.backward_start is not None:
            ax.axvline(timeline.backward_start, color=color, linestyle=":", linewidth=1)
        if ys:
            top = max(range(len(ys)), key=ys.__getitem__)
            ax.scatter([top], [ys[top]], color=color, edgecolor="black", zorder=3)
            ax.annotate(f"measured peak {format_bytes(timeline.peak_bytes)}", (top, ys[top]), textcoords="offset points",
                        xytext=(6, -12 * k), fontsize=8)
    if budget_bytes:
        ax.axhline(budget_bytes / _MIB, color="tab:red", linestyle="--", linewidth=1,
                   label=f"budget {format_bytes(budget_bytes)}")
    ax.set_xlabel("operator (forward, then backward from the dotted line; the optimizer step is not drawn)")
    ax.set_ylabel("memory (MiB)")
    ax.set_title(title or "Memory over one training step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower center", fontsize=8)
    fig.tight_layout()
    return fig


OVERHEAD_LABELS = {"flops": "FLOP overhead (%)", "roofline": "roofline time overhead (%)", "time": "time overhead (%)"}


def pareto_figure(sweep: Sequence[ParetoPoint], baseline_peak_bytes: int | None, cost: str, plan: Any = None,
                  measured_peak_bytes: int | None = None, title: str = "") -> Any:
    """Peak memory against recompute overhead (a matplotlib ``Figure``): the plans of a budget sweep, ``plan``
    predicted and measured, its budget dashed, the baseline dotted."""
    fig, ax = pyplot().subplots(figsize=(6.4, 4.5))
    planned = [] if plan is None else [("plan", plan.predicted_peak_bytes, plan.predicted_overhead)]
    measured = [] if measured_peak_bytes is None else [("measured", measured_peak_bytes, plan.predicted_overhead)]
    draw_pareto(ax, [(p.predicted_peak_bytes, p.predicted_overhead) for p in sweep if p.feasible], measured,
                baseline_peak_bytes, OVERHEAD_LABELS.get(cost, "overhead (%)"), planned,
                None if plan is None else plan.budget_bytes)
    ax.set_title(title or "Peak memory vs recompute overhead")
    fig.tight_layout()
    return fig


def draw_pareto(ax: Any, curve, measured, baseline_peak_bytes, overhead_label, planned=(),
                budget_bytes: int | None = None) -> None:
    """A budget sweep's plans (``curve``: (peak, overhead)), ``measured`` and ``planned`` ones labelled, on ``ax``."""
    valid = sorted((p, o) for p, o in curve if o == o)  # drop NaN (infeasible)
    if valid:
        # Markers, no line: between two budgets of a sweep a plan may lie below any line drawn through them.
        ax.scatter([p / _MIB for p, _ in valid], [100 * o for _, o in valid], s=12, color="tab:blue", alpha=0.6,
                   label="AutoRemat plans of a budget sweep (predicted)")
    if measured:
        ax.scatter([p / _MIB for _, p, _ in measured], [100 * o for _, _, o in measured], color="tab:blue",
                   edgecolor="black", zorder=3, label="AutoRemat (measured, joined)")
        for label, p, o in measured:
            ax.annotate(label, (p / _MIB, 100 * o), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if planned:
        ax.scatter([p / _MIB for _, p, _ in planned], [100 * o for _, _, o in planned], facecolor="none",
                   edgecolor="tab:blue", zorder=3, label="AutoRemat plan (predicted)")
    if baseline_peak_bytes:
        ax.axvline(baseline_peak_bytes / _MIB, color="grey", linestyle=":", linewidth=1)
    if budget_bytes:
        ax.axvline(budget_bytes / _MIB, color="tab:red", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("peak memory of a training step (MiB)")
    ax.set_ylabel(overhead_label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
