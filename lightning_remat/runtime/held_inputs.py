"""Inputs a recomputed stage keeps alive that would otherwise be freed: a term of its stored bytes.

A recomputed module (``torch.utils.checkpoint``, with or without a selective-checkpointing policy)
holds its forward's arguments until its backward, to run the forward again. Most of them are alive
anyway (the previous stage's output, which the previous stage stores). Some are not: with a frozen
embedding (LoRA), the first layer's input needs no gradient, so a kept first layer saves nothing of
it and it is freed after that layer's forward; small tensors every layer receives
(``cache_position``) are freed after the forward too. Recomputing the stage keeps them to its
backward, so every later stage's peak sees them.

The profiler measured them inside the *later* stages' terms of the run where the stage was
recomputed, which made a plan that recomputes an early stage and keeps a later one
under-predicted (a LoRA Llama: +65,536 B, the embedding's output, +1.3% over the prediction and
over the budget). Counting them in the recomputed stage's own stored bytes (alive from its forward
to its backward, exactly what stored bytes mean) makes the model additive again.

Two steps: ``dead_inputs`` finds, on a pass with nothing recomputed, which arguments of each stage
are freed by the end of the forward; ``HeldInputs`` counts, during a memory run, the bytes of those
arguments each recomputed stage receives. A tensor several recomputed stages receive is counted
for each: the model then over-counts it (by a few hundred bytes for ``cache_position``) but never
misses it, whichever of them a plan recomputes.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    >>> _ = net[0].requires_grad_(False)
    >>> x = torch.randn(4, 8)
    >>> dead = dead_inputs(net, lambda m: m(x).sum(), ["0", "1"])
    >>> dead  # net[0] is frozen: nothing saves x; net[1] saves its input for its weight's gradient
    {'0': {'0'}, '1': set()}
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn


def _tensors(args: tuple, kwargs: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) for the tensor arguments of a call, one level into tuples and lists (the
    ``position_embeddings=(cos, sin)`` of transformers' layers)."""
    items = [(str(i), a) for i, a in enumerate(args)] + [(k, v) for k, v in kwargs.items()]
    for key, value in items:
        if isinstance(value, torch.Tensor):
            yield key, value
        elif isinstance(value, (tuple, list)):
            for j, inner in enumerate(value):
                if isinstance(inner, torch.Tensor):
                    yield f"{key}.{j}", inner


def _storage_bytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a functional wrapper)
        return int(tensor.numel() * tensor.element_size())


def dead_inputs(model: nn.Module, step: Callable[[nn.Module], torch.Tensor], order: Sequence[str],
                before_pass: Callable[[], None] | None = None) -> dict[str, set[str]]:
    """Per stage, the keys of its tensor arguments that are freed by the end of a forward with
    nothing recomputed (nothing saves them for backward and nothing else refers to them).

    One forward of ``step`` runs (gradients enabled, no backward). Tensors of a stage's own inner
    stages are not arguments of it and are not looked at.
    """
    modules = dict(model.named_modules())
    refs: dict[str, list[tuple[str, Any]]] = {name: [] for name in order}
    handles = []
    for name in order:
        def hook(module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            if refs[name]:
                return  # a stage called several times: its first call stands for the others
            for key, tensor in _tensors(args, kwargs):
                try:
                    refs[name].append((key, weakref.ref(tensor)))
                except TypeError:
                    pass
        handles.append(modules[name].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        if before_pass is not None:
            before_pass()
        loss = step(model)
        dead = {name: {key for key, ref in refs[name] if ref() is None} for name in order}
        del loss
    finally:
        for handle in handles:
            handle.remove()
    return dead


class HeldInputs:
    """During a memory run, the bytes of the dead arguments (``dead_inputs``) each recomputed stage
    receives: what its checkpoint keeps alive beyond what the stages' own forwards leave.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        >>> with HeldInputs(net, ["0", "1"], {"0": {"0"}, "1": set()}, recomputed=["0"]) as held:
        ...     _ = net(torch.randn(4, 8))
        >>> held.bytes
        [128, 0]
    """

    def __init__(self, model: nn.Module, order: Sequence[str], dead: dict[str, set[str]], recomputed: Sequence[str]):
        self.model, self.order, self.dead = model, list(order), dead
        self.recomputed = set(recomputed)
        self.bytes = [0] * len(self.order)
        self._handles: list[Any] = []

    def __enter__(self) -> "HeldInputs":
        modules = dict(self.model.named_modules())
        seen: dict[int, bool] = {}
        for i, name in enumerate(self.order):
            if name not in self.recomputed or not self.dead.get(name):
                continue

            def hook(module: nn.Module, args: tuple, kwargs: dict, i: int = i, name: str = name) -> None:
                if seen.get(i):
                    return  # as ``dead_inputs``: the first call of a stage
                seen[i] = True
                storages = set()
                for key, tensor in _tensors(args, kwargs):
                    if key not in self.dead[name]:
                        continue
                    try:
                        ident = tensor.untyped_storage().data_ptr() or id(tensor)
                    except (RuntimeError, NotImplementedError):
                        ident = id(tensor)
                    if ident not in storages:  # a tensor passed twice, or two views of one storage
                        storages.add(ident)
                        self.bytes[i] += _storage_bytes(tensor)
            self._handles.append(modules[name].register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
