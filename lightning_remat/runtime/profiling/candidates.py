"""Find the candidate blocks of a model: the repeated blocks (and a CNN's stem) the solver chooses among."""

from __future__ import annotations

import fnmatch
from typing import Iterable, Sequence, Union

from torch import nn

from ...core.errors import NoCandidateError
from ..installing.compiled import uncompiled

CandidateSpec = Union[None, str, type, Sequence[Union[str, type]]]


def _is_block(module: nn.Module) -> bool:
    # Two or more children: a block (attention + MLP, conv + norm + activation), not a single
    # layer and not a mere container around the real blocks (a ResNet stage holding its layers).
    return len(list(module.children())) >= 2


def _automatic(model: nn.Module) -> list[str]:
    repeated: set[int] = set()
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[nn.Module]] = {}
        for child in container.children():
            by_class.setdefault(type(child), []).append(child)
        # A ModuleList of blocks is a model's layer stack even with one layer (a 1-layer config);
        # in a Sequential, blocks count when they repeat.
        least = 1 if isinstance(container, nn.ModuleList) else 2
        for members in by_class.values():
            if len(members) >= least and all(_is_block(m) for m in members):
                repeated.update(id(m) for m in members)
    stages = _outermost(name for name, module in model.named_modules() if name and id(module) in repeated)
    if not stages and isinstance(model, nn.Sequential) and len(model) >= 2:
        stages = [name for name, _ in model.named_children()]
    # A CNN's first convolution outside the stages: in a stem block before them, or a loose layer on the root.
    first = next((name for name, m in model.named_modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    if first is None or not stages or any(first == s or first.startswith(s + ".") for s in stages):
        return stages
    stem = _convolutional_stem(model, stages, first)
    if stem:
        return [stem, *stages]
    # Registration order, as every other stage: the stem's leaves before the blocks, the head's after.
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted([*_loose_leaves(model, stages, first), *stages], key=order.__getitem__)


def _outermost(names: Iterable[str]) -> list[str]:
    """``names`` less those inside an earlier one: a block inside a chosen block is an option of that stage."""
    kept: list[str] = []
    for name in names:
        if not any(name.startswith(prefix + ".") for prefix in kept):
            kept.append(name)
    return kept


def _loose_leaves(model: nn.Module, stages: list[str], first: str) -> list[str]:
    """A CNN's loose stem and head layers on the root (torchvision's ``conv1``, ..., ``fc``), in-place ones left out."""
    parent_name = first.rpartition(".")[0]
    parent = model.get_submodule(parent_name)
    if parent_name and not isinstance(parent, (nn.Sequential, nn.ModuleList)):
        return []
    prefix = parent_name + "." if parent_name else ""
    return [prefix + key for key, child in parent.named_children()
            if not any(True for _ in child.children()) and not isinstance(child, nn.Identity)
            # An in-place layer (ReLU(inplace=True)) changes its input, which its checkpoint keeps.
            and not getattr(child, "inplace", False)
            and not any((prefix + key) == s or s.startswith(prefix + key + ".") for s in stages)]


def _convolutional_stem(model: nn.Module, stages: list[str], first: str) -> str | None:
    """The outermost block holding a CNN's ``first`` convolution and no stage, when it runs before the stages."""
    names = [name for name, _ in model.named_modules()]
    if names.index(first) > names.index(stages[0]):
        return None
    parts, stem = first.split("."), None
    for k in range(len(parts) - 1, 0, -1):  # its ancestors, nearest first, the model itself excluded
        prefix = ".".join(parts[:k])
        if any(s.startswith(prefix + ".") for s in stages):
            break
        if _is_block(model.get_submodule(prefix)):
            stem = prefix
    return stem


def _matches(name: str, module: nn.Module, spec: Iterable[Union[str, type]]) -> bool:
    return any(isinstance(module, item) if isinstance(item, type)
               else fnmatch.fnmatchcase(name, item) or type(module).__name__ == item for item in spec)


def find_stages(model: nn.Module, candidates: CandidateSpec = None) -> list[str]:
    """Names of the candidate stages of ``model``, outermost first, in registration order.

    ``candidates``: None for automatic; or module classes, class names or ``fnmatch`` name patterns.
    Raises ``NoCandidateError`` when nothing qualifies or a given class or pattern matches nothing.

    Example:
        >>> blocks = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
        >>> find_stages(blocks), find_stages(blocks, candidates="*.0")
        (['0', '1', '2'], ['0.0', '1.0', '2.0'])
    """
    # Names are the uncompiled model's, as profile_step and apply_plan use them.
    with uncompiled(model) as model:
        classes = sorted({type(m).__name__ for m in model.modules()})
        if candidates is None:
            stages = _automatic(model)
            if not stages:
                raise NoCandidateError(
                    f"{type(model).__name__} has no candidate module for recomputation: no repeated blocks in a "
                    f"ModuleList or Sequential were found. Pass candidates= with module classes or name patterns; "
                    f"its module classes are {classes}")
            return stages
        spec = [candidates] if isinstance(candidates, (str, type)) else list(candidates)
        for item in spec:
            if not isinstance(item, (str, type)):
                raise TypeError(f"candidates must be module classes, class names or name patterns, got {item!r}")
        for item in spec:
            if not any(_matches(name, module, [item]) for name, module in model.named_modules() if name):
                raise NoCandidateError(
                    f"candidate {item!r} matches no module of {type(model).__name__}. Its module classes are "
                    f"{classes}; names look like {[n for n, _ in model.named_modules() if n][:8]}")
        return _outermost(name for name, module in model.named_modules() if name and _matches(name, module, spec))
