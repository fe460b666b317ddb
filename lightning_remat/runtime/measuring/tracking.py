"""Memory tracking on top of torch's ``MemTracker``: every subclass the package needs, in one place; and what a
tracker holds while it runs: a counted ``force_eager`` stance (dynamo skips for good a frame first met under a
dispatch mode; counted: trackers close in any order), and the CPU generator states checkpoints keep until backward
(made in C++, unseen by MemTracker; on a GPU they are host memory, which the budget does not count)."""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch._C._distributed_c10d import FakeWork, Work
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.utils._pytree import tree_leaves
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .exclusive import PLANNING_LOCK

_stance_lock = threading.Lock()
_holders = 0
_stance: Any = None  # torch's set_stance object of the first holder: its exit restores the prior stance


@contextlib.contextmanager
def eager_stance() -> Iterator[None]:
    """``torch.compile``'d code runs eagerly (and compiles nothing) inside the block."""
    global _holders, _stance
    with _stance_lock:
        if _holders == 0:
            _stance = torch.compiler.set_stance("force_eager")  # takes effect when made
        _holders += 1
    try:
        yield
    finally:
        with _stance_lock:
            _holders -= 1
            if _holders == 0:  # the last holder puts back the stance that was in force before
                stance, _stance = _stance, None
                stance.__exit__(None, None, None)


_ORIGINAL = torch.get_rng_state
# Whether the states count: the CPU is the planned device (the default: a real step on the CPU).
_COUNT = contextvars.ContextVar("lightning_remat_rng_states_count", default=True)


@contextlib.contextmanager
def rng_states_count(device: str | torch.device | None) -> Iterator[None]:
    """Within the block, trackers count the CPU generator's states only if ``device`` is the CPU."""
    token = _COUNT.set(device is None or torch.device(device).type == "cpu")
    try:
        yield
    finally:
        _COUNT.reset(token)


