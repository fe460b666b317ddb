"""Offload activations: what a module's forward saves for backward goes to host memory, and comes back.

``apply_offload(model, names)`` has the one installer (``installer.py``) run each named module's
forward under ``torch.autograd.graph.saved_tensors_hooks`` (its ``forward`` an instance attribute:
names, ``state_dict`` and parameters unchanged), with the pack/unpack pair of ``offloader.py``.

How the saved tensors travel (held until the forward ends, copied once per storage to pinned host
memory on a side stream, prefetched one stage ahead in backward) is ``offloader.py``'s docstring.
Values are copied bit for bit, and nothing touches RNG state or buffers, so gradients, dropout masks
and BatchNorm statistics are those of the plain model.

Example:
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    >>> _ = apply_offload(net, ["1"])
    >>> net(torch.randn(2, 4, requires_grad=True)).sum().backward()
    >>> offloaded_modules(net), remove_offload(net) is net, offloaded_modules(net)
    (['1'], True, [])
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

from . import installer
from .offloader import Offloader

__all__ = ["Offloader", "apply_offload", "model_offloader", "offloaded_modules", "remove_offload"]


def offloaded_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` whose saved tensors are offloaded.

    Example:
        >>> offloaded_modules(nn.Linear(2, 2))
        []
    """
    return installer.offloaded(model)


def model_offloader(model: nn.Module) -> Offloader | None:
    """The ``Offloader`` shared by ``model``'s offloaded modules (None without any)."""
    return installer.offloader_of(model)


def apply_offload(model: nn.Module, names: Iterable[str], order: Sequence[str] | None = None,
                  measure: bool = False, limits: dict[str, int] | None = None) -> nn.Module:
    """Offload, in place, what the named modules save for backward; returns ``model``.

    Args:
        names: module names (as in ``model.named_modules()``); none inside another.
        order: every stage in execution order (a plan's stages): with it, a stage's tensors leave
            the device once the next stage's forward ran, and start coming back (prefetch) when
            the next stage's backward starts (the gradient of its output is computed). Without
            it they leave when the next offloaded stage's forward ends and come back on demand.
        measure: keep only metadata on the "host" (fake profiles).
        limits: per module, the bytes offloaded at most per forward call (tensors saved in order
            until the next would pass it; the rest stays on the device); default everything.

    A previous offload is replaced (what else is installed stays). ``remove_offload`` (and
    ``apply.remove_remat``) undo it exactly.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> offloaded_modules(apply_offload(net, ["0"]))
        ['0']
    """
    installer.install_offload(model, list(names), order=order, measure=measure, limits=limits)
    return model


def remove_offload(model: nn.Module) -> nn.Module:
    """Undo ``apply_offload``: every module gets back exactly the forward it had.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> "forward" in remove_offload(apply_offload(net, ["0"]))[0].__dict__
        False
    """
    installer.uninstall_offload(model)
    return model
