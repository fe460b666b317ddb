"""The optimizer's step measured on fake copies under ``FakeTensorMode``: its state and its temporaries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.optim.optimizer import _get_foreach_kernels_supported_devices

from ...core.binding import OPTIMIZER_SETTINGS
from ..targets.fake import clone_optimizer, fake_like, new_fake_mode
from ..measuring.optimizers import optimizer_list, torch_optimizer
from ..measuring.tracking import Tracker


@dataclass(frozen=True)
class OptimizerStepCost:
    """State bytes after a step, the step's peak beyond parameters and gradients, and the state not created yet."""

    state_bytes: int = 0
    step_peak_bytes: int = 0
    created_state_bytes: int = 0


def _state_bytes(states: Iterable[Mapping[str, Any]]) -> int:
    seen: set[int] = set()
    total = 0
    for state in states:
        for v in state.values():
            if isinstance(v, torch.Tensor) and id(v) not in seen:
                seen.add(id(v))
                total += v.untyped_storage().nbytes()
    return total


def _as_on_device(clone: torch.optim.Optimizer, device: str | torch.device | None) -> None:
    """Make the clone take the real optimizer's implementation on ``device`` (the fake copies are CPU tensors)."""
    if device is None:
        return
    if torch.device(device).type not in _get_foreach_kernels_supported_devices():
        return
    for group in clone.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused") \
                and not group.get("differentiable"):
            group["foreach"] = True


# Outside the profile's fake mode, which would convert every copy made here back and forth.
@unset_fake_temporarily()
def optimizer_step_cost(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
                        device: str | torch.device | None = None,
                        setting: Mapping[str, bool] | None = None) -> OptimizerStepCost:
    """Run ``optimizer``'s step (several: one after the other) on fake copies and count what it allocates.

    ``device``: where the real step runs (its default implementation is measured); ``setting``: param-group
    keys set first (``{"fused": True}``)."""
    optimizers = optimizer_list(optimizer)
    if not optimizers:
        return OptimizerStepCost()
    mode = new_fake_mode()
    if setting:
        # A kernel without a fake implementation (fused SGD) would run for real on zeros, the
        # size of every parameter: refused instead, so that setting is not measured.
        mode.allow_fallback_kernels = False
    fakes: dict[int, torch.Tensor] = {}
    for p in (p for o in optimizers for group in o.param_groups for p in group["params"]):
        if id(p) not in fakes:
            # A sharded (DTensor) parameter: its step works on this rank's shard.
            local = getattr(p, "_local_tensor", p)
            copy = nn.Parameter(fake_like(mode, local), requires_grad=p.requires_grad)
            if p.requires_grad:
                copy.grad = fake_like(mode, local)
            fakes[id(p)] = copy
    clones = [clone_optimizer(o, fakes, mode) for o in optimizers]
    for clone in clones:
        for group in clone.param_groups:
            group.update({k: v for k, v in (setting or {}).items() if k in group})
        _as_on_device(clone, device)
    tracker = Tracker()
    # Parameters and gradients are tracked up front so that only the state and the step's own
    # temporaries land in the optimizer category.
    tracker.track_external(*fakes.values(), *[f.grad for f in fakes.values() if f.grad is not None], *clones)
    with mode, tracker:
        for clone in clones:
            clone.step()
    step_peak = 0
    for snapshot in tracker.get_tracker_snapshot("peak").values():
        step_peak += sum(v for k, v in snapshot.items() if getattr(k, "value", k) == "Optstate")
    state = sum(_state_bytes(clone.state.values()) for clone in clones)
    # State that does not exist yet will exist during every later step.
    created = sum(_created_bytes(o, clone) for clone, o in zip(clones, optimizers))
    return OptimizerStepCost(state, max(step_peak, state), created)


def _created_bytes(optimizer: torch.optim.Optimizer, clone: torch.optim.Optimizer) -> int:
    """Bytes of ``clone``'s state for the parameters ``optimizer`` has no state for yet."""
    real = torch_optimizer(optimizer)
    return _state_bytes(clone.state.get(fake, {}) for group, twin in zip(real.param_groups, clone.param_groups)
                        for p, fake in zip(group["params"], twin["params"]) if not real.state.get(p))


def optimizer_step_alternatives(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
                                device: str | torch.device | None = None) -> dict[str, int]:
    """Per optimizer setting not used yet (``fused=True``, ``foreach=False``) and runnable, the step's peak change."""
    optimizers = optimizer_list(optimizer)
    if not optimizers:
        return {}
    base = None
    found = {}
    for name, setting in OPTIMIZER_SETTINGS.items():
        groups = [g for o in optimizers for g in o.param_groups]
        key = next(iter(setting))  # the key that names the setting; the others keep it alone
        if not all(all(k in g for k in setting) for g in groups) or all(g[key] == setting[key] for g in groups):
            continue
        try:
            base = base if base is not None else optimizer_step_cost(optimizers, device).step_peak_bytes
            found[name] = optimizer_step_cost(optimizers, device, setting).step_peak_bytes - base
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # the setting has no kernel for these tensors: it is no knob here
    return found


class MeasuredOnRead(Mapping[str, int]):
    """A mapping measured when first read (the settings feed only advice); copied or pickled, a plain ``dict``.

    Example:
        >>> calls = []
        >>> later = MeasuredOnRead(lambda: calls.append(1) or {"fused=True": -5})
        >>> len(calls), later.get("fused=True"), dict(later), len(calls)
        (0, -5, {'fused=True': -5}, 1)
    """

    def __init__(self, measure: Callable[[], Mapping[str, int]]):
        self._measure: Callable[[], Mapping[str, int]] | None = measure
        self._found: dict[str, int] | None = None

    def _resolved(self) -> dict[str, int]:
        if self._found is None:
            self._found = dict(self._measure())  # type: ignore[misc]
            self._measure = None  # lets go of the fake optimizer it measured
        return self._found

    def __getitem__(self, key: str) -> int:
        return self._resolved()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolved())

    def __len__(self) -> int:
        return len(self._resolved())

    def __repr__(self) -> str:
        return repr(self._resolved())

    def __reduce__(self) -> tuple[Any, ...]:  # pickle, copy and deepcopy alike: a plain dict
        return dict, (self._resolved(),)
