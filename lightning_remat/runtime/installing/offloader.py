"""``Offloader``, a pack/unpack pair for ``saved_tensors_hooks``: when a stage's forward ends, each saved storage
goes to the host once (pinned, on a side stream), held on the device until the next stage ran so the copy
overlaps compute; backward prefetches one stage ahead. ``measure=True`` keeps only meta tensors."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor, or a DTensor (FSDP2's sharded parameter) whose local shard is one.

    >>> is_fake(torch.ones(1))
    False
    """
    return isinstance(getattr(tensor, "_local_tensor", tensor), FakeTensor)


@dataclass(eq=False, slots=True, weakref_slot=True)
class _Packed:
    """One saved tensor while it is away: its host copy, and its device self while in flight."""

    group: _Group
    device_tensor: torch.Tensor | None = None
    host: torch.Tensor | None = None
    event: Any = None
    back: torch.Tensor | None = None
    back_event: Any = None
    device: torch.device | None = None
    # A view of a storage sent once as a whole (``base``): (size, stride, storage offset).
    base: _Packed | None = None
    view: tuple | None = None


class _Group:
    """The tensors one forward call of one offloaded module saved."""

    def __init__(self, name: str):
        self.name = name
        # Weak: a tensor lives as long as autograd holds it, and no longer.
        self.handles: list[weakref.ref] = []
        self.pending: list[_Packed] = []  # with a limit: chosen when the forward ends
        self.unpacked = False
        self.released = False

    def live(self) -> list[_Packed]:
        return [h for h in (r() for r in self.handles) if h is not None]


