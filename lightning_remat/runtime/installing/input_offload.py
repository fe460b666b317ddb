"""A recomputed module's positional tensor inputs kept in host memory and copied back for the recompute."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import checkpoint

from ...core.actions import StageAction
from ...core.vocabulary import Action
from .records import RECORD, Behaviour, Target, record_of


class InputOffload:
    """Where the checkpoint inputs of a model's recomputed modules go; ``host_bytes`` per module."""

    def __init__(self, measure: bool = False):
        self.measure = measure
        self.host_bytes: dict[str, int] = {}

    def to_host(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (metadata only with ``measure``), counted under ``name``."""
        self.host_bytes[name] = self.host_bytes.get(name, 0) + t.numel() * t.element_size()
        if self.measure or isinstance(t, FakeTensor):
            return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
        if t.device.type == "cuda":
            host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
            host.copy_(t.detach())
            return host
        return t.detach().clone()  # the CPU: the "host" is this device (the path runs, nothing is saved)

    def to_device(self, host: torch.Tensor, like: tuple[torch.device, bool]) -> torch.Tensor:
        """``host`` back on the device, requiring a gradient as the original did."""
        device, requires_grad = like
        if host.device.type == "meta":
            back = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=device)
        else:
            back = host.to(device, copy=True)
        return back.requires_grad_(requires_grad)


def host_input_checkpoint(offload: InputOffload, name: str, function: Callable[..., Any], *args: Any,
                          **kwargs: Any) -> Any:
    """``checkpoint(function, *args, **kwargs)`` whose kept input is a host copy of each tensor positional argument."""
    kwargs.pop("use_reentrant", None)
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()
                 and a.numel() > 0 and not isinstance(a, torch.nn.Parameter)]
    like = {i: (args[i].device, args[i].requires_grad) for i in positions}
    hosted = tuple(offload.to_host(name, a) if i in like else a for i, a in enumerate(args))
    # The forward's own call gets the arguments once; the list is emptied then: only the caller holds them.
    first = [args]

    def forward(*held: Any, **kw: Any) -> Any:
        if first:
            return function(*first.pop(), **kw)
        return function(*(offload.to_device(a, like[i]) if i in like else a for i, a in enumerate(held)), **kw)

    if any(h.device.type == "meta" for h in hosted if isinstance(h, torch.Tensor)):
        # Fake tensors: no values, so no random state to replay (the meta copies name no device that has one).
        kwargs["preserve_rng_state"] = False
    return checkpoint(forward, *hosted, use_reentrant=False, **kwargs)


class CheckpointInputOffload(Behaviour):
    """A ``RECOMPUTE`` action's ``offload_input``: the module's checkpoint is ``host_input_checkpoint``."""

    name = "input_offload"

    def settings(self, action: StageAction) -> dict[str, Any]:
        return {m: True for m in action.modules} if action.action is Action.RECOMPUTE and action.offload_input else {}

    def install(self, target: Target, settings: dict[str, Any]) -> None:
        offload = InputOffload(measure=target.measure)
        for name, setting in settings.items():
            record_of(target.modules[name]).behaviours[self.name] = (setting, (offload, name))

    def checkpoint_options(self, setting: Any, state: Any, options: dict[str, Any]) -> None:
        options["checkpoint"] = functools.partial(host_input_checkpoint, *state)

    def fields(self, name: str, setting: Any) -> dict[str, Any]:
        return {"offload_input": True}


INPUT_OFFLOAD = CheckpointInputOffload()


def input_offload_of(model: torch.nn.Module) -> tuple[list[str], InputOffload | None]:
    """The recomputed modules of ``model`` whose checkpoint input is on the host, and their ``InputOffload``."""
    found = [(name, state) for name, m in model.named_modules() if (record := m.__dict__.get(RECORD)) is not None
             and (state := record.behaviours.get(INPUT_OFFLOAD.name, (None, None))[1]) is not None]
    return [name for name, _ in found], (found[0][1][0] if found else None)
