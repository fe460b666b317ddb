"""DeepSpeed ZeRO-2/3: a rank's plan from the whole model's, through ``core.zero`` facts read from its optimizer.

>>> deepspeed_stage(None) is None
True
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ...core.memory_model import Profile
from ...core.zero import Zero2Facts, Zero3Facts
from ...runtime.measuring.meter import PeakWindow


def deepspeed_stage(state: Any) -> int | None:
    """The ZeRO stage of Accelerate's DeepSpeed mode, None outside it."""
    kind = getattr(state, "distributed_type", None)
    if str(getattr(kind, "value", kind)).upper() != "DEEPSPEED":
        return None
    plugin = getattr(getattr(state, "state", state), "deepspeed_plugin", None)
    return int(getattr(plugin, "zero_stage", 0) or 0)


def zero_optimizer(optimizers: Any) -> Any:
    """DeepSpeed's ZeRO optimizer inside ``optimizers`` (through Accelerate's and the Trainer's wrappers)."""
    for optimizer in optimizers or ():
        for _ in range(4):  # AcceleratedOptimizer -> DeepSpeedZeroOptimizer(_Stage3) -> the torch optimizer
            if hasattr(optimizer, "single_partition_of_fp32_groups") and hasattr(optimizer, "partition_size"):
                return optimizer
            if hasattr(optimizer, "fp32_partitioned_groups_flat") and hasattr(optimizer, "parameter_offload"):
                return optimizer
            optimizer = getattr(optimizer, "optimizer", None)
            if optimizer is None:
                break
    return None


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the distinct storages under ``tensors`` (views share their flat buffer's)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t.device.type != "meta"}
    storages.pop(0, None)
    return sum(storages.values())


def zero3_facts(optimizer: Any, model: nn.Module, world: int, held: list[torch.Tensor]) -> Zero3Facts:
    """``Zero3Facts`` of a live ZeRO-3 ``optimizer``: ``held`` measured, sizes from ``ds_numel``/``partition_numel()``."""
    parameters = [p for p in model.parameters() if hasattr(p, "ds_numel")]
    padding = sum((world * p.partition_numel() - p.ds_numel) * p.element_size() for p in parameters)
    reduce_bytes = max((t.element_size() for t in held if t.dim() == 1 and t.numel() == optimizer.reduce_bucket_size),
                       default=parameters[0].element_size() if parameters else 4)
    return Zero3Facts(world=world, held=_storage_bytes(held), numel=sum(p.ds_numel for p in parameters),
                      partition=sum(p.partition_numel() for p in parameters), padding=padding,
                      bucket=int(optimizer.reduce_bucket_size), reduce_bytes=reduce_bytes,
                      largest=max((p.ds_numel for p in parameters), default=0))


class ZeroRank:
    """One rank under ZeRO-2/3. ``stand_in()``: the user's optimizer class over the whole model, for the fake
    profile only (never stepped); ``metered``: DeepSpeed's torch optimizer (the master partition and its state)."""

    def __init__(self, optimizer: Any, model: nn.Module, world: int):
        self.optimizer = optimizer
        self.model = model
        parameters = list(model.parameters())
        self.stage = 3 if hasattr(optimizer, "fp32_partitioned_groups_flat") else 2
        self._stand_in: torch.optim.Optimizer | None = None
        if self.stage == 3:
            self.facts: Zero2Facts | Zero3Facts = zero3_facts(optimizer, model, world, self.held())
            return
        self.facts = Zero2Facts(
            world=world, partition=int(sum(int(n) for n in optimizer.partition_size)),
            gradient_bytes=parameters[0].element_size() if parameters else 4,
            reduce_bytes=torch.empty(0, dtype=optimizer._gradient_reduction_buffer_dtype()).element_size()
            if hasattr(optimizer, "_gradient_reduction_buffer_dtype") else 4,
            bucket=int(optimizer.reduce_bucket_size), overlap=bool(optimizer.overlap_comm),
            contiguous=bool(optimizer.contiguous_gradients),
            largest=max((p.numel() for p in parameters), default=0))

    @property
    def metered(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer

    def held(self) -> list[torch.Tensor]:
        """Every tensor the ZeRO optimizer holds (flat buffers, partitions, buckets), for a meter to count."""
        found, stack = [], [(value, 0) for value in vars(self.optimizer).values()]
        while stack:
            value, depth = stack.pop()
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif depth < 3 and isinstance(value, (list, tuple)):
                stack.extend((v, depth + 1) for v in value)
            elif depth < 3 and isinstance(value, dict):
                stack.extend((v, depth + 1) for v in value.values())
            elif depth < 3 and type(value).__module__.startswith("deepspeed") and hasattr(value, "__dict__"):
                stack.extend((v, depth + 1) for v in vars(value).values())  # its buckets' buffers
        if getattr(self, "stage", 2) == 3:  # ZeRO-3 gives its master partition a gradient of the whole group's size
            found.extend(t.grad for t in list(found) if t.grad is not None)
        return found

    def meter(self) -> PeakWindow:
        """A meter over a step from now, DeepSpeed's tensors counted."""
        meter = PeakWindow(self.model, self.metered)
        meter.tracker.track_external(*self.held())
        return meter

    @property
    def steady(self) -> bool:
        """Whether DeepSpeed's optimizer has stepped (its state exists)."""
        return bool(self.metered.state)

    def stand_in(self) -> torch.optim.Optimizer:
        inner = self.metered
        if self._stand_in is None:
            import inspect

            # Its defaults as its constructor takes them (AdamW records one it does not accept).
            accepted = inspect.signature(type(inner)).parameters
            self._stand_in = type(inner)(self.model.parameters(),
                                         **{k: v for k, v in inner.defaults.items() if k in accepted})
        return self._stand_in

    def account(self, profile: Profile) -> Profile:
        """``profile`` (the whole model's step) as this rank holds it."""
        state = profile.optimizer_state_bytes
        extra = self.facts.extra_bytes(state)
        stages = tuple(replace(s, options=tuple(replace(o, local_peak_bytes=o.local_peak_bytes + extra)
                                                for o in s.options)) for s in profile.stages)
        segments = tuple(replace(seg, peak_bytes=seg.peak_bytes + extra) for seg in profile.segments)
        kept = self.facts.kept(state)
        return replace(profile, stages=stages, segments=segments, optimizer_state_bytes=kept,
                       gradient_bytes=profile.gradient_bytes + extra - (kept - state),
                       notes=(*profile.notes, self.facts.note(state))).with_baseline()


def zero_rank(state: Any, optimizers: Any, model: nn.Module) -> ZeroRank | None:
    """The ``ZeroRank`` of ``model`` once DeepSpeed built its ZeRO-2/3 optimizer, else None."""
    if deepspeed_stage(state) not in (2, 3):
        return None
    optimizer = zero_optimizer(optimizers)
    if optimizer is None:
        return None
    return ZeroRank(optimizer, model, int(getattr(state, "num_processes", 1)))