class Offloader:
    """The pack/unpack pair shared by the offloaded modules of one model; ``host_bytes`` per module."""

    def __init__(self, measure: bool = False, limits: dict[str, int] | None = None,
                 order: Sequence[str] | None = None):
        self.measure = measure
        self.limits = dict(limits or {})  # name -> bytes offloaded at most per forward call
        self.order = tuple(order) if order is not None else None  # every stage in execution order
        self.host_bytes: dict[str, int] = {}
        self.latest: dict[str, weakref.ref] = {}  # name -> its group of the current step
        self.prefetched: dict[str, int] = {}  # name -> tensors brought back ahead of their backward
        self._in_flight: list[tuple[weakref.ref, bool]] = []  # (group, released by its next stage's hook)
        self._stream: Any = None
        self._protected: set[int] = set()

    def _side_stream(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _to_host(self, handle: _Packed, t: torch.Tensor) -> None:
        handle.device = t.device
        stream = self._side_stream(t.device)
        if stream is None:
            handle.host = t.detach().to("cpu", copy=True)
            return
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t.detach(), non_blocking=True)
            handle.event = torch.cuda.Event()
            handle.event.record(stream)
        handle.host = host
        handle.device_tensor = t  # held until the copy is surely done (``_release``)

    def _to_device(self, handle: _Packed, stream: Any) -> torch.Tensor:
        assert handle.host is not None and handle.device is not None
        if handle.host.device.type == "meta":
            return torch.empty_strided(handle.host.size(), handle.host.stride(), dtype=handle.host.dtype,
                                       device=handle.device)
        if stream is None:
            return handle.host.to(handle.device, copy=True)
        return handle.host.to(handle.device, non_blocking=True)

    def _release(self, group: _Group) -> None:
        """Drop the device copies of ``group``'s tensors once their copies to the host are done."""
        if group.released:
            return
        group.released = True
        for handle in group.live():
            if handle.host is None:
                continue  # not offloaded (beyond the limit): the handle keeps the tensor
            if handle.event is not None:
                # Later work on the compute stream waits for the copy, so the memory is free to reuse.
                torch.cuda.current_stream(handle.device).wait_event(handle.event)
            handle.device_tensor = None

    def _prefetch(self, group: _Group) -> None:
        for handle in group.live():
            if handle.back is not None or handle.device_tensor is not None or handle.host is None:
                continue
            self.prefetched[group.name] = self.prefetched.get(group.name, 0) + 1
            stream = None if handle.host.device.type == "meta" else self._side_stream(handle.device)
            if stream is None:
                handle.back = self._to_device(handle, None)
                continue
            stream.wait_stream(torch.cuda.current_stream(handle.device))
            with torch.cuda.stream(stream):
                handle.back = self._to_device(handle, stream)
                handle.back_event = torch.cuda.Event()
                handle.back_event.record(stream)

    def begin(self, name: str, module: nn.Module, inputs: Any = ()) -> _Group:
        """A new forward call of ``name``: a new group of saved tensors."""
        group = _Group(name)
        self.latest[name] = weakref.ref(group)
        self._protected = {t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers()]}
        self._device = next(iter([*module.parameters(), *module.buffers()]), torch.empty(0)).device
        # The module's inputs: the caller holds them anyway, so offloading them frees nothing.
        group.inputs = {t.untyped_storage()._cdata for t in torch.utils._pytree.tree_leaves(inputs)
                        if isinstance(t, torch.Tensor)}
        return group

    def end(self, group: _Group, has_release_hook: bool) -> None:
        """The forward of ``group`` ended: send its storages, release earlier ones, keep it until its next stage ran."""
        if group.pending:
            # Whole storages go, largest first: a tensor whose storage another saved tensor (a view)
            # still holds frees nothing.
            by_storage: dict[int, list[_Packed]] = {}
            for handle in group.pending:
                by_storage.setdefault(handle.device_tensor.untyped_storage()._cdata, []).append(handle)
            sizes = {k: hs[0].device_tensor.untyped_storage().nbytes() for k, hs in by_storage.items()}
            # Without a limit ("offload") every storage goes, the module's inputs too (its caller
            # drops them once it returns); with one ("offload:hidden"), not the inputs.
            limit, sent = self.limits.get(group.name), 0
            for key in sorted(by_storage, key=lambda k: -sizes[k]):
                handles = by_storage[key]
                first = handles[0].device_tensor
                if ((limit is not None and (key in group.inputs or sent + sizes[key] > limit))
                        or any(h.device_tensor.dtype != first.dtype for h in handles)):
                    continue
                sent += sizes[key]
                # The storage goes once; each saved tensor comes back as a view of it.
                base = _Packed(group)
                group.handles.append(weakref.ref(base))
                numel = sizes[key] // first.element_size()
                if self.measure or is_fake(first):  # a fake tensor's "host" copy: metadata only
                    base.device = first.device
                    base.host = torch.empty(numel, dtype=first.dtype, device="meta")
                else:
                    self._to_host(base, first.new_empty(0).set_(first.untyped_storage(), 0, (numel,), (1,)))
                self.host_bytes[group.name] = self.host_bytes.get(group.name, 0) + sizes[key]
                for handle in handles:
                    t, handle.device_tensor = handle.device_tensor, None
                    handle.base, handle.view = base, (t.size(), t.stride(), t.storage_offset())
            group.pending = []
        waiting = []
        for ref, hooked in self._in_flight:
            earlier = ref()
            if earlier is not None and not hooked:
                self._release(earlier)
            elif earlier is not None:
                waiting.append((ref, hooked))
        self._in_flight = [*waiting, (weakref.ref(group), has_release_hook)]

    def pack(self, group: _Group, t: torch.Tensor) -> Any:
        if t.device != self._device or t.untyped_storage()._cdata in self._protected:
            return t
        handle = _Packed(group)
        group.handles.append(weakref.ref(handle))
        # Which tensors go is decided when the forward ends (each storage once; with a limit, the
        # largest up to it): until then, and for those that stay, the handle holds the tensor itself.
        handle.device_tensor = t
        group.pending.append(handle)
        return handle

    def _whole(self, base: _Packed) -> torch.Tensor:
        """A storage sent as a whole, back on the device (kept while its views are unpacked)."""
        if base.device_tensor is not None:
            return base.device_tensor
        if base.back is None:
            base.back = self._to_device(base, None)
        elif base.back_event is not None:
            current = torch.cuda.current_stream(base.device)
            current.wait_event(base.back_event)
            base.back.record_stream(current)  # allocated on the side stream, used on this one
            base.back_event = None
        return base.back

    def unpack(self, handle: Any) -> torch.Tensor:
        if not isinstance(handle, _Packed):
            return handle
        group = handle.group
        if not group.unpacked:
            # This stage's backward starts: whatever is still in flight is surely copied by now.
            group.unpacked = True
            for ref, _ in self._in_flight:
                earlier = ref()
                if earlier is not None:
                    self._release(earlier)
            self._in_flight = []
        # Only whole storages are sent (``end``): a saved tensor is a view of one, or still on the device.
        if handle.base is not None:
            return self._whole(handle.base).as_strided(*handle.view)
        return handle.device_tensor


def _prefetch_hook(ref: weakref.ref, offloader: Offloader, grad: torch.Tensor) -> None:
    group = ref()
    if group is not None and not group.unpacked:
        offloader._prefetch(group)


def offloaded_call(offloader: Offloader, name: str, module: nn.Module, release_hook: bool, run: Callable[..., Any],
                   /, *args: Any, **kwargs: Any) -> Any:
    """``run(*args, **kwargs)`` with what it saves for backward sent to the host as module ``name``
    (``release_hook``: the next stage's forward releases this call's device tensors)."""
    if not torch.is_grad_enabled():
        return run(*args, **kwargs)
    group = offloader.begin(name, module, (args, kwargs))
    with torch.autograd.graph.saved_tensors_hooks(functools.partial(offloader.pack, group), offloader.unpack):
        out = run(*args, **kwargs)
    offloader.end(group, release_hook)
    return out


def release_after_next(offloader: Offloader, name: str) -> Callable[..., None]:
    """A forward hook for the stage after ``name``: releases ``name``'s device tensors, prefetches them in backward."""

    def after_next(_m: nn.Module, _args: Any, out: Any) -> None:
        ref = offloader.latest.get(name)
        group = ref() if ref is not None else None
        if group is None or not torch.is_grad_enabled():
            return
        offloader._release(group)
        leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            leaves[0].register_hook(functools.partial(_prefetch_hook, weakref.ref(group), offloader))

    return after_next
