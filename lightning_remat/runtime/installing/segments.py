"""Recompute runs of consecutive items of an ``nn.Sequential`` as ONE checkpoint segment each.

A plan's ``segments`` (``core.spans``) name consecutive children of one ``nn.Sequential``. Their
Sequential yields, while the plan is applied, one *runner* per segment in place of the segment's
items when iterated: ``nn.Sequential.forward`` (``for module in self``) and code that loops over a
Sequential itself (transformers' ``ResNetStage``: ``for layer in self.layers``) then call the
runner, which runs the items in order under a single non-reentrant checkpoint. The runner is a
plain ``nn.Sequential`` of the same items, recomputed by the one installer (``installer.py``) as
any recomputed module is (so dropout masks are replayed and BatchNorm statistics updated once).

How: the Sequential's class is swapped for a subclass of the same name that overrides only
``__iter__`` (Python looks dunder methods up on the type, so an instance attribute cannot do
it). Nothing else changes: the runner is kept in the instance ``__dict__``, not registered as a
child, so ``named_modules``, parameter names and ``state_dict`` keys are those of the model, and
``remove_segments`` puts the original class back. Indexing and ``len`` are unchanged.

Installing lives in ``installer.py`` (re-exported here); this module also finds the groups of
stages that may form segments (``sequential_groups``, ``chained_groups``).

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)])
    >>> apply_segments(net, [["0", "1", "2"]])
    >>> segmented_modules(net), len(list(net)), type(net).__name__
    ([['0', '1', '2']], 2, 'Sequential')
    >>> net(torch.randn(2, 4, requires_grad=True)).sum().backward()
    >>> remove_segments(net); type(net) is nn.Sequential and len(list(net)) == 4
    True
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ...core.actions import StageAction, check_actions
from ..measuring.exclusive import planning_runs_here
from . import installer
from .sequential import qualifies

__all__ = ["apply_segments", "chained_groups", "check_segments", "qualifies", "recorded_calls", "remove_segments",
           "segmented_modules", "sequential_groups"]


def check_segments(modules: dict[str, nn.Module], segments: Sequence[Sequence[str]], checkpointed: Sequence[str]) -> None:
    """Raise ValueError unless every segment is a run of consecutive items of one qualifying Sequential,
    segments do not overlap, and no module recomputed alone lies inside, around or in a segment."""
    for names in segments:
        installer.segment_positions(modules, names)
    check_actions([*(StageAction.in_segment(s, names) for names in segments for s in names),
                   *(StageAction.recompute(n) for n in checkpointed)])


def apply_segments(model: nn.Module, segments: Sequence[Sequence[str]]) -> None:
    """Recompute each run of names as one checkpoint (names as ``model.named_modules()`` gives them).
    Call ``remove_segments`` first to replace a previous set."""
    installer.install_segments(model, segments)


def remove_segments(model: nn.Module) -> None:
    """Undo ``apply_segments``: every Sequential gets back its class and iterates its items again."""
    installer.uninstall_segments(model)


def segmented_modules(model: nn.Module) -> list[list[str]]:
    """The segments currently applied to ``model``, as lists of module names (a sibling of
    ``checkpointed_modules``)."""
    return installer.installed_segments(model)


def recorded_calls(model: nn.Module, step: Any, names: Sequence[str]) -> dict[str, list]:
    """Each named module's calls in one forward of ``step(model)`` under ``torch.no_grad()``, as
    ``(args, kwargs, output, versions)`` (the caller replays random generators and restores buffers):
    ``versions`` are the version counters of the tensor arguments as the call began and of the output
    as it ended, which tell an in-place change between two calls.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
        >>> calls = recorded_calls(net, lambda m: m(torch.ones(1, 2)).sum(), ["0", "1"])
        >>> calls["1"][0][0][0] is calls["0"][0][2]
        True
    """
    modules = dict(model.named_modules())
    calls: dict[str, list] = {n: [] for n in names}

    began: dict[str, list] = {n: [] for n in names}

    def pre_hook(name: str):
        def record(module: nn.Module, args: tuple) -> None:
            if not planning_runs_here():  # another thread's forward of the same model
                return
            began[name].append(tuple(a._version if isinstance(a, torch.Tensor) else None for a in args))
        return record

    def hook(name: str):
        def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not planning_runs_here():
                return
            ended = output._version if isinstance(output, torch.Tensor) else None
            calls[name].append((args, kwargs, output, (began[name].pop(), ended)))
        return record

    handles = [h for n in calls for h in (modules[n].register_forward_pre_hook(pre_hook(n)),
                                          modules[n].register_forward_hook(hook(n), with_kwargs=True))]
    try:
        _run_without_graph(model, step, calls, began)
    finally:
        for h in handles:
            h.remove()
    return calls


def _run_without_graph(model: nn.Module, step: Any, calls: dict[str, list], began: dict[str, list]) -> None:
    # Under no_grad: no graph, no activations held. A step that differentiates inside itself
    # (torch.autograd.grad, a gradient penalty) cannot run so; it runs once more with its graph, as
    # the profile's own measured steps do (the caller restores generators and buffers).
    try:
        with torch.no_grad():
            step(model)
        return
    except RuntimeError as error:
        if "does not require grad" not in str(error):
            raise
    for seen in (*calls.values(), *began.values()):
        seen.clear()
    step(model)


def chained_groups(model: nn.Module, step: Any, groups: Sequence[Sequence[str]],
                   calls: dict[str, list] | None = None) -> list[list[str]]:
    """Split ``groups`` (runs of consecutive items of one Sequential) into the runs that one forward of
    ``step(model)`` really chains: each item called once with a single tensor, the output of the
    item before it, and nothing else. Runs ``step`` once (``recorded_calls``), unless ``calls``
    recorded already holds every item's."""
    names = [n for g in groups for n in g]
    if calls is None or any(n not in calls for n in names):
        calls = recorded_calls(model, step, names)
    chained = []
    for group in groups:
        run: list[str] = []
        for name in group:
            seen = calls[name]
            simple = len(seen) == 1 and len(seen[0][0]) == 1 and not seen[0][1] and isinstance(seen[0][2], torch.Tensor)
            linked = simple and bool(run) and seen[0][0][0] is calls[run[-1]][0][2]
            if linked:
                run.append(name)
                continue
            if len(run) >= 2:
                chained.append(run)
            run = [name] if simple else []
        if len(run) >= 2:
            chained.append(run)
    return chained


def sequential_groups(model: nn.Module, stages: Sequence[str]) -> list[list[str]]:
    """Runs of stages that are consecutive items of one qualifying ``nn.Sequential``.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.Tanh()) for _ in range(3)])
        >>> sequential_groups(net, ["0", "1", "2"])
        [['0', '1', '2']]
    """
    modules = dict(model.named_modules())
    stage_set = set(stages)
    groups = []
    for parent, container in modules.items():
        if not qualifies(container):
            continue
        run: list[str] = []
        for key in container._modules:
            name = f"{parent}.{key}" if parent else key
            if name in stage_set:
                run.append(name)
                continue
            if len(run) >= 2:
                groups.append(run)
            run = []
        if len(run) >= 2:
            groups.append(run)
    return groups
