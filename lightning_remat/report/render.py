"""Every table and summary lightning-remat shows people, and the one progress display of long work (a transient
rich bar on stderr, after ``DELAY_SECONDS``, on a terminal), in one place (the only user of ``rich``)."""

from __future__ import annotations

import io
import math
import threading
from typing import Any, Iterable, Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..core.budget import format_budget, format_bytes
from ..core.plan_text import TABLE_HEADER, plan_headline, plan_lines, plan_rows

TEXT_WIDTH = 120


def to_text(renderables: Iterable[Any], width: int = TEXT_WIDTH) -> str:
    """Plain text of rich renderables (tables, strings), without colours."""
    items = list(renderables)
    console = Console(width=width, file=io.StringIO(), color_system=None, record=True)
    console.width = _widest(console, items, width)
    for renderable in items:
        console.print(renderable, highlight=False)
    return console.export_text().rstrip()


def _widest(console: Any, items: Sequence[Any], width: int) -> int:
    """``width``, or wider where a line or row of ``items`` needs it (text for a file keeps each row whole)."""
    unbounded = console.options.update_width(2**20)
    return max([width, *(console.measure(item, options=unbounded).maximum for item in items)])


def print_renderables(renderables: Iterable[Any], console: Any = None) -> None:
    """Print rich renderables to ``console`` (default: stdout); to a file or a pipe, every row whole on one line."""
    items = list(renderables)
    console = console or Console()
    console.width = max(console.width, TEXT_WIDTH)
    if not console.is_terminal:
        console.width = _widest(console, items, console.width)
    for renderable in items:
        console.print(renderable, highlight=False)


def plan_renderables(plan: Any, title: str = "Recompute plan") -> list[Any]:
    """Headline, stage table, static memory at the peak and notes, as ``Plan.summary()`` writes them."""
    lines: list[Any] = [plan_headline(plan, title)]
    rows = plan_rows(plan)
    if rows:
        table = Table(show_edge=False, pad_edge=False)
        for k, column in enumerate(TABLE_HEADER):
            table.add_column(column, justify="left" if k < 2 else "right", no_wrap=k == 0)  # type: ignore[arg-type]
        for row in rows:
            table.add_row(*row)
        lines.append(table)
    lines.extend(plan_lines(plan))
    return lines


def print_plan(plan: Any, title: str = "Recompute plan", console: Any = None) -> None:
    print_renderables(plan_renderables(plan, title), console)


def batch_size_table(result: Any) -> Any:
    """A ``rich.table.Table`` of a ``BatchSizeResult`` and what the search cost."""
    table = Table(title="Batch size with optimal recomputation", show_header=True)
    table.add_column("")
    table.add_column("value", justify="right")
    ratio = "inf" if math.isinf(result.ratio) else f"{result.ratio:.2f}x"
    measured = "-" if result.measured_peak_bytes is None else format_bytes(result.measured_peak_bytes)
    plan = result.plan
    table.add_row("batch size (with recomputation)", str(result.batch_size))
    table.add_row("largest batch without recomputation", str(result.batch_size_without_remat))
    table.add_row("ratio", ratio)
    table.add_row("predicted overhead", f"{result.predicted_overhead:.1%} ({plan.cost_kind}; max {result.max_overhead:.0%})")
    table.add_row("modules recomputed", str(len(plan.checkpointed)))
    if getattr(plan, "offloaded", None):
        table.add_row("modules offloaded (host memory)", f"{len(plan.offloaded)} ({format_bytes(plan.host_bytes)})")
    table.add_row("budget", format_budget(plan.requested_budget, result.budget_bytes))
    table.add_row("predicted peak / measured peak", f"{format_bytes(plan.predicted_peak_bytes)} / {measured}")
    table.add_row("real trial steps", str(result.trial_steps))
    table.add_row("profiled batch sizes (passes)", f"{list(result.profile_batch_sizes)} ({result.profile_passes})")
    return table


def percent_shares(parts: Sequence[int]) -> list[str]:
    """Whole percentages of ``parts``' sum that add up to exactly 100% (largest remainders rounded up)."""
    total = sum(parts)
    if total <= 0:
        return ["-" for _ in parts]
    exact = [100 * p / total for p in parts]
    shares = [math.floor(e) for e in exact]
    for k in sorted(range(len(parts)), key=lambda k: shares[k] - exact[k])[:100 - sum(shares)]:
        shares[k] += 1
    return [f"{s}%" for s in shares]


