"""The options each stage is measured under (keep, whole, heavy children, policies, offload), one run each."""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from ...core.offload_model import OFFLOAD_HIDDEN, OFFLOAD_INPUT, is_offload
from ...core.plan import StageAction
from ..installing import sac
from ..installing.segments import chained_groups, sequential_groups
from ..installing.tiled_mlp import with_tiles
from ..measuring.measure import Step
from ..measuring.observe import ModuleStats, ObservedStep
from .memory_run import MemoryRun, memory_run
from .residual_twins import PARTS, PARTS_OPTIONS, WHOLE_PARTS
from .tiled_options import split_tiled

# A child (itself a block, not a single layer) becomes an option of its stage when it saves at least this share of the stage's
# activation bytes (and is not almost all of it, which "whole" already covers).
MIN_CHILD_SHARE = 0.15
MAX_CHILD_SHARE = 0.9
MAX_CHILD_OPTIONS = 2


def option_wraps(order: Sequence[str], observed: ObservedStep, modules: dict[str, nn.Module],
                 policies: Sequence[str] = (), twins: Sequence[str] = ()) -> dict[str, dict[str, tuple]]:
    """Per option name, the modules each stage recomputes under it (``twins``: blocks that may run as parts)."""
    children = {name: _child_options(name, observed.stats, modules) for name in order}
    wraps: dict[str, dict[str, tuple]] = {"keep": {n: () for n in order}, "whole": {n: (n,) for n in order}}
    for child in sorted({c for cs in children.values() for c in cs}):
        wraps[child] = {n: (f"{n}.{child}",) for n in order if child in children[n]}
    # A policy is an option of the stages where it differs from keep, whole and the other policies.
    offered = {n: sac.distinct_policies(policies, [op.func for op in observed.stats[n].ops]) for n in order}
    for policy in policies:
        stages = {n: (n,) for n in order if policy in offered[n]}
        if stages:
            wraps[sac.option_name(policy)] = stages
    if any(n in twins for n in order):
        wraps[PARTS] = {n: () for n in order if n in twins}
        wraps[WHOLE_PARTS] = {n: (n,) for n in order if n in twins}
    return wraps


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
        replay()  # chained_groups records them anew
    return tuple(tuple(g) for g in chained_groups(model, step, groups, calls))


def option_actions(name: str, wrap: dict[str, tuple], limits: dict[str, int]) -> list[StageAction]:
    """The actions of option ``name`` for its memory run: ``wrap``'s modules recomputed (with the option's policy, or
    their checkpoint input offloaded), its stages offloaded, run as parts (residual_twins.py) or tiled (tiled_mlp.py).

    >>> [a.to_dict()["modules"] for a in option_actions("whole", {"h.0": ("h.0",), "h.1": ("h.1",)}, {})]
    [['h.0'], ['h.1']]
    """
    base, tiled = split_tiled(name)  # an option with its stages' MLP tiled (tiled_options.py)
    wrapped, offload_inputs = [m for ms in wrap.values() for m in ms], base == OFFLOAD_INPUT
    parts = list(wrap) if name in PARTS_OPTIONS else []

    def extra(module: str) -> dict[str, bool]:
        return {"residual_parts": True} if module in parts else {}
    actions = [*(StageAction.recompute(m, policy=None if offload_inputs else sac.policy_of(name) or None,
                                       offload_input=offload_inputs, extra=extra(m)) for m in wrapped),
               *(StageAction(m, extra=extra(m)) for m in parts if m not in wrapped)]
    if is_offload(name):
        actions += [StageAction.offload(n, limits.get(n) if name == OFFLOAD_HIDDEN else None) for n in wrap]
    return with_tiles(actions, {n: tiled for n in wrap} if tiled else {})


def measure_options(model: nn.Module, step: Step, observed: ObservedStep, wraps: dict[str, dict[str, tuple]],
                    optimizer: torch.optim.Optimizer | None, replay: Callable[[], None], accumulation_steps: int,
                    limits: dict[str, int]) -> tuple[dict[str, MemoryRun], list[str]]:
    """The memory run of every option in ``wraps``, and the policies dropped (their recompute did not replay)."""
    dead: dict[str, set[str]] = {}  # filled by the run with nothing recomputed ("keep", the first)
    with warnings.catch_warnings():
        # MemTracker warns when a module's backward hook outlives the module's outputs.
        warnings.simplefilter("ignore")
        calls = dict(enumerate(observed.position_calls))
        runs, dropped = {}, []
        for name, wrap in list(wraps.items()):
            try:
                runs[name] = memory_run(model, step, observed.positions, calls, option_actions(name, wrap, limits),
                                        optimizer, replay, gradients_alive=accumulation_steps > 1, dead=dead)
            except Exception as err:  # noqa: BLE001 - re-raised unless it is the replay failure below
                # Selective checkpointing needs the recompute to run the forward's ops again,
                # which a forward that mutates state it reads (a key/value cache) does not.
                if not (sac.policy_of(name) and sac.recompute_not_replayed(err)):
                    raise
                model.zero_grad(set_to_none=True)
                del wraps[name]
                dropped.append(f"{name} ({(str(err).strip().splitlines() or [type(err).__name__])[0][:120]})")
    return runs, dropped
