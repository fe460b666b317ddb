"""Which knob would make a budget fit, with the least peak it is predicted to give (``BudgetTooSmallError.knobs``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Callable

import torch

from ..core.binding import HEAD, OPTIMIZER, STAGE, with_optimizer_setting
from ..core.config import PRECISIONS
from ..core.errors import RematError
from ..core.solve import least_peak, smallest_world_size, solve
from ..runtime.installing.chunked_loss import find_head_loss
from ..runtime.installing.tiled_mlp import refusal
from ..runtime.measuring.measure import model_device
from ..runtime.measuring.optimizers import optimizer_list
from ..runtime.profiling.candidates import find_stages
from ..runtime.targets.offload_link import check_offload_target
from ..runtime.targets.sharded import uneven_parameters, unsharded_in_flight_bytes


@dataclass(frozen=True)
class KnobContext:
    """What a knob may re-solve or re-profile: the planner, the step and the profile that did not fit."""

    planner: Any
    model: Any
    step: Any
    optimizer: Any
    profile: Any
    budget_bytes: int

    @cached_property
    def binding(self) -> dict[str, Any]:
        """What binds the profile's least peak (``Binding.to_dict()``; empty where nothing is said)."""
        return solve(self.profile, "min", cost="flops").binding or {}


def _optimizer(setting: str) -> Callable[[KnobContext], tuple[str, int] | None]:
    def evaluate(context: KnobContext) -> tuple[str, int] | None:
        changed = with_optimizer_setting(context.profile, setting)
        if changed is None or changed.optimizer_step_alternatives.get(setting, 0) >= 0:
            return None
        names = sorted({type(o).__name__ for o in optimizer_list(context.optimizer)})
        return f"{'/'.join(names) or 'the optimizer'}({setting})", least_peak(changed)
    return evaluate


def _model_optimizer(model: Any, optimizer: Any) -> Any:
    """``optimizer``, or one over the model's parameters now where a fake profile converted a meta model in place."""
    optimizers = optimizer_list(optimizer)
    current = list(model.parameters())
    ids = {id(p) for p in current}
    if all(id(p) in ids for o in optimizers for g in o.param_groups for p in g["params"]):
        return optimizer
    remaining = iter(current)
    rebuilt = []
    for o in optimizers:
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [next(p for p in remaining if p.shape == old.shape) for old in g["params"]]}
                  for g in o.param_groups]
        rebuilt.append(type(o)(groups))
    return rebuilt[0] if len(rebuilt) == 1 else rebuilt


def _reprofiled(context: KnobContext, **settings: Any) -> Any:
    # The planner's own class with the setting changed: the profile a plan with it would solve on.
    config = replace(context.planner.config, profile=replace(context.planner.config.profile, **settings))
    optimizer = _model_optimizer(context.model, context.optimizer) if context.optimizer is not None else None
    return type(context.planner)(config).profile(context.model, context.step, optimizer)


def _switch(option: str, offered: Callable[[KnobContext], bool]) -> Callable[[KnobContext], tuple[str, int] | None]:
    """Turning ``option`` on where it is off, ``offered(context)``, and the budget is above static memory (which
    activation-only knobs cannot reach: no re-profile)."""
    def evaluate(context: KnobContext) -> tuple[str, int] | None:
        if (getattr(context.planner.config.profile, option) or context.budget_bytes < context.profile.static_bytes
                or not offered(context)):
            return None
        return f"{option}=True", least_peak(_reprofiled(context, **{option: True}))
    return evaluate


def _offload_target(context: KnobContext) -> bool:
    try:
        check_offload_target(replace(context.planner.config.profile, offload=True), model_device(context.model))
    except RematError:  # no accelerator target: offloading is no knob here
        return False
    return True


def _gathered_bytes(context: KnobContext) -> int:
    """Bytes FSDP2 holds unsharded at once (the root's and two largest units'), in the dtype it computes in."""
    options = context.planner.config.profile
    # As the sharded profile gathers: in the autocast dtype (FSDP2's param_dtype), else as stored.
    dtype = next((d for d in PRECISIONS[options.precision][::-1] if d), None) if options.precision else options.dtype
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return unsharded_in_flight_bytes(context.model, find_stages(context.model, options.candidates), dtype)


