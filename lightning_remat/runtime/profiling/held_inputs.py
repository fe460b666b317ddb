"""Inputs a recomputed stage's checkpoint keeps alive that would otherwise be freed (a frozen embedding's output
under LoRA), counted in the stage's own stored bytes so the model stays additive."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..measuring.exclusive import planning_runs_here


def _tensors(args: tuple, kwargs: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) for a call's tensor arguments, one level into tuples and lists (``position_embeddings``)."""
    items = [(str(i), a) for i, a in enumerate(args)] + [(k, v) for k, v in kwargs.items()]
    for key, value in items:
        if isinstance(value, torch.Tensor):
            yield key, value
        elif isinstance(value, (tuple, list)):
            for j, inner in enumerate(value):
                if isinstance(inner, torch.Tensor):
                    yield f"{key}.{j}", inner


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The view base of ``tensor``: FSDP2's pre-forward passes a block views of its arguments, new objects that
    die with the forward while the tensor they view (an earlier stage's output) lives on."""
    return tensor if tensor._base is None else tensor._base


def _storage_bytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a functional wrapper)
        return int(tensor.numel() * tensor.element_size())


def _ident(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr() or id(_root(tensor))
    except (RuntimeError, NotImplementedError):  # fake or functional tensors: the object owning it stands for it
        return id(_root(tensor))


class DeadInputs(contextlib.ExitStack):
    """Finds, on a pass with nothing recomputed, each stage's tensor arguments freed by the end of the forward
    (enter it around the forward, call ``check()`` before backward; leaving it removes its hooks)."""

    def __init__(self, model: nn.Module, order: Sequence[str], dead: dict[str, set[str]] | None = None):
        super().__init__()
        self.model, self.order = model, list(dict.fromkeys(order))
        self.dead = {} if dead is None else dead
        self._refs: dict[str, list[tuple[str, Any]]] = {name: [] for name in self.order}
        self._outputs: dict[int, Any] = {}  # id -> weak reference (a tensor's == is elementwise)

    def __enter__(self) -> "DeadInputs":
        modules = dict(self.model.named_modules())
        for name in self.order:
            def hook(module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
                if self._refs[name] or not planning_runs_here():  # not another thread's forward
                    return
                for key, tensor in _tensors(args, kwargs):
                    tensor = _root(tensor)  # dead when no tensor holds its storage, not when a view object dies
                    ref = self._outputs.get(id(tensor))
                    if ref is not None and ref() is tensor:
                        # An earlier stage's output: that stage's stored bytes hold it already (the
                        # profile's later terms absorb its early free), so it is not held anew.
                        continue
                    self._refs[name].append((key, weakref.ref(tensor)))

            def leave(module: nn.Module, args: tuple, output: Any) -> None:
                if not planning_runs_here():
                    return
                for _, tensor in _tensors((output,), {}):
                    tensor = _root(tensor)
                    self._outputs[id(tensor)] = weakref.ref(tensor)
            self.enter_context(modules[name].register_forward_pre_hook(hook, with_kwargs=True))
            self.enter_context(modules[name].register_forward_hook(leave))
        return self

    def check(self) -> dict[str, set[str]]:
        """Record which arguments are dead now (call after the forward, before backward)."""
        for name in self.order:
            self.dead[name] = {key for key, ref in self._refs[name] if ref() is None}
        return self.dead


class HeldInputs(contextlib.ExitStack):
    """During a memory run, the bytes of the dead arguments each recomputed stage (or recomputed child) receives."""

    def __init__(self, model: nn.Module, order: Sequence[str], dead: dict[str, set[str]], recomputed: Sequence[str],
                 calls: Sequence[int] | None = None):
        super().__init__()
        # ``order``: the chain's places (a module may stand at several); ``calls``: the calls at each.
        self.model, self.order, self.dead, self.calls = model, list(order), dead, list(calls or [])
        self.recomputed = set(recomputed)
        self.bytes = [0] * len(self.order)
        self._holders: dict[int, list[tuple[int, int]]] = {}  # storage -> [(stage, bytes)]
        self._labels: dict[int, str] = {}  # storage -> "first stage:its argument" (core.shared_held)

    @property
    def exclusive(self) -> list[int]:
        """Per stage, the held bytes no other stage of this run holds (later terms are taken relative to these)."""
        out = list(self.bytes)
        for holders in self._holders.values():
            if len({i for i, _ in holders}) > 1:
                for i, nbytes in holders:
                    out[i] -= nbytes
        return out

    def _shared(self) -> Iterator[tuple[str, int, list[int]]]:
        """(label, bytes, holding stages) of each tensor several stages of this run hold."""
        for ident, holders in self._holders.items():
            stages = sorted({i for i, _ in holders})
            if len(stages) > 1:
                yield self._labels[ident], max(b for _, b in holders), stages

    @property
    def shared(self) -> list[tuple[tuple[str, int], ...]]:
        """Per stage, the (label, bytes) of what other stages hold too, named after the first stage receiving it."""
        out: list[list[tuple[str, int]]] = [[] for _ in self.order]
        for label, nbytes, stages in self._shared():
            for i in stages:
                out[i].append((label, nbytes))
        return [tuple(sorted(pairs)) for pairs in out]

    def held_before(self, k: int) -> tuple[tuple[str, int], ...]:
        """The shared tensors a stage before ``k`` holds: alive all through stage ``k``, so its figures count them."""
        return tuple(sorted((label, nbytes) for label, nbytes, stages in self._shared() if stages[0] < k))

    def __enter__(self) -> "HeldInputs":
        modules = dict(self.model.named_modules())
        places: dict[str, list[int]] = {}  # a module whose calls other stages separate stands at several
        for i, name in enumerate(self.order):
            places.setdefault(name, []).append(i)
        for name, at in places.items():
            if not self.dead.get(name):
                continue
            # Recomputed children of the stage (an "attn" or "mlp" option) hold what the stage
            # passes them unchanged (cos, sin, position ids): those of its dead arguments.
            children = [c for c in self.recomputed if c.startswith(name + ".")]
            if name not in self.recomputed and not children:
                continue
            self._watch(modules, name, at, children)
        return self

    def _watch(self, modules: dict[str, nn.Module], name: str, at: list[int], children: list[str]) -> None:
        """Hooks that count what the stage ``name`` (at places ``at``) and its recomputed ``children`` hold."""
        calls = self.calls or [1] * len(self.order)
        # The forward call that opens each place (the calls between belong to the place before);
        # calls after the last are recomputes.
        opening = {sum(calls[j] for j in at[:k]): i for k, i in enumerate(at)}
        total = sum(calls[j] for j in at)
        outside: dict[int, tuple[str, int]] = {}  # storage -> (argument, bytes): the stage's dead arguments
        counted: set[int] = set()
        state = {"calls": 0, "place": at[0]}

        def count(tensors: Iterator[tuple[str, torch.Tensor]], keep: Callable[[str, int], bool]) -> None:
            i = state["place"]
            for key, tensor in tensors:
                ident = _ident(tensor)
                if keep(key, ident) and (i, ident) not in counted:  # a tensor passed twice, or two views
                    counted.add((i, ident))
                    nbytes = _storage_bytes(tensor)
                    self.bytes[i] += nbytes
                    self._holders.setdefault(ident, []).append((i, nbytes))
                    # Named by the stage's own argument (a child's is the same tensor under its name).
                    self._labels.setdefault(ident, f"{self.order[i]}:{outside.get(ident, (key,))[0]}")

        def stage_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not planning_runs_here():  # another thread's forward of the same model
                return
            call = state["calls"]
            state["calls"] += 1
            if call not in opening or call >= total:
                return  # as DeadInputs: the first call of each place (not the others, nor the recompute)
            state["place"] = opening[call]
            dead = self.dead[name]
            for key, tensor in _tensors(args, kwargs):
                if key in dead:
                    outside[_ident(tensor)] = (key, _storage_bytes(tensor))
            if name in self.recomputed:
                count(_tensors(args, kwargs), lambda key, ident: key in dead)

        def child_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if planning_runs_here():
                count(_tensors(args, kwargs), lambda key, ident: ident in outside)

        self.enter_context(modules[name].register_forward_pre_hook(stage_hook, with_kwargs=True))
        for child in children:
            self.enter_context(modules[child].register_forward_pre_hook(child_hook, with_kwargs=True))
