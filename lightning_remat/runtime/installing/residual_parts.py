"""A residual block in torchvision's layout (``Bottleneck``, ``BasicBlock``) run as checkpointed parts.

Its forward adds the residual in place after its last norm, so it is no chain of its children. Its twin runs
the same modules in order, each ``conv -> norm (-> relu)`` and the downsample under a checkpoint of its own,
then the sum and the last ReLU; the profile offers it only where it gave the block's output bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .records import Behaviour
from .recompute import _needs_graph, _restore_norm_statistics, _run

PAIRS = (("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3"))


def parts_of(module: nn.Module) -> list[tuple[nn.Module, nn.Module]] | None:
    """The ``(conv, norm)`` pairs of a torchvision-layout residual block, or None for any other module.

    >>> from lightning_remat.models import Bottleneck
    >>> len(parts_of(Bottleneck(8, 2))), parts_of(nn.Sequential(nn.Linear(2, 2)))
    (3, None)
    """
    children = dict(module.named_children())
    names = [n for pair in PAIRS for n in pair if n in children]
    if (set(children) - {"downsample"} != {*names, "relu"} or len(names) not in (4, 6)
            or names != [n for pair in PAIRS[:len(names) // 2] for n in pair]
            or not isinstance(children["relu"], nn.ReLU)):
        return None
    pairs = [(children[c], children[b]) for c, b in PAIRS[:len(names) // 2]]
    if not all(isinstance(c, nn.modules.conv._ConvNd) and isinstance(b, nn.modules.batchnorm._NormBase)
               for c, b in pairs):
        return None
    return pairs


def _part(conv: nn.Module, norm: nn.Module, relu: nn.Module | None) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        out = norm(conv(x))
        return out if relu is None else relu(out)
    return run


def twin_forward(module: nn.Module, x: torch.Tensor, checkpointed: bool = True) -> torch.Tensor:
    """``module``'s forward with each part under its own checkpoint (``checkpointed=False``: run plainly).

    >>> from lightning_remat.models import Bottleneck
    >>> block = Bottleneck(8, 2).eval()
    >>> x = torch.randn(1, 8, 4, 4)
    >>> torch.equal(twin_forward(block, x), block(x))
    True
    """
    def run(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        if not checkpointed or not _needs_graph(args, {}, module):
            return fn(*args)
        return checkpoint(functools.partial(_run, module, fn), *args, use_reentrant=False, preserve_rng_state=True)

    pairs = parts_of(module)
    out = x
    for i, (conv, norm) in enumerate(pairs):
        out = run(_part(conv, norm, None if i == len(pairs) - 1 else module.relu), out)
    # After the parts, as torchvision's forward runs it: hooks on the children fire in the model's own order.
    downsample = getattr(module, "downsample", None)
    identity = x if downsample is None else run(downsample, x)
    # Out of place: the last part's output is a checkpoint's; the ReLU then changes the fresh sum only.
    return module.relu(out + identity)


def gives_same_output(module: nn.Module, args: tuple, output: Any) -> bool:
    """Whether the twin, run plainly on ``args`` (running statistics put back), gives ``output`` bit for bit.

    >>> from lightning_remat.models import Bottleneck
    >>> block, x = Bottleneck(8, 2), torch.randn(2, 8, 4, 4)
    >>> gives_same_output(block, (x,), block(x)), gives_same_output(block, (x,), block(x) + 1)
    (True, False)
    """
    if (parts_of(module) is None or len(args) != 1 or not isinstance(args[0], torch.Tensor)
            or not isinstance(output, torch.Tensor)):
        return False
    with torch.no_grad(), _restore_norm_statistics(module):
        twin = twin_forward(module, args[0], checkpointed=False)
    return twin.shape == output.shape and torch.equal(twin, output)


class ResidualParts(Behaviour):
    """A residual block's forward replaced by its twin of checkpointed parts (innermost: a recompute runs it)."""

    name = "residual_parts"

    def check(self, modules: dict[str, nn.Module], settings: dict[str, Any]) -> None:
        for name in settings:
            if parts_of(modules[name]) is None:
                raise ValueError(f"{name!r} ({type(modules[name]).__name__}) is no residual block in torchvision's "
                                 "layout (conv1, bn1, conv2, bn2[, conv3, bn3], relu[, downsample]): it has no twin")

    def wrap(self, module: nn.Module, setting: Any, state: Any, call: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(twin_forward, module)


RESIDUAL_PARTS = ResidualParts()
