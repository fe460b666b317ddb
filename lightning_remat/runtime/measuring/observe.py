"""Observe one plain training step: stage order, and per stage and child its time, FLOPs, bytes and ops."""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from .exclusive import planning_runs_here
from .roofline import OpCost, OpRecorder
from .runner import Step, StepWatch, model_device, run_step, synchronize


def storages(value: Any) -> dict[int, int]:
    """Unique storages of the tensors in ``value`` with their bytes, keyed by storage object (fake ones too)."""
    found = {}
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            found[storage._cdata] = storage.nbytes()
    return found


@dataclass
class ModuleStats:
    """What one module did during the observed forward."""

    seconds: float = 0.0
    flops: int = 0
    saved: dict[int, int] = field(default_factory=dict)
    inputs: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, int] = field(default_factory=dict)
    ops: list[OpCost] = field(default_factory=list)


@dataclass
class ObservedStep:
    """The stages in execution order, stats per watched module, the whole step's seconds and FLOPs."""

    order: list[str]
    stats: dict[str, ModuleStats]
    step_seconds: float
    step_flops: int
    step_ops: list[OpCost] = field(default_factory=list)
    # The chain's places (``core.calls``): stages in the order their forwards ran, consecutive calls one place.
    positions: list[str] = field(default_factory=list)
    position_calls: list[int] = field(default_factory=list)


class _Observer(StepWatch):
    """Forward hooks on the stages and their children; as the counting pass's watch, a saved-tensor hook, and FLOPs
    and ops of forward and backward counted apart."""

    def __init__(self, model: nn.Module, stage_names: Sequence[str]):
        modules = dict(model.named_modules())
        self.stage_names = set(stage_names)
        self.watched = {n: modules[n] for n in stage_names}
        for n in stage_names:
            for child, module in modules[n].named_children():
                self.watched[f"{n}.{child}"] = module
        self.stats = {n: ModuleStats() for n in self.watched}
        self.excluded = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        self.device = model_device(model)
        self.sequence: list[str] = []  # every stage call, in order
        self.active: list[str] = []
        self.started: dict[str, float] = {}
        self.flops_before: dict[str, int] = {}
        self.counter: FlopCounterMode | None = None  # set while the counting pass runs forward

    def counted(self) -> int:
        # The counter's growth across a forward: whatever way the step reaches the module (model.net(x), ...).
        return int(sum(self.counter.flop_counts["Global"].values())) if self.counter is not None else 0

    def pre_hook(self, name: str):
        def hook(module, args, kwargs):
            if not planning_runs_here():  # another thread's forward of the same model
                return
            if name in self.stage_names:
                self.sequence.append(name)
            self.stats[name].inputs.update(storages((args, kwargs)))
            self.active.append(name)
            self.flops_before[name] = self.counted()
            synchronize(self.device)
            self.started[name] = time.perf_counter()
        return hook

    def post_hook(self, name: str):
        def hook(module, args, kwargs, output):
            if not planning_runs_here():
                return
            synchronize(self.device)
            self.stats[name].seconds += time.perf_counter() - self.started.pop(name)
            self.stats[name].flops += self.counted() - self.flops_before.pop(name)
            self.stats[name].outputs.update(storages(output))
            self.active.remove(name)
        return hook

    def pack(self, tensor: Any) -> Any:
        for storage, nbytes in storages(tensor).items():
            if storage not in self.excluded:
                for name in self.active:
                    self.stats[name].saved[storage] = nbytes
        return tensor

    def record(self, op: OpCost) -> None:
        for name in self.active:
            self.stats[name].ops.append(op)

    def watching(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        with FlopCounterMode(display=False) as self.counter, OpRecorder(self.record) as self.forward_ops:
            yield
        self.forward_counter, self.counter = self.counter, None

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        with FlopCounterMode(display=False) as self.backward_counter, OpRecorder() as self.backward_ops:
            yield


def observe_step(model: nn.Module, step: Step, stage_names: Sequence[str], timed: bool = True,
                 before_pass: Callable[[], None] = lambda: None) -> ObservedStep:
    """One plain step in two passes: timing (skipped with ``timed=False``), then counting FLOPs and saved bytes."""
    observer = _Observer(model, stage_names)
    with contextlib.ExitStack() as hooks:
        for name, module in observer.watched.items():
            hooks.enter_context(module.register_forward_pre_hook(observer.pre_hook(name), with_kwargs=True))
            hooks.enter_context(module.register_forward_hook(observer.post_hook(name), with_kwargs=True,
                                                             always_call=True))
        before_pass()
        step_seconds = 0.0
        if timed:
            synchronize(observer.device)
            start = time.perf_counter()
            run_step(model, step, check=True)
            synchronize(observer.device)
            step_seconds = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
        seconds = {n: s.seconds for n, s in observer.stats.items()}
        observer.stats = {n: ModuleStats() for n in observer.watched}  # counted afresh in the counting pass
        observer.sequence.clear()
        before_pass()
        run_step(model, step, watch=observer, zero_grad="after")
    for name, s in observer.stats.items():
        s.seconds = seconds[name]  # from the timing pass, not the slower counting pass
    step_flops = int(observer.forward_counter.get_total_flops() + observer.backward_counter.get_total_flops())
    places = [(name, len(list(calls))) for name, calls in itertools.groupby(observer.sequence)]
    return ObservedStep(list(dict.fromkeys(observer.sequence)), observer.stats, step_seconds, step_flops,
                        observer.forward_ops.ops + observer.backward_ops.ops,
                        [name for name, _ in places], [calls for _, calls in places])
