"""The options each stage is measured under (keep, whole, heavy children, policies, offload), one run each."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ...core.plan import StageAction
from ...core.vocabulary import POLICY_PREFIX
from ..installing import sac
from ..installing.segments import chained_groups, recorded_calls, sequential_groups
from ..installing.residual_parts import RESIDUAL_PARTS
from ..installing.tiled_mlp import TILE
from ..measuring.measure import Step
from ..measuring.observe import ModuleStats, ObservedStep
from .memory_run import MemoryRun, memory_run
from .residual_twins import PARTS, WHOLE_PARTS
from .tiled_options import tiled_modules

# A child (itself a block, not a single layer) becomes an option of its stage when it saves at least this share of the stage's
# activation bytes (and is not almost all of it, which "whole" already covers).
MIN_CHILD_SHARE = 0.15
MAX_CHILD_SHARE = 0.9
MAX_CHILD_OPTIONS = 2

# A behaviour's profile side (issue 30's plug-ins), by the name of its setting in ``StageAction.extra``: the options it
# offers (``OFFERS``: stages, observed step, modules -> option name -> stage -> action), which ``option_actions``
# adds and the profiler measures like its own; the modules its setting runs again in backward (``RUNS_AGAIN``: stage,
# setting, modules -> names), what ``assemble`` prices its options by. A residual block's parts and a tiled MLP's
# (one more forward of it) are built in.
Offer = Callable[[Sequence[str], ObservedStep, dict[str, nn.Module]], dict[str, dict[str, StageAction]]]
OFFERS: dict[str, Offer] = {}
RUNS_AGAIN: dict[str, Callable[[str, Any, dict[str, nn.Module]], tuple[str, ...]]] = {
    RESIDUAL_PARTS.name: lambda stage, _, modules: tuple(f"{stage}.{c}" for c, _ in modules[stage].named_children()),
    TILE: lambda stage, setting, _: tiled_modules(stage, setting)}


def option_actions(order: Sequence[str], observed: ObservedStep, modules: dict[str, nn.Module],
                   policies: Sequence[str] = (), twins: Sequence[str] = ()) -> dict[str, dict[str, StageAction]]:
    """Per option name, the action each stage takes under it (``twins``: blocks that may run as parts).

    Example:
        >>> from lightning_remat.runtime.measuring.observe import observe_step
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> observed = observe_step(net, lambda m: m(torch.randn(2, 4)).sum(), ["0", "1"], False)
        >>> {name: [a.action.value for a in actions.values()] for name, actions in option_actions(
        ...     observed.order, observed, dict(net.named_modules())).items()}
        {'keep': ['keep', 'keep'], 'whole': ['recompute', 'recompute']}
    """
    children = {name: _child_options(name, observed.stats, modules) for name in order}
    offered = {"keep": {n: StageAction(n) for n in order}, "whole": {n: StageAction.recompute(n) for n in order}}
    for child in sorted({c for cs in children.values() for c in cs}):
        offered[child] = {n: StageAction.recompute(n, (f"{n}.{child}",)) for n in order if child in children[n]}
    # A policy is an option of the stages where it differs from keep, whole and the other policies.
    distinct = {n: sac.distinct_policies(policies, [op.func for op in observed.stats[n].ops]) for n in order}
    for policy in policies:
        stages = {n: StageAction.recompute(n, policy=policy) for n in order if policy in distinct[n]}
        if stages:
            offered[POLICY_PREFIX + policy] = stages  # "sac:save_matmuls"
    parts = {RESIDUAL_PARTS.name: True}  # run as checkpointed parts (residual_twins.py), kept or recomputed around them
    if any(n in twins for n in order):
        offered[PARTS] = {n: StageAction(n, extra=parts) for n in order if n in twins}
        offered[WHOLE_PARTS] = {n: StageAction.recompute(n, extra=parts) for n in order if n in twins}
    for offer in OFFERS.values():
        offered.update(offer(order, observed, modules))
    return offered


def _child_options(stage: str, stats: dict[str, ModuleStats], modules: dict[str, nn.Module]) -> list[str]:
    total = sum(stats[stage].saved.values())
    if total <= 0:
        return []
    scored = []
    for child, module in modules[stage].named_children():
        if not any(True for _ in module.children()):
            continue  # a single layer stores its input under recomputation too: nothing to gain
        share = sum(stats[f"{stage}.{child}"].saved.values()) / total
        if MIN_CHILD_SHARE <= share <= MAX_CHILD_SHARE:
            scored.append((share, child))
    return [child for _, child in sorted(scored, reverse=True)[:MAX_CHILD_OPTIONS]]


def span_groups(model: nn.Module, step: Step, order: Sequence[str], replay: Callable[[], None],
                calls: dict[str, list] | None = None) -> tuple:
    """Stages that may be recomputed together: consecutive items of one Sequential that a forward really chains."""
    groups = sequential_groups(model, order)
    if not groups:
        return ()
    if calls is None or any(n not in calls for g in groups for n in g):
        replay()
        calls = recorded_calls(model, step, [n for g in groups for n in g])
    return tuple(tuple(g) for g in chained_groups(groups, calls))


def measure_options(model: nn.Module, step: Step, observed: ObservedStep, offered: dict[str, dict[str, StageAction]],
                    optimizer: torch.optim.Optimizer | None, replay: Callable[[], None],
                    accumulation_steps: int) -> tuple[dict[str, MemoryRun], list[str]]:
    """The memory run of every option in ``offered`` (its stages' actions installed), and the policies dropped (their
    recompute did not replay)."""
    dead: dict[str, set[str]] = {}  # filled by the run with nothing recomputed ("keep", the first)
    with warnings.catch_warnings():
        # MemTracker warns when a module's backward hook outlives the module's outputs.
        warnings.simplefilter("ignore")
        calls = dict(enumerate(observed.position_calls))
        runs, dropped = {}, []
        for name, actions in list(offered.items()):
            try:
                runs[name] = memory_run(model, step, observed.positions, calls, list(actions.values()), optimizer,
                                        replay, gradients_alive=accumulation_steps > 1, dead=dead)
            except Exception as err:  # noqa: BLE001 - re-raised unless it is the replay failure below
                # Selective checkpointing needs the recompute to run the forward's ops again,
                # which a forward that mutates state it reads (a key/value cache) does not.
                if not (any(a.policy for a in actions.values()) and sac.recompute_not_replayed(err)):
                    raise
                model.zero_grad(set_to_none=True)
                del offered[name]
                dropped.append(f"{name} ({(str(err).strip().splitlines() or [type(err).__name__])[0][:120]})")
    return runs, dropped
