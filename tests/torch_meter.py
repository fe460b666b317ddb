"""A window's peak memory measured by torch, independently of the package's own trackers and meter.

``torch.profiler`` (``profile_memory=True``) records every allocation and free of the process. A
window's peak is the memory alive at its start (the model's parameters, buffers and gradients, the
optimizers' state) plus the largest running sum of the allocation events inside it. It sees
whatever runs in the window (several forwards of an accumulation window, a profiling pass of the
package) and does not conflict with a ``MemTracker`` the package opens (it is not a dispatch mode).
Inputs made before the window are not counted, as MemTracker does not count them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.profiler import ProfilerActivity, profile


def inner_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside ``optimizers`` (one, a list, or wrappers of Accelerate, Lightning, Fabric)."""
    if optimizers is None:
        return []
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]
    found = []
    for optimizer in optimizers:
        while not type(optimizer).__module__.startswith("torch.optim"):
            inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
            if inner is None:
                break
            optimizer = inner
        found.append(optimizer)
    return found


def _allocation_peak(prof: profile, alive: set[int] = frozenset()) -> int:
    """The largest running sum of the CPU allocation events a stopped profiler recorded (>= 0).

    Only frees of blocks allocated inside the window, or counted alive at its start (``alive``: the
    addresses of the model's and optimizers' storages then, such as last step's gradients that
    Lightning's ``zero_grad`` frees inside the step), count: the profiler remembers the sizes of
    blocks allocated while an earlier profiler ran, and reports their frees too (garbage of an
    earlier window, collected by Python's cycle collector inside this one), which would pull the
    running sum below what this window's own allocations reached."""
    from torch._C._profiler import _EventType

    found, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            found.append(node)
        stack.extend(node.children)
    running = peak = 0
    inside: set[int] = set()  # addresses of the blocks allocated in the window and not freed yet
    counted = set(alive)  # blocks counted alive at the start, not freed yet
    for node in sorted(found, key=lambda n: n.start_time_ns):
        size, address = node.extra_fields.alloc_size, node.extra_fields.ptr
        if size < 0 and address not in inside and address not in counted:
            continue
        if size > 0:
            inside.add(address)
        elif address in inside:
            inside.discard(address)
        else:
            counted.discard(address)
        running += size
        peak = max(peak, running)
    return peak


def alive_storages(model: torch.nn.Module, optimizers: Any = None) -> dict[int, int]:
    """Address -> bytes of the distinct storages of the model's parameters, buffers and gradients and
    of the optimizers' state."""
    storages: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    for optimizer in inner_optimizers(optimizers):
        tensors += [v for state in optimizer.state.values() for v in state.values()]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return storages


def alive_bytes(model: torch.nn.Module, optimizers: Any = None) -> int:
    """Bytes of the distinct storages of the model's parameters, buffers and gradients and of the
    optimizers' state."""
    return sum(alive_storages(model, optimizers).values())


class TorchPeak:
    """The peak of a window opened in one hook (``start``) and closed in another (``stop``)."""

    def __init__(self, model: torch.nn.Module, optimizers: Any = None):
        self.model, self.optimizers = model, optimizers
        self.prof: profile | None = None
        self.alive, self.addresses = 0, set()

    def start(self) -> "TorchPeak":
        storages = alive_storages(self.model, self.optimizers)
        self.alive, self.addresses = sum(storages.values()), set(storages)
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.start()
        return self

    def stop(self) -> int:
        prof, self.prof = self.prof, None
        prof.stop()
        return self.alive + _allocation_peak(prof, self.addresses)


def steady_peak(model: torch.nn.Module, step: Any, optimizer: torch.optim.Optimizer, steps: int = 3) -> int:
    """The largest ``TorchPeak`` of ``steps - 1`` training steps, after a first that creates the optimizer state."""
    peaks = []
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        meter = TorchPeak(model, optimizer).start() if i else None
        step(model).backward()
        optimizer.step()
        if meter is not None:
            peaks.append(meter.stop())
    return max(peaks)


def static_bytes(model: torch.nn.Module, optimizers: Sequence[Any] | Any = None) -> int:
    """Parameters, buffers, a gradient per trainable parameter and the optimizers' state: what a
    steady step holds before its forward, gradients included."""
    storages: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    for optimizer in inner_optimizers(optimizers):
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values()) + sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def lightning_peaks() -> Any:
    """A Lightning callback that measures every training batch's peak (``.peaks``) and keeps its loss
    (``.losses``). Put it first among the callbacks: its window opens before the package plans in
    ``on_train_batch_start``, so planning counts too."""
    import lightning.pytorch as L

    class Peaks(L.Callback):
        def __init__(self) -> None:
            self.peaks: list[int] = []
            self.losses: list[float] = []
            self.meter: TorchPeak | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.meter = TorchPeak(pl_module, trainer.optimizers).start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.peaks.append(self.meter.stop())
            self.losses.append(float(outputs["loss"]))

    return Peaks()


class EverythingPeak(TorchPeak):
    """``TorchPeak`` counting every CPU tensor alive at the window's start (found by the garbage collector), not
    only the model's and optimizers': DeepSpeed keeps its master partition, optimizer state and buffers in tensors
    of its own."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Module())

    def start(self) -> "EverythingPeak":
        import gc

        gc.collect()
        storages: dict[int, int] = {}
        for t in gc.get_objects():
            if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu":  # not fake ones
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        storages.pop(0, None)  # empty storages
        self.alive, self.addresses = sum(storages.values()), set(storages)
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.start()
        return self


def fake_plan_peak(model: torch.nn.Module, step: Any, plan: Any) -> int:
    """MemTracker's peak of one step with ``plan`` applied to a fake bf16 copy of ``model``, attention as an H100
    runs it (as a fake profile for a GPU does): how a plan with offloaded inputs is checked on the CPU."""
    import warnings

    from lightning_remat import apply_plan, remove_remat
    from lightning_remat.runtime.measuring.tracking import Tracker, snapshot_by_category
    from lightning_remat.runtime.targets.fake import fake_model, new_fake_mode, real_code_paths
    from lightning_remat.runtime.targets.fake_attention import cuda_attention

    mode = new_fake_mode()
    fake = fake_model(model, mode, torch.bfloat16)
    with mode:
        apply_plan(fake, plan)
        tracker = Tracker()
        tracker.track_external(fake)
        with tracker, warnings.catch_warnings(), real_code_paths(), cuda_attention(True):
            warnings.simplefilter("ignore")
            loss = step(fake)
            loss.backward()
            del loss
        peak = snapshot_by_category(tracker.get_tracker_snapshot("peak"), torch.device("cpu"))["Total"]
        remove_remat(fake)
    return peak
