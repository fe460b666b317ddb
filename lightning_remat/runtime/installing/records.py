"""What the installer did to each module (one ``Record`` in the module's ``__dict__``), and reading
it back: which modules are recomputed (with which policy), segmented, offloaded, or keep their
checkpoint input on the host; and what a copy of a module must leave out to carry none of it
(``without_installation``).

Example:
    >>> from torch import nn
    >>> recomputed(nn.Linear(2, 2)), offloaded(nn.Linear(2, 2)), offloader_of(nn.Linear(2, 2))
    ({}, [], None)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection

from torch import nn

from .compiled import uncompiled
from .input_offload import InputOffload
from .offloader import Offloader
from .sequential import SEGMENTS

RECORD = "_remat_installed"  # in a module's __dict__: its Record


@dataclass
class Record:
    """What the installer did to one module: the forward it had, and the behaviours it now runs."""

    original: Callable[..., Any]
    had_instance_forward: bool
    recompute: bool = False
    policy: str = ""  # with recompute: the op-level policy ("" recomputes the whole forward)
    offload: tuple[Offloader, str] | None = None  # the offloader and the module's name in it
    release_hook: Any = None  # the handle of the next stage's forward hook (offload with an order)
    chunks: int = 0  # a causal LM's head: its loss over this many sequence chunks
    route: nn.Module | None = None  # a causal LM: the chunked head its labels go to
    input_offload: tuple[InputOffload, str] | None = None  # with recompute: its checkpoint input on the host
    installed: Callable[..., Any] | None = None  # the forward the installer set: the behaviours run while it is

    def empty(self) -> bool:
        return not self.recompute and self.offload is None and not self.chunks and self.route is None


def running(module: nn.Module) -> Record | None:
    """``module``'s record if its behaviours run: the module's ``forward`` is the one the installer
    set, or a wrapper that calls it (``functools.wraps``' ``__wrapped__``, as Accelerate's autocast
    wrapper of a model's forward), not one put in its place since, nor a copy's.

    Example:
        >>> running(nn.Linear(2, 2)) is None
        True
    """
    record = module.__dict__.get(RECORD)
    forward = module.__dict__.get("forward")
    for _ in range(8):  # a few wrappers deep
        if record is None or forward is None:
            return None
        if forward is record.installed:
            return record
        forward = getattr(forward, "__wrapped__", None)
    return None


def recomputed(model: nn.Module) -> dict[str, str]:
    """Per module of ``model`` recomputed alone (names of the uncompiled model), its policy ("" for none)."""
    with uncompiled(model) as plain:
        return {name: m.__dict__[RECORD].policy for name, m in plain.named_modules()
                if RECORD in m.__dict__ and m.__dict__[RECORD].recompute}


def installed_segments(model: nn.Module) -> list[list[str]]:
    """The segments installed on ``model``, as lists of module names."""
    return [list(names) for _, module in model.named_modules() for _, _, _, names in module.__dict__.get(SEGMENTS, ())]


def offloaded(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` whose saved tensors are offloaded."""
    return [name for name, m in model.named_modules()
            if RECORD in m.__dict__ and m.__dict__[RECORD].offload is not None]


def input_offload_of(model: nn.Module) -> tuple[list[str], InputOffload | None]:
    """The recomputed modules of ``model`` whose checkpoint input is on the host, and their ``InputOffload``."""
    found = [(name, m.__dict__[RECORD].input_offload) for name, m in model.named_modules()
             if RECORD in m.__dict__ and m.__dict__[RECORD].input_offload is not None]
    return [name for name, _ in found], (found[0][1][0] if found else None)


def offloader_of(model: nn.Module) -> Offloader | None:
    """The ``Offloader`` shared by ``model``'s offloaded modules (None without any)."""
    for m in model.modules():
        record = m.__dict__.get(RECORD)
        if record is not None and record.offload is not None:
            return record.offload[0]
    return None


def installed_hooks(model: nn.Module) -> set[int]:
    """Ids of the hooks the installer registered on ``model``'s modules (an offloaded stage's
    release hook, on the next stage): keys of the modules' hook dicts that are ours.

    Example:
        >>> installed_hooks(nn.Linear(2, 2))
        set()
    """
    return {record.release_hook.id for m in model.modules()
            if (record := m.__dict__.get(RECORD)) is not None and record.release_hook is not None}


def without_installation(module: nn.Module, hooks: Collection[int] = ()) -> tuple[type, dict[str, Any]]:
    """The class and ``__dict__`` of a copy of ``module`` that carries nothing the installer put on it,
    and shares no mutable state with it; ``module`` itself is left as it is.

    Left out: the ``Record`` (whose behaviours an uninstall on the copy would switch off on the
    module itself), the ``forward`` the installer set (the copy gets the one it had: its class's,
    or the one set on the instance before), the segments and the class swap that runs them, and the
    hooks ``hooks`` (``installed_hooks``). Every hook dict is a new dict, so a hook added to or
    removed from the copy (profiling's, a plan installed on it) never reaches ``module``.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> net.__dict__[RECORD] = Record(net.forward, had_instance_forward=False, recompute=True)
        >>> net.forward = lambda x: x  # what the installer sets
        >>> cls, state = without_installation(net)
        >>> cls is nn.Linear, RECORD in state, "forward" in state, state["_forward_hooks"] is net._forward_hooks
        (True, False, False, False)
    """
    state = {key: value for key, value in module.__dict__.items() if key not in (RECORD, SEGMENTS)}
    record = module.__dict__.get(RECORD)
    if record is not None:
        if record.had_instance_forward:
            state["forward"] = record.original
        else:
            state.pop("forward", None)
    for key, value in state.items():
        if "hooks" in key and isinstance(value, dict):
            state[key] = type(value)((k, v) for k, v in value.items() if k not in hooks)
    cls = type(module).__mro__[1] if getattr(type(module), "_remat_segmented", False) else type(module)
    return cls, state