@contextlib.contextmanager
def counting_rng_states(track: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """``track(state)`` for every ``torch.get_rng_state()`` made within the block (under the planning lock)."""
    if not _COUNT.get() or torch.get_rng_state is not _ORIGINAL:
        yield
        return

    def get_rng_state() -> torch.Tensor:
        state = _ORIGINAL()
        track(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = _ORIGINAL


_WORKER_WAIT_S = 0.5  # at most, for a worker thread to let go of a finished collective's tensors


# MemTracker's operator hook without its dynamo-disable wrapper: this class's override already has one (per op).
_MEMTRACKER_DISPATCH = getattr(MemTracker.__torch_dispatch__, "__wrapped__", MemTracker.__torch_dispatch__)

# Stands where MemTracker keeps the gradient hooks of a parameter that has no gradient.
_NO_HOOK = SimpleNamespace(remove=lambda: None)


class Tracker(MemTracker):
    """``MemTracker`` that accepts frozen parameters (marked hooked, still counted) and counts this thread only."""

    def __init__(self) -> None:
        super().__init__()
        # MemTracker's module hooks are global: only calls under this tracker's dispatch mode count (this
        # thread's, and autograd's workers' for its backward, which inherit the mode).
        modules = self._mod_tracker
        pre, post = modules._fw_pre_hook, modules._fw_post_hook
        modules._fw_pre_hook = lambda *args: pre(*args) if self._watching() else None
        modules._fw_post_hook = lambda *args: post(*args) if self._watching() else None
        self._collectives: list[list] = []  # [works, tensors] of each collective not settled yet

    def _watching(self) -> bool:
        """Whether the running code is under this tracker (not another thread's)."""
        return any(mode is self for mode in _get_current_dispatch_mode_stack())

    def _register_global_optimizer_hook(self) -> None:
        # MemTracker's own hooks, for this tracker's optimizer steps only (see __init__).
        def before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self._watching():
                self._in_opt = True

        def after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self._watching():
                self._track_optimizer_states(_MemRefType.OPT, optimizer)
                self._in_opt = False

        self._optimizer_hook_handles = (register_optimizer_step_pre_hook(before),
                                        register_optimizer_step_post_hook(after))

    # A collective's tensors die in the worker thread whenever it gets there (peaks would vary): held until the
    # work is dropped and the worker let go, they die here at the next operator. A fake group's work holds nothing.
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self._collectives:
            self._settle_collectives()
        result = _MEMTRACKER_DISPATCH(self, func, types, args, kwargs)
        if func.namespace == "c10d":
            works = [w for w in tree_leaves(result) if isinstance(w, torch.ScriptObject)]
            if not any(_is_fake(w) for w in works):
                tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                self._collectives.append([works, tensors])
        return result

    def _settle_collectives(self, finished: bool = False) -> None:
        """Drop the works nobody else holds (``finished``: all), wait for the worker thread, then their tensors."""
        waiting = []
        for entry in self._collectives:
            if not finished and any(sys.getrefcount(w) > 3 for w in entry[0]):  # the list, w, the call
                waiting.append(entry)  # an asynchronous collective not yet waited for
                continue
            tensors = entry[1]
            held = [t._use_count() for t in tensors]
            ours = bool(entry[0]) and bool(tensors)  # a work that holds tensors (a barrier holds none)
            entry[0] = []  # the work dies now, or when the worker thread lets go of it
            deadline = time.monotonic() + _WORKER_WAIT_S
            while ours and all(t._use_count() >= n for t, n in zip(tensors, held)) and time.monotonic() < deadline:
                time.sleep(0)
        self._collectives = waiting

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True):  # type: ignore[no-untyped-def]
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        # MemTracker refuses a top-level module's second forward in one ``with`` block (a GAN's step runs
        # several): count each like a submodule's repeated call (per-module statistics start again).
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    # Compiled code runs eagerly while tracking (eager_stance); the global hooks are one per process, so
    # one thread tracks at a time (exclusive.py's lock, held from enter to exit).
    def __enter__(self) -> "Tracker":
        with contextlib.ExitStack() as stack:
            stack.enter_context(PLANNING_LOCK)
            stack.enter_context(eager_stance())
            # The generator states checkpoints keep until backward are allocated where no mode sees them.
            stack.enter_context(counting_rng_states(lambda state: self._track(_MemRefType.ACT, state)))
            super().__enter__()
            self._held = stack.pop_all()
        return self

    def __exit__(self, *args: Any) -> None:
        self._settle_collectives(finished=True)
        with self._held:
            super().__exit__(*args)

    def counted_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Bytes of the distinct storages of ``tensors`` this tracker counts now (older ones once an op used them)."""
        storages = {id(storage): storage.nbytes()
                    for t in tensors for storage in get_untyped_storages(t) if storage in self._WINFO}
        return sum(storages.values())

    def _update_peak_stats(self, peak_state):  # type: ignore[no-untyped-def]
        # MemTracker's version scans every module after every operator (quadratic in depth): overall peak only.
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(dev_snap)


def _is_fake(work: torch.ScriptObject) -> bool:
    """Whether ``work`` is a fake process group's (it returns at once and holds no tensor)."""
    return work._type().qualified_name().endswith("c10d.Work") and isinstance(Work.unbox(work), FakeWork)


def _device_totals(snapshot: dict, device: torch.device) -> dict:
    for dev, values in snapshot.items():  # MemTracker's keys are devices (run after every operator)
        if (dev if isinstance(dev, torch.device) else torch.device(dev)).type == device.type:
            return values
    return {}


def snapshot_by_category(snapshot: dict, device: torch.device) -> dict[str, int]:
    """The totals of one device in a MemTracker snapshot, keyed by category name ("Parameter", "Total", ...)."""
    return {getattr(k, "value", k): int(v) for k, v in _device_totals(snapshot, device).items()}


def current_total(tracker: MemTracker, device: torch.device) -> int:
    return int(_device_totals(tracker._curr_mem_snap, device).get("Total", 0))


class _NoModules(contextlib.nullcontext):
    """Stands in for MemTracker's ModTracker: no module bookkeeping, no global hooks."""

    is_bw = False
    parents: set = set()

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass


class PeakOnlyTracker(Tracker):
    """MemTracker's byte counting without its per-module bookkeeping, for a window opened in a hook."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _NoModules()

    def _register_global_optimizer_hook(self) -> None:
        # No global optimizer hook from inside one (not allowed); state allocated in the window counts all the same.
        self._optimizer_hook_handles = None


class SegmentTracker(Tracker):
    """MemTracker that also records the peak of every segment: ("fw", i) / ("bw", i) while stage i runs forward /
    backward, ("gap", k) between with k stages awaiting backward; a module at several places fills them in order."""

    def __init__(self, stage_ids: dict[int, int | Sequence[int]], device: torch.device,
                 calls: dict[int, int] | None = None):
        super().__init__()
        self.places = {m: (i,) if isinstance(i, int) else tuple(i) for m, i in stage_ids.items()}
        self.calls = calls or {}
        self.forwards_done: Counter[int] = Counter()
        self.backwards_begun: Counter[int] = Counter()
        self.backwards_done: Counter[int] = Counter()
        self.device = device
        self.label: tuple[str, int] = ("gap", 0)
        self.segment_peaks: dict[tuple[str, int], int] = {}
        self.pre_fw: dict[int, int] = {}
        self.stored: Counter[int] = Counter()
        # The total when each stage's (first) forward began: what the gaps between stages released.
        self.forward_starts: dict[int, int] = {}
        # Parameter bytes (FSDP2's gathered ones included) there and when each stage's forward ended: what the
        # gap after a stage frees of them is FSDP2 resharding it, not the stage's stored bytes (``net_of_released``).
        self.start_parameters: dict[int, int] = {}
        self.end_parameters: dict[int, int] = {}
        self._running: dict[int, int] = {}  # module id -> the place its running forward fills
        # Places whose forward began after every earlier place's backward began (several backward passes):
        # nothing stored before them is alive (``StageProfile.fresh``).
        self.fresh: set[int] = set()

    def _parameters(self) -> int:
        return int(_device_totals(self._curr_mem_snap, self.device).get(_MemRefType.PARAM, 0))

    def resharded(self) -> dict[int, int]:
        """Per place, the parameter bytes freed between its forward's end and the next place's start (FSDP2's reshard)."""
        return {i: end - self.start_parameters[i + 1] for i, end in self.end_parameters.items()
                if i + 1 in self.start_parameters}

    def _note(self, label: tuple[str, int] | None = None) -> None:
        self.label = label or self.label
        total = current_total(self, self.device)
        if total > self.segment_peaks.get(self.label, -1):
            self.segment_peaks[self.label] = total

    def _place(self, module: torch.nn.Module, done: Counter[int], limit: Counter[int] | None) -> int | None:
        """The place of ``module``'s call: in a forward (no ``limit``), its first place whose ``done`` is short of its
        calls, else the last; in a backward (autograd's order), its last whose ``done`` is short of ``limit``, else
        the first."""
        places = self.places.get(id(module))
        if places is None:
            return None
        if limit is None:
            return next((i for i in places if done[i] < self.calls.get(i, 1)), places[-1])
        return next((i for i in reversed(places) if done[i] < limit[i]), places[0])

    def _update_peak_stats(self, peak_state):  # type: ignore[no-untyped-def]
        super()._update_peak_stats(peak_state)
        self._note()

    def _pre_fw_hook(self, module, inputs):  # type: ignore[no-untyped-def]
        super()._pre_fw_hook(module, inputs)
        index = self._place(module, self.forwards_done, None)
        if index is not None and not self._mod_tracker.is_bw:
            self._running[id(module)] = index
            if index not in self.forward_starts and index and all(
                    self.backwards_begun[j] >= self.calls.get(j, 1) for j in range(index)):
                self.fresh.add(index)
            self.pre_fw[index] = current_total(self, self.device)
            self.forward_starts.setdefault(index, self.pre_fw[index])
            self.start_parameters.setdefault(index, self._parameters())
            self._note(("fw", index))

    def _post_fw_hook(self, module, inputs, outputs):  # type: ignore[no-untyped-def]
        super()._post_fw_hook(module, inputs, outputs)
        index = self._running.pop(id(module), None) if not self._mod_tracker.is_bw else None
        if index is not None:
            self.stored[index] += current_total(self, self.device) - self.pre_fw.pop(index)
            self.forwards_done[index] += 1
            self.end_parameters[index] = self._parameters()
            more = self.forwards_done[index] < self.calls.get(index, 1)
            self._note(("fw", index) if more else ("gap", index + 1))

    def _pre_bw_hook(self, module, args):  # type: ignore[no-untyped-def]
        super()._pre_bw_hook(module, args)
        index = self._place(module, self.backwards_begun, self.forwards_done)
        if index is not None:
            self.backwards_begun[index] += 1
            self._note(("bw", index))

    def _post_bw_hook(self, module, args):  # type: ignore[no-untyped-def]
        super()._post_bw_hook(module, args)
        index = self._place(module, self.backwards_done, self.backwards_begun)
        if index is not None:
            self.backwards_done[index] += 1
            if self.backwards_done[index] < self.calls.get(index, 1):
                self.label = ("bw", index)
            elif self.label == ("bw", index):
                self.label = ("gap", 0 if index in self.fresh else index)  # before a fresh place: none alive
            # Otherwise the next stage's backward began already (FSDP2 sees the stage's end after it):
            # the label stays with that stage, whose recompute would otherwise count in a gap.
            self._note()


class TimelineTracker(Tracker):
    """MemTracker that also records the total tracked memory after every operator (outputs in, freed tensors out)
    and the index of the first operator of backward."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.totals: list[int] = []
        self.backward_start: int | None = None

    def _update_peak_stats(self, peak_state):  # type: ignore[no-untyped-def]
        super()._update_peak_stats(peak_state)
        self.totals.append(current_total(self, self.device))
        if self.backward_start is None and self._mod_tracker.is_bw:
            self.backward_start = len(self.totals) - 1
