"""A batch's shape (``core.shapes.Shape``), and the same batch stretched to another shape (values cycled)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, Callable

import torch

from ...core.shapes import BATCH, SEQUENCE, Shape


def path_in(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def named_tensors(batch: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors in a batch (nested mappings, lists, tuples) with their ``.``-joined paths, in a fixed order."""
    if isinstance(batch, torch.Tensor):
        return [(prefix, batch)]
    if isinstance(batch, Mapping):
        return [named for key, value in batch.items() for named in named_tensors(value, path_in(prefix, key))]
    if isinstance(batch, (list, tuple)):
        return [named for i, value in enumerate(batch) for named in named_tensors(value, path_in(prefix, i))]
    return []


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors in a batch (a tensor, or mappings, lists and tuples of them), in a fixed order."""
    return [tensor for _, tensor in named_tensors(batch)]


def marked_size(size: tuple[int, ...], batch_size: int, seq_len: int) -> tuple[int, ...]:
    """A tensor's size as its layout entry writes it: a leading batch size is ``BATCH``, then a sequence ``SEQUENCE``.

    Example:
        >>> marked_size((4, 128, 16), 4, 128), marked_size((4, 3, 32, 32), 4, 1), marked_size((7,), 4, 1)
        ((-1, -2, 16), (-1, 3, 32, 32), (7,))
    """
    marked = [int(n) for n in size]
    if marked and marked[0] == batch_size:
        marked[0] = BATCH
        if len(marked) >= 2 and seq_len > 1 and marked[1] == seq_len:
            marked[1] = SEQUENCE
    return tuple(marked)


def batch_shape(batch: Any) -> Shape | None:
    """The shape of a batch (None: no tensor with a dimension): the leading size most tensors share, the largest
    second size of its 2-D *integer* tensors (token ids, masks; else 1), every tensor's size by path."""
    named = named_tensors(batch)
    sized = [t for _, t in named if t.dim() >= 1 and t.shape[0] > 0]
    if not sized:
        return None
    counts = Counter(int(t.shape[0]) for t in sized)
    batch_size = max(counts, key=lambda size: (counts[size], size))
    # Token ids, masks, labels: integer tensors of (batch, sequence). A floating-point tensor's second
    # size may be anything (an image's channels), so its sizes go to the layout, never the sequence.
    tokens = [t for t in sized if t.dim() == 2 and t.shape[0] == batch_size and not t.is_floating_point()
              and not t.is_complex()]
    seq_len = max([1, *(int(t.shape[1]) for t in tokens)])
    return Shape(batch_size, seq_len, tuple((path, marked_size(tuple(t.shape), batch_size, seq_len))
                                            for path, t in named))


def size_at(path: str, size: tuple[int, ...], source: Shape, target: Shape) -> tuple[int, ...]:
    """The size at ``target`` of the tensor at ``path``: its layout entry, else its own with new batch and sequence."""
    if target.layout:
        return target.sizes(path)
    marked = marked_size(size, source.batch_size, source.seq_len)
    return tuple({BATCH: target.batch_size, SEQUENCE: target.seq_len}.get(n, n) for n in marked)


def cycled(tensor: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` at ``size`` (as many dimensions), each dimension's entries cycled or cut to it."""
    for dim, wanted in enumerate(size):
        if tensor.shape[dim] != wanted:
            index = torch.arange(wanted, device=tensor.device) % tensor.shape[dim]
            tensor = tensor.index_select(dim, index)
    return tensor


def rebuilt(batch: Any, change: Callable[[str, torch.Tensor], Any], prefix: str = "") -> Any:
    """``batch`` with ``change(path, tensor)`` applied to every tensor, containers rebuilt as their own type."""
    if isinstance(batch, torch.Tensor):
        return change(prefix, batch)
    if isinstance(batch, Mapping):
        items = {key: rebuilt(value, change, path_in(prefix, key)) for key, value in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(rebuilt(value, change, path_in(prefix, i)) for i, value in enumerate(batch)))
    if isinstance(batch, (list, tuple)):
        return type(batch)(rebuilt(value, change, path_in(prefix, i)) for i, value in enumerate(batch))
    return batch


def resize_batch(batch: Any, shape: Shape) -> Any:
    """``batch`` at ``shape``: every tensor cycled or cut along each dimension; other values pass unchanged.

    Example:
        >>> ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
        >>> resize_batch((ids,), Shape(1, 5))[0].tolist()
        [[5, 6, 0, 5, 6]]
    """
    source = batch_shape(batch)
    if source is None or source == shape:
        return batch
    if shape.layout and not source.comparable(shape):
        raise ValueError(f"a batch of shape {source} cannot be stretched to {shape}: another layout")
    return rebuilt(batch, lambda path, tensor: cycled(tensor, size_at(path, tuple(tensor.shape), source, shape)))


def padding(batch: Any) -> bool | None:
    """Whether a batch's attention masks hold padding (None: no mask). Hugging Face builds no mask for a batch
    without padding, which then needs less memory: its plan is no plan for a padded one. Reading the values syncs
    with the device once, as Hugging Face's own ``padding_mask.all()`` does every forward.

    Example:
        >>> ones, padded = torch.ones(2, 4, dtype=torch.long), torch.tensor([[0, 1, 1], [1, 1, 1]])
        >>> padding({"input_ids": ones, "attention_mask": ones}), padding({"attention_mask": padded}), padding(ones)
        (False, True, None)
    """
    masks = [t for path, t in named_tensors(batch) if path.split(".")[-1] == "attention_mask" and t.dim() == 2
             and not t.is_floating_point() and not t.is_complex()]
    return None if not masks else any(not bool(mask.all()) for mask in masks)