def _more_gpus(context: KnobContext) -> tuple[str, int] | None:
    profile, options = context.profile, context.planner.config.profile
    world = int((profile.sharding or {}).get("world_size", options.world_size or 1))
    # Sharded, only parameters, gradients and optimizer state divide by the world size; unsharded,
    # the parameters FSDP2 gathers appear (a sharded profile's least peak holds them already).
    shrinking = profile.parameter_bytes + profile.gradient_bytes + profile.optimizer_state_bytes
    # Nothing is gathered in the optimizer's step: there the bound has no gathered parameters.
    gathered = _gathered_bytes(context) if world <= 1 and context.binding.get("term") != OPTIMIZER else 0
    # Even on infinitely many GPUs the peak keeps the rest: no re-profile where that is above the budget.
    if least_peak(profile) - shrinking + gathered > context.budget_bytes:
        return None
    estimate = smallest_world_size(least_peak(profile) + gathered, shrinking, world, context.budget_bytes)
    if estimate is None or estimate <= world:
        return None
    # A power of two: what clusters have, and no padding where the model's dimensions are powers of two.
    estimate = 1 << (estimate - 1).bit_length()
    sharded = _reprofiled(context, fake=True, world_size=estimate)
    return _more_gpus_from(context, sharded, estimate, least_peak(sharded))


def _more_gpus_from(context: KnobContext, sharded: Any, world: int, peak: int) -> tuple[str, int]:
    """A sharded profile's own size where it fits, else the next size its own algebra says fits, with its peak."""
    # At every moment of the step the sharded parameters and optimizer state divide further (gradients may
    # not exist yet) and nothing else grows: an upper bound on the least peak at the next size.
    own = sharded.parameter_bytes + sharded.optimizer_state_bytes
    size = smallest_world_size(peak, own, world, context.budget_bytes)
    if size is None or size <= world:
        return f"fake=True, world_size={world} (FSDP2, per GPU)", peak
    size = 1 << (size - 1).bit_length()
    if uneven_parameters(context.model, size):  # padding the algebra does not know: profiled
        return f"fake=True, world_size={size} (FSDP2, per GPU)", least_peak(
            _reprofiled(context, fake=True, world_size=size))
    return (f"fake=True, world_size={size} (FSDP2, per GPU, at most; from the profile sharded over {world})",
            peak - own + math.ceil(own * world / size))


def _head_binds(context: KnobContext) -> bool:
    # Offered (and re-profiled for) only where the head and loss's term binds the least peak.
    return find_head_loss(context.model) is not None and context.binding.get("term") == HEAD


def _mlp_binds(context: KnobContext) -> bool:
    # Offered (and re-profiled for) only where a stage with a position-wise child binds the least peak.
    binding = context.binding
    stage = dict(context.model.named_modules()).get(binding.get("name")) if binding.get("term") == STAGE else None
    return stage is not None and any(refusal(child) is None for child in stage.children())


# Each knob's ``evaluate(context)`` -> ``(how to ask for it, least peak)``, or None where it does not apply.
KNOBS: dict[str, Callable[[KnobContext], tuple[str, int] | None]] = {
    "fused optimizer": _optimizer("fused=True"),
    "optimizer without foreach": _optimizer("foreach=False"),
    "offload": _switch("offload", _offload_target),
    "more GPUs (FSDP2)": _more_gpus,
    "chunked loss": _switch("chunk_loss", _head_binds),
    "tiled MLP": _switch("tile_mlp", _mlp_binds),
}


def knob_figures(context: KnobContext) -> list[dict[str, Any]]:
    """Per applicable knob, ``{"knob", "setting", "peak_bytes", "fits"}``; a failed re-profile adds ``"error"``."""
    found = []
    least = least_peak(context.profile)
    for name, evaluate in KNOBS.items():
        try:
            result = evaluate(context)
        except Exception as error:  # noqa: BLE001 - said in the message: the budget's own error is raised
            found.append({"knob": name, "setting": "", "peak_bytes": None, "fits": False,
                          "error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160] if str(error).strip() else ''}"})
            continue
        if result is not None and result[1] < least:  # a knob that lowers nothing is no knob
            setting, peak = result
            found.append({"knob": name, "setting": setting, "peak_bytes": int(peak),
                          "fits": int(peak) <= context.budget_bytes})
    return found

