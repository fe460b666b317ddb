"""A batch's shape (batch size, sequence length), and the same batch at another shape.

Plans follow the batch's shape (``service.shape_plans``): each step's batch is read as a
``core.shape_fit.Shape``, and a profile at a shape no batch has had yet runs on the batch at hand
stretched to that shape (on fake tensors: only its shape matters, and values the model reads to
choose a code path, such as a padding mask, keep the batch's pattern).

- ``batch_shape``: the batch size is the leading size most tensors share; the sequence length is
  the largest second size among the tensors with that leading size, integer tensors (token ids,
  masks) first, else floating ones (embeddings); 1 when no tensor has two dimensions.
- ``resize_batch``: every tensor whose leading size is the batch size is repeated or cut to the new
  batch size along it, and along its second dimension when that is the sequence length: rows and
  positions cycle, so a padded batch stays padded alike.

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.arange(12).view(2, 6), "labels": torch.arange(12).view(2, 6), "scale": 0.5}
    >>> batch_shape(batch)
    Shape(batch_size=2, seq_len=6)
    >>> wider = resize_batch(batch, Shape(3, 8))
    >>> wider["input_ids"].tolist(), wider["scale"]
    ([[0, 1, 2, 3, 4, 5, 0, 1], [6, 7, 8, 9, 10, 11, 6, 7], [0, 1, 2, 3, 4, 5, 0, 1]], 0.5)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, Callable

import torch

from ...core.shapes import Shape


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors in a batch (a tensor, or mappings, lists and tuples of them), in a fixed order.

    Example:
        >>> [t.shape[0] for t in batch_tensors(([torch.zeros(2)], {"y": torch.zeros(3)}, "text"))]
        [2, 3]
    """
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in batch_tensors(value)]
    if isinstance(batch, (list, tuple)):
        return [t for value in batch for t in batch_tensors(value)]
    return []


def batch_shape(batch: Any) -> Shape | None:
    """The batch size and sequence length of a batch; None when it holds no tensor with a dimension.

    Example:
        >>> batch_shape((torch.zeros(4, 3, 32, 32), torch.zeros(4, dtype=torch.long)))  # images: no sequence
        Shape(batch_size=4, seq_len=3)
        >>> batch_shape({"ids": torch.zeros(2, 9, dtype=torch.long), "mask": torch.ones(2, 9)}), batch_shape(3) is None
        (Shape(batch_size=2, seq_len=9), True)
    """
    tensors = [t for t in batch_tensors(batch) if t.dim() >= 1 and t.shape[0] > 0]
    if not tensors:
        return None
    counts = Counter(int(t.shape[0]) for t in tensors)
    batch_size = max(counts, key=lambda size: (counts[size], size))
    wide = [t for t in tensors if t.dim() >= 2 and t.shape[0] == batch_size and t.shape[1] > 0]
    discrete = [t for t in wide if not t.is_floating_point() and not t.is_complex()]
    chosen = discrete or wide
    return Shape(batch_size, max((int(t.shape[1]) for t in chosen), default=1))


def _cycled(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if tensor.shape[dim] == size:
        return tensor
    index = torch.arange(size, device=tensor.device) % tensor.shape[dim]
    return tensor.index_select(dim, index)


def _rebuilt(batch: Any, change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``change`` applied to every tensor, containers rebuilt as their own type."""
    if isinstance(batch, torch.Tensor):
        return change(batch)
    if isinstance(batch, Mapping):
        items = {key: _rebuilt(value, change) for key, value in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(_rebuilt(value, change) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_rebuilt(value, change) for value in batch)
    return batch


def resize_batch(batch: Any, shape: Shape, source: Shape | None = None) -> Any:
    """``batch`` at ``shape``: the tensors whose leading size is the batch size, cycled (or cut)
    along it to ``shape.batch_size``, and along their second dimension to ``shape.seq_len`` where
    that is the sequence length. Other values pass unchanged. ``source`` is the batch's own shape
    (default: ``batch_shape(batch)``).

    Example:
        >>> ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
        >>> resize_batch((ids,), Shape(1, 5))[0].tolist()
        [[5, 6, 0, 5, 6]]
    """
    source = source or batch_shape(batch)
    if source is None or source == shape:
        return batch

    def change(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != source.batch_size:
            return tensor
        tensor = _cycled(tensor, 0, shape.batch_size)
        if tensor.dim() >= 2 and source.seq_len > 1 and tensor.shape[1] == source.seq_len:
            tensor = _cycled(tensor, 1, shape.seq_len)
        return tensor

    return _rebuilt(batch, change)
