"""An automatic candidate whose forward only chains modules of its own (a CNN stage) is planned through them,
to ``MAX_DEPTH`` levels; one that does more (a residual add) stays whole."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..installing.segments import qualifies, recorded_calls
from .candidates import _is_block

# Levels below an automatic candidate, and stages in all: the DP's time grows with the stages (and
# the spans they allow), the memory runs' not at all.
MAX_DEPTH = 3
MAX_STAGES = 256


@dataclass
class Hierarchy:
    """The stages at the deepest level reached, the blocks expanded (each with its stages), the calls recorded."""

    stages: list[str]
    blocks: tuple[tuple[str, tuple[str, ...]], ...] = ()
    calls: dict[str, list] = field(default_factory=dict)


def sub_modules(model: nn.Module, name: str) -> list[str]:
    """The modules a block's forward may chain: its children, lists and Sequentials of blocks flattened, no Identity."""
    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for key, child in module.named_children():
            full = f"{prefix}.{key}" if prefix else key
            if isinstance(child, nn.Identity):
                continue
            # A list, or a Sequential of blocks, holds the modules; a Sequential of single layers
            # (a Linear and its activation) is a block itself.
            if isinstance(child, nn.ModuleList) or (qualifies(child) and any(_is_block(m) for m in child.children())):
                visit(full, child)
            else:
                found.append(full)

    visit(name, model.get_submodule(name))
    return found


def _one_argument(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes exactly one required argument: only such a block can be a chain."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return (len(parameters) == 1 and parameters[0].default is inspect.Parameter.empty
            and parameters[0].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def _subtree(model: nn.Module, stages: Sequence[str]) -> dict[str, list[str]]:
    """Per block that could be expanded (to ``MAX_DEPTH``), its sub-modules."""
    found: dict[str, list[str]] = {}
    frontier = [(name, 0) for name in stages]
    while frontier:
        name, depth = frontier.pop()
        subs = sub_modules(model, name) if depth < MAX_DEPTH and _one_argument(model.get_submodule(name)) else []
        if len(subs) >= 2 and any(_is_block(model.get_submodule(s)) for s in subs):
            found[name] = subs
            frontier.extend((s, depth + 1) for s in subs)
    return found


def _single_tensor_call(calls: list) -> tuple[torch.Tensor, int, torch.Tensor, int] | None:
    """(input, its version at the call, output, its version after) of a module called once on one tensor."""
    if len(calls) != 1:
        return None
    args, kwargs, output, (began, ended) = calls[0]
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
        return None
    return args[0], began[0], output, ended


def chains(block: str, subs: Sequence[str], calls: dict[str, list]) -> bool:
    """Whether one forward ran ``block`` as a chain of ``subs``, each on the previous one's unchanged output.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
        >>> calls = recorded_calls(nn.Sequential(net), lambda m: m(torch.ones(1, 2)).sum(), ["0", "0.0", "0.1"])
        >>> chains("0", ["0.0", "0.1"], calls), chains("0", ["0.1"], calls)
        (True, False)
    """
    outer = _single_tensor_call(calls.get(block, []))
    if outer is None:
        return False
    current, version = outer[0], outer[1]
    for name in subs:
        inner = _single_tensor_call(calls.get(name, []))
        if inner is None or inner[0] is not current or inner[1] != version:
            return False
        current, version = inner[2], inner[3]
    return current is outer[2] and version == outer[3]


def expand(model: nn.Module, step: Callable[[nn.Module], Any], stages: Sequence[str],
           replay: Callable[[], None] = lambda: None) -> Hierarchy:
    """``stages`` planned through their children where their forward chains them (``replay`` runs first)."""
    candidates = _subtree(model, stages)
    if not candidates:
        return Hierarchy(list(stages))
    names = list(dict.fromkeys([*candidates, *(s for subs in candidates.values() for s in subs)]))
    replay()
    calls = recorded_calls(model, step, names)
    room = [MAX_STAGES - len(stages)]
    blocks: list[tuple[str, tuple[str, ...]]] = []

    def visit(name: str) -> list[str]:
        subs = candidates.get(name)
        if not subs or len(subs) - 1 > room[0] or not chains(name, subs, calls):
            return [name]
        room[0] -= len(subs) - 1
        below = [stage for sub in subs for stage in visit(sub)]
        blocks.append((name, tuple(below)))
        return below

    expanded = [stage for name in stages for stage in visit(name)]
    return Hierarchy(expanded, tuple(sorted(blocks, key=lambda b: expanded.index(b[1][0]))), calls)