def breakdown_table(breakdown: Any) -> Any:
    """A ``MemoryBreakdown`` as a ``rich.table.Table``; shares of the forward/backward peak add up to 100%."""
    table = Table(title=f"Memory of one training step ({breakdown.device})", title_justify="left")
    for column in ("what", "size", "at the forward/backward peak", "share of that peak"):
        table.add_column(column, justify="left" if column == "what" else "right")
    ahead = " (created by the first step)" if breakdown.optimizer_state_counted_ahead else ""
    rows = [
        ("parameters", breakdown.parameter_bytes, "Parameter"),
        ("buffers", breakdown.buffer_bytes, "Buffer"),
        ("gradients (all of them by the end of backward)", breakdown.gradient_bytes, "Gradient"),
        (f"optimizer state{ahead}", breakdown.optimizer_state_bytes, "Optstate"),
        ("activations (created in forward)", breakdown.activation_bytes, "Activation"),
        ("temporaries (created in backward)", breakdown.temporary_bytes, "Temp"),
    ]
    rows = [r for r in rows if r[2] != "Buffer" or r[1] or breakdown.at_peak.get("Buffer")]
    # Every category has a row (``memory_breakdown`` counts MemTracker's "Other" as "Temp"): the rows cover the peak.
    at_peak = breakdown.at_peak
    shares = percent_shares([at_peak.get(key, 0) for _, _, key in rows])
    for (what, nbytes, key), share in zip(rows, shares):
        part = at_peak.get(key)
        table.add_row(what, format_bytes(nbytes), "-" if part is None else format_bytes(part), share)
    table.add_section()
    table.add_row("forward/backward peak", "", format_bytes(breakdown.forward_backward_peak_bytes),
                  "100%" if breakdown.at_peak else "-")
    table.add_row("peak of the whole step (optimizer step included)", format_bytes(breakdown.peak_bytes), "", "")
    return table


def breakdown_renderables(breakdown: Any) -> list[Any]:
    """The breakdown's table, the blocks that save the most activations (a table) and its notes."""
    items: list[Any] = [breakdown_table(breakdown)]
    if breakdown.top_modules:
        title = "Blocks that save the most activations for backward"
        table = Table(title=title, title_justify="left", min_width=len(title))  # a title wraps at the table's width
        for column in ("module", "type", "saved for backward", "share"):
            table.add_column(column, justify="left" if column in ("module", "type") else "right")
        for m in breakdown.top_modules:
            table.add_row(m.name, m.module_type, format_bytes(m.saved_bytes), f"{m.share:.0%}")
        items.append(table)
    items.extend(f"note: {note}" for note in breakdown.notes)
    return items


def pareto_table(points: Sequence[Any], chosen: Any, cost: str) -> Any:
    """Budgets from the least reachable peak to no recomputation, with the chosen plan in bold."""
    title = f"Budgets from the least reachable peak to no recomputation (predicted, cost: {cost})"
    table = Table(title=title, title_justify="left", min_width=len(title))  # a title wraps at the table's width
    for column in ("budget", "predicted peak", "overhead", "modules recomputed"):
        table.add_column(column, justify="right")
    for p in points:
        overhead = f"{p.predicted_overhead:.1%}" if p.feasible else "infeasible"
        style = "bold" if chosen is not None and p.predicted_peak_bytes == chosen.predicted_peak_bytes else None
        table.add_row(format_bytes(p.budget_bytes), format_bytes(p.predicted_peak_bytes), overhead, str(p.modules),
                      style=style)
    return table


DELAY_SECONDS = 3.0


def default_console() -> Any:
    """Where the display goes unless told: stderr (stdout stays the program's output)."""
    return Console(stderr=True)


class PhaseProgress:
    """Phases of long work on a rich progress bar; ``advance(text)`` starts the next (``total`` None: a spinner)."""

    def __init__(self, total: int | None = None, *, enabled: bool = True, delay: float | None = None,
                 console: Any = None) -> None:
        self.total, self.enabled, self.delay, self.console = total, enabled, delay, console
        self.description, self.phases_done, self.shown = "starting", 0, False
        self._started = False
        self._closed = False
        self._progress: Any = None
        self._task: Any = None
        self._timer: threading.Timer | None = None
        # The timer's thread starts the bar while the caller's thread advances or ends it.
        self._lock = threading.Lock()

    def __enter__(self) -> "PhaseProgress":
        if not self.enabled:
            return self
        self.console = self.console or default_console()
        if not self.console.is_terminal:
            return self
        delay = DELAY_SECONDS if self.delay is None else self.delay
        if delay <= 0:
            self._show()
        else:
            self._timer = threading.Timer(delay, self._show)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __call__(self, description: str) -> None:
        """Start the next phase, ``description`` (the previous one counts as done)."""
        with self._lock:
            if self._started:
                self.phases_done += 1
            self._started = True
            self.description = description
            if self._progress is not None:
                self._progress.update(self._task, description=description, completed=self.phases_done)

    def _show(self) -> None:
        with self._lock:
            if self._closed:
                return
            columns = [SpinnerColumn(), TextColumn("{task.description}")]
            if self.total is not None:
                columns += [BarColumn(), TextColumn("{task.completed}/{task.total}")]
            self._progress = Progress(*columns, TimeElapsedColumn(), console=self.console, transient=True)
            self._task = self._progress.add_task(self.description, total=self.total, completed=self.phases_done)
            self._progress.start()
            self.shown = True

    def __exit__(self, *exc: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._closed = True
            if self._started:
                self.phases_done += 1
                self._started = False
            if self._progress is not None:
                self._progress.stop()
                self._progress = None
