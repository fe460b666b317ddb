"""The Pareto pictures of the benchmark's docs figures: a budget sweep with peers (other methods) as markers and
the measured plans joined, each labelled (plans on the same point share a label). Docs tooling: not in the wheel."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from lightning_remat.report.plots import draw_pareto, pyplot

_MIB = 2**20
_MARKERS = ("s", "^", "D", "v", "P", "X", "*")


def draw_with_peers(ax: Any, curve, points, measured, baseline_peak_bytes, overhead_label) -> None:
    """``draw_pareto`` with ``points`` (peers: (label, peak, overhead)) and ``measured`` plans joined by a line."""
    draw_pareto(ax, curve, (), baseline_peak_bytes, overhead_label)
    if measured:
        front = sorted((p, o) for _, p, o in measured)
        ax.plot([p / _MIB for p, _ in front], [100 * o for _, o in front], color="tab:blue", linewidth=1, zorder=2)
        ax.scatter([p / _MIB for _, p, _ in measured], [100 * o for _, _, o in measured], color="tab:blue",
                   edgecolor="black", zorder=3, label="AutoRemat (measured, joined)")
        _annotate(ax, measured)
    for k, (label, p, o) in enumerate(points):
        ax.scatter([p / _MIB], [100 * o], marker=_MARKERS[k % len(_MARKERS)], s=60, zorder=4, label=label)
    ax.legend(fontsize=7)


def _annotate(ax: Any, measured: Sequence[tuple[str, int, float]]) -> None:
    """One label per measured point (plans on the same point share it), alternating above and below."""
    merged: dict[tuple[float, float], list[str]] = {}
    for label, p, o in measured:
        # Points closer than the text's resolution (0.1 MiB, 0.1%) are the same point on the plot.
        merged.setdefault((round(p / _MIB, 1), round(100 * o, 1)), []).append(label)
    for k, ((x, y), labels) in enumerate(sorted(merged.items())):
        ax.annotate(", ".join(labels), (x, y), textcoords="offset points", xytext=(4, 4 if k % 2 == 0 else -10),
                    fontsize=7)


def plot_with_peers(path: str | Path, curve, points, measured, baseline_peak_bytes: int | None, title: str) -> Path:
    """``draw_with_peers`` to a PNG at ``path``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.5))
    draw_with_peers(ax, curve, points, measured, baseline_peak_bytes, "FLOP overhead (%)")
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
