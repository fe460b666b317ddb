"""What the harness records of each training step, whatever loop runs it.

A ``Recorder`` is opened at the start of a step (before any work of the package's in that step) and
closed at its end (after the optimizer step). Per step it records:

- the peak: ``tests/torch_meter.TorchPeak`` (``torch.profiler``'s allocation events): memory alive at
  the start plus the largest running sum of allocations inside the window, so the package's own
  planning and profiling inside the step count. A step cut short by an error is measured up to it.
  Python's cycle collector is off inside the window, so the figure does not depend on when it runs.
- the loss, as a float.
- whether what is installed is what the plan in effect says, two ways: the installer's records
  (``runtime.installing.records``: ``recomputed``, ``installed_segments``) against the plan's
  ``checkpointed``/``policies``/``segments``; and behaviour: which modules' forwards ran again during
  the training backward (a pre-hook on every module; real tensors only), which must be exactly the
  plan's units (the descendants of a module recomputed alone, the members of a segment).
- the calls a user's forward hook on the model's root saw (the run without the package: one per step).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from lightning_remat.runtime.installing.records import installed_segments, recomputed
from tests.torch_meter import TorchPeak


@dataclass
class StepRecord:
    """One step: its peak (bytes), its loss, the mismatches between installed and planned, the user
    hook's calls, and whether it ran to its end."""

    peak: int | None = None
    loss: float | None = None
    mismatches: list[str] = field(default_factory=list)
    hook_calls: int = 0
    completed: bool = False


@dataclass
class RunRecord:
    """A run: its steps (the last one cut short when ``error`` is set) and the error that ended it."""

    steps: list[StepRecord]
    error: BaseException | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def error_step(self) -> int | None:
        return None if self.error is None else len([s for s in self.steps if s.completed])


def _real(values: Any) -> bool:
    tensors = [v for v in (values if isinstance(values, (tuple, list)) else (values,)) if isinstance(v, torch.Tensor)]
    return all(not is_fake(t) and t.device.type != "meta" for t in tensors)


def _inside(name: str, unit: str) -> bool:
    return name == unit or unit == "" or name.startswith(unit + ".")


def installed_mismatch(root: nn.Module, plan: Any, rerun: set[str] | None) -> list[str]:
    """How what is installed on ``root`` differs from ``plan`` (None: nothing should be), by the
    records and, with ``rerun`` (names whose forward ran in the training backward), by behaviour."""
    alone = {name: (plan.policies.get(name) or "") for name in plan.checkpointed} if plan is not None else {}
    segments = sorted(tuple(s) for s in plan.segments) if plan is not None else []
    found = []
    got_alone, got_segments = recomputed(root), sorted(tuple(s) for s in installed_segments(root))
    if got_alone != alone:
        found.append(f"records: recomputed {sorted(got_alone.items())}, the plan says {sorted(alone.items())}")
    if got_segments != segments:
        found.append(f"records: segments {got_segments}, the plan says {segments}")
    if rerun is not None:
        units = [*alone, *(name for segment in segments for name in segment)]
        stray = sorted(name for name in rerun if not any(_inside(name, unit) for unit in units))
        # A unit ran again if it, or a module inside it, did (every unit of the zoo has children).
        idle = [unit for unit in units if not any(_inside(name, unit) for name in rerun)]
        if stray:
            found.append(f"behaviour: ran again in backward outside the plan: {stray[:4]}")
        if idle:
            found.append(f"behaviour: planned but not recomputed in backward: {idle}")
    return found


class Recorder:
    """Per-step records of one run. ``root`` is what plan names are relative to (the LightningModule
    in Lightning, the model elsewhere); ``user_model`` gets the user's hook; ``plan_of()`` is the plan
    in effect (None for the run without the package: nothing checked)."""

    def __init__(self, root: nn.Module, user_model: nn.Module, plan_of: Callable[[], Any] | None):
        self.root, self.plan_of = root, plan_of
        self.steps: list[StepRecord] = []
        self._meter: TorchPeak | None = None
        self._collecting = True
        self._in_backward = False
        self._rerun: set[str] = set()
        self._handles = [user_model.register_forward_hook(self._user_hook)]
        if plan_of is not None:
            self._handles += [m.register_forward_pre_hook(self._rerun_hook(name))
                              for name, m in root.named_modules() if name]

    # -- hooks
    def _user_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.steps and not self.steps[-1].completed:
            self.steps[-1].hook_calls += 1

    def _rerun_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._in_backward and torch._C._current_graph_task_id() != -1 and _real(args):
                self._rerun.add(name)
        return hook

    # -- a step
    def begin(self, model: nn.Module, optimizers: Any) -> None:
        self.steps.append(StepRecord())
        # Python's cycle collector is off inside a window: a step's peak is then the one reached when
        # it does not run, whatever its timing (AutoRemat's first step, the same events, read 993 KiB
        # or 1.27 MiB depending on whether it ran during the profiling passes).
        self._collecting = gc.isenabled()
        gc.disable()
        self._meter = TorchPeak(model, optimizers).start()

    def _stop(self) -> int:
        peak, self._meter = self._meter.stop(), None
        if self._collecting:
            gc.enable()
        return peak

    def enter_backward(self) -> None:
        """The step's own backward starts: the forwards that run in it are recomputes."""
        self._in_backward, self._rerun = True, set()

    def exit_backward(self) -> None:
        """The step's own backward ended: what ran again in it is compared with the plan in effect."""
        self._in_backward = False
        self.check("after backward", behaviour=True)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around the step's own backward (``enter_backward`` ... ``exit_backward``)."""
        self.enter_backward()
        try:
            yield
        finally:
            self.exit_backward()

    def check(self, where: str, behaviour: bool = False) -> None:
        """Compare what is installed with the plan in effect (``behaviour``: also what ran again in
        the backward just done)."""
        if self.plan_of is None or not self.steps:
            return
        found = installed_mismatch(self.root, self.plan_of(), self._rerun if behaviour else None)
        self.steps[-1].mismatches += [f"{where}: {text}" for text in found]

    def end(self, loss: Any) -> None:
        step = self.steps[-1]
        step.peak = self._stop()
        step.loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        step.completed = True

    def finish(self, error: BaseException | None = None, **extra: Any) -> RunRecord:
        """The run's record: a step open when ``error`` came is measured up to it."""
        if self._meter is not None:
            self.steps[-1].peak = self._stop()
        for handle in self._handles:
            handle.remove()
        return RunRecord(self.steps, error, extra)
