"""Which knob would make a budget fit: each setting that lowers the least peak, with the peak it gives.

``Planner.decide`` adds them to the ``BudgetTooSmallError`` (``error.knobs``), each predicted, not guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from ..core.binding import HEAD, with_optimizer_setting
from ..core.errors import RematError
from ..core.sharding import smallest_world_size
from ..core.solve import least_peak, solve


@dataclass(frozen=True)
class KnobContext:
    """What a knob may re-solve or re-profile: the planner, the step and the profile that did not fit."""

    planner: Any
    model: Any
    step: Any
    optimizer: Any
    profile: Any
    budget_bytes: int


def _optimizer(setting: str) -> Callable[[KnobContext], tuple[str, int] | None]:
    def evaluate(context: KnobContext) -> tuple[str, int] | None:
        changed = with_optimizer_setting(context.profile, setting)
        if changed is None or changed.optimizer_step_alternatives.get(setting, 0) >= 0:
            return None
        names = sorted({type(o).__name__ for o in _optimizers(context.optimizer)})
        return f"{'/'.join(names) or 'the optimizer'}({setting})", least_peak(changed)
    return evaluate


def _optimizers(optimizer: Any) -> list:
    from ..runtime.measuring.optimizers import optimizer_list

    return optimizer_list(optimizer)


def _model_optimizer(model: Any, optimizer: Any) -> Any:
    """``optimizer``, or one over the model's parameters now where a fake profile converted a meta model in place."""
    optimizers = _optimizers(optimizer)
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
    # The planner's own class (``service.planning.Planner``) with the setting changed: the same
    # profile a plan with that setting would solve on.
    config = replace(context.planner.config, profile=replace(context.planner.config.profile, **settings))
    optimizer = _model_optimizer(context.model, context.optimizer) if context.optimizer is not None else None
    return type(context.planner)(config).profile(context.model, context.step, optimizer)


def _below_static(context: KnobContext) -> bool:
    """Whether the budget is below static memory, which activation-only knobs cannot reach: no re-profile."""
    return context.budget_bytes < context.profile.static_bytes


def _offload(context: KnobContext) -> tuple[str, int] | None:
    from ..runtime.measuring.measure import model_device
    from ..runtime.targets.offload_link import check_offload_target

    options = context.planner.config.profile
    if options.offload or _below_static(context):
        return None
    try:
        check_offload_target(replace(options, offload=True), model_device(context.model))
    except RematError:  # no accelerator target: offloading is no knob here
        return None
    return "offload=True", least_peak(_reprofiled(context, offload=True))


def _more_gpus(context: KnobContext) -> tuple[str, int] | None:
    profile, options = context.profile, context.planner.config.profile
    world = int((profile.sharding or {}).get("world_size", options.world_size or 1))
    # Parameters and optimizer state shrink with the world size (core.sharding.solve_sharded's estimate).
    shrinking = profile.parameter_bytes + profile.optimizer_state_bytes
    estimate = smallest_world_size(least_peak(profile), shrinking, world, context.budget_bytes)
    if estimate is None or estimate <= world:
        return None
    peak = 0
    for size in (estimate, 2 * estimate):
        peak = least_peak(_reprofiled(context, fake=True, world_size=size))
        if peak <= context.budget_bytes:
            break
    return f"fake=True, world_size={size} (FSDP2, per GPU)", peak


def _chunked_loss(context: KnobContext) -> tuple[str, int] | None:
    from ..runtime.installing.chunked_loss import find_head_loss

    if context.planner.config.profile.chunk_loss or _below_static(context) or find_head_loss(context.model) is None:
        return None
    # Chunking lowers the head and loss's term only: offered (and re-profiled for) where that term
    # binds the least peak, as at long context.
    if (solve(context.profile, "min", cost="flops").binding or {}).get("term") != HEAD:
        return None
    return "chunk_loss=True", least_peak(_reprofiled(context, chunk_loss=True))


# Each knob's ``evaluate(context)`` -> ``(how to ask for it, least peak)``, or None where it does not apply.
KNOBS: dict[str, Callable[[KnobContext], tuple[str, int] | None]] = {
    "fused optimizer": _optimizer("fused=True"),
    "optimizer without foreach": _optimizer("foreach=False"),
    "offload": _offload,
    "more GPUs (FSDP2)": _more_gpus,
    "chunked loss": _chunked_loss,
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

