"""One progress display for long work: a transient rich bar on stderr, after ``delay`` seconds, on a terminal."""

from __future__ import annotations

import threading
from typing import Any

DELAY_SECONDS = 3.0


def default_console() -> Any:
    """Where the display goes unless told: stderr (stdout stays the program's output)."""
    from rich.console import Console

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
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

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
