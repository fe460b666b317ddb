"""What a plan was made for, in a few numbers: the model's parameters and the batch's size.

A plan holds for the model and batch it was profiled on. A run resumed with another model, or a
batch larger than the profiled one (a longer sequence, a bigger batch), needs a new plan; these
figures, stored in ``Plan.fingerprint``, let an integration notice.

Example:
    >>> import torch
    >>> fp = fingerprint(torch.nn.Linear(4, 4), {"x": torch.zeros(8, 4), "y": [torch.zeros(8)]})
    >>> fp["parameter_bytes"], fp["batch_elements"], fp["batch_shapes"]
    (80, 40, '(8, 4) (8,)')
    >>> outgrows(fp, {"x": torch.zeros(32, 4), "y": [torch.zeros(32)]})
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]


def batch_elements(batch: Any) -> int:
    """Elements in all tensors of a batch (the size a plan scales with)."""
    return sum(t.numel() for t in _tensors(batch))


def fingerprint(model: nn.Module, batch: Any) -> dict[str, Any]:
    """Parameter bytes (all, trainable) and the batch's elements and shapes."""
    return {
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "trainable_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        "batch_elements": batch_elements(batch),
        "batch_shapes": " ".join(str(tuple(t.shape)) for t in _tensors(batch)),
    }


def same_model(saved: dict[str, Any], model: nn.Module) -> bool:
    """Whether ``model`` has the parameters a plan's fingerprint records (True if none is recorded)."""
    if "parameter_bytes" not in saved:
        return True
    now = fingerprint(model, None)
    return (saved["parameter_bytes"], saved.get("trainable_bytes")) == (now["parameter_bytes"], now["trainable_bytes"])


def outgrows(saved: dict[str, Any], batch: Any) -> bool:
    """Whether ``batch`` is larger than the one the plan was profiled on (False if none is recorded)."""
    return "batch_elements" in saved and batch_elements(batch) > saved["batch_elements"]
