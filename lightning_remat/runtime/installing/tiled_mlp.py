"""A stage's MLP over sequence chunks (``tile_mlp=True``), each under a checkpoint, so no sequence-long
intermediate lives whole. A plan says ``extra={"tile": "mlp:16"}`` on the stage's action. Only a position-wise
child without active dropout is tiled, so the gradients are the plain step's (docs/long_context.md)."""

from __future__ import annotations

import fnmatch
import functools
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...core.actions import StageAction, add_rule, overlaps
from ...core.errors import InvalidPlanError
from ...core.vocabulary import Action
from .records import RECORD, Behaviour, Target, record_of
from .recompute import _needs_graph

TILE = "tile"  # the behaviour's name: its setting in a stage action's ``extra``
# Class names of position-wise sub-blocks (transformers' LlamaMLP, Qwen2MLP, GPT2MLP, T5DenseActDense, ...).
PATTERNS = ("*MLP", "*Mlp", "*FeedForward", "*FFN", "*DenseActDense", "*DenseGatedActDense")
# Leaves that act on each position alone: linear maps over the last dim, pointwise activations, per-position norms.
_LEAVES = (nn.Linear, nn.Identity, nn.LayerNorm, nn.modules.dropout._DropoutNd)
_LEAF_NAMES = ("Conv1D",)  # transformers' GPT-2 linear (weight transposed)
_NORM_SUFFIXES = ("RMSNorm", "LayerNorm")


def spec(child: str, chunks: int) -> str:
    """A tiled setting: ``child`` of the stage over ``chunks`` sequence chunks.

    >>> spec("mlp", 16), parse("mlp:16")
    ('mlp:16', ('mlp', 16))
    """
    return f"{child}:{int(chunks)}"


def parse(setting: Any) -> tuple[str, int]:
    """``(child, chunks)`` of a tiled setting, or a ValueError saying what one is."""
    child, _, count = str(setting).rpartition(":") if isinstance(setting, str) else ("", "", "")
    if not child or not count.isdigit() or int(count) < 2:
        raise ValueError(f"a tiled MLP's setting is 'child:chunks' with chunks >= 2 (such as 'mlp:16'), got {setting!r}")
    return child, int(count)


def child_name(stage: str, child: str) -> str:
    """The module name of ``stage``'s child ``child`` (the model itself is stage "").

    >>> child_name("model.layers.0", "mlp"), child_name("", "mlp")
    ('model.layers.0.mlp', 'mlp')
    """
    return f"{stage}.{child}" if stage else child


def _leaf_ok(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return not (module.training and module.p > 0)  # active dropout: masks per chunk are not the plain model's
    name = type(module).__name__
    return (isinstance(module, _LEAVES) or name in _LEAF_NAMES or name.endswith(_NORM_SUFFIXES)
            or type(module).__module__.startswith(("torch.nn.modules.activation", "transformers.activations")))


def refusal(module: nn.Module) -> str | None:
    """Why ``module`` is not tiled over the sequence, or None.

    >>> class TinyMLP(nn.Sequential):
    ...     pass
    >>> refusal(TinyMLP(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))) is None
    True
    >>> refusal(TinyMLP(nn.Linear(4, 4), nn.Dropout(0.1)))
    'TinyMLP has dropout active in training (its masks over chunks would differ from the plain model)'
    """
    name = type(module).__name__
    if not any(fnmatch.fnmatchcase(name, p) for p in PATTERNS):
        return f"{name} is not a known position-wise class ({', '.join(PATTERNS)})"
    leaves = [m for m in module.modules() if not any(True for _ in m.children())]
    dropout = [m for m in leaves if isinstance(m, nn.modules.dropout._DropoutNd) and not _leaf_ok(m)]
    if dropout:
        return f"{name} has dropout active in training (its masks over chunks would differ from the plain model)"
    other = sorted({type(m).__name__ for m in leaves if not _leaf_ok(m)})
    return f"{name} holds {other}, not known to act on each position alone" if other else None


def tiled_forward(call: Callable[..., Any], chunks: int, x: torch.Tensor) -> torch.Tensor:
    """``call(x)`` over ``chunks`` pieces of ``x``'s positions, each checkpointed; outputs concatenated.

    >>> mlp = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))
    >>> x = torch.randn(2, 10, 4, requires_grad=True)
    >>> torch.allclose(tiled_forward(mlp, 4, x), mlp(x), atol=1e-6)
    True
    """
    # RNG state preserved as recompute does (no dropout is active in a tiled module: ``refusal``).
    return joined([checkpoint(call, part, use_reentrant=False, preserve_rng_state=True)
                   for part in pieces(x, chunks)], x)


def pieces(x: torch.Tensor, chunks: int) -> tuple[torch.Tensor, ...]:
    """``x``'s positions in ``chunks`` contiguous (1, tokens, hidden) views: chunks along the second-last dim of a
    batch of several would not be contiguous, which a module that ``view``s its input refuses.

    >>> x = torch.arange(24.0).reshape(2, 3, 4)
    >>> [p.shape[1] for p in pieces(x, 4)], torch.equal(joined(pieces(x, 4), x), x)
    ([2, 2, 1, 1], True)
    """
    flat = x.reshape(1, -1, x.shape[-1]) if x.dim() > 2 else x.unsqueeze(0)
    return flat.tensor_split(min(chunks, flat.shape[1]), dim=1)


def joined(outputs: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The outputs of ``pieces(x, ...)`` as one output of ``x``'s leading shape (``pieces`` has an example)."""
    return torch.cat(list(outputs), dim=1).reshape(*x.shape[:-1], -1)


def _tiled_call(module: nn.Module, chunks: int, call: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    x = args[0] if len(args) == 1 and not kwargs else None
    # Only a training forward of one (..., sequence, hidden) tensor is tiled; anything else runs as it is.
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-2] < 2 or not _needs_graph(args, kwargs, module):
        return call(*args, **kwargs)
    return tiled_forward(call, chunks, x)


class TiledMLP(Behaviour):
    """``extra["tile"]``: the stage's child runs over sequence chunks (record on the child, reads per stage).

    >>> TILED_MLP.settings(StageAction("layers.0", extra={"tile": "mlp:16"}))
    {'layers.0': 'mlp:16'}
    """

    name = TILE

    def check(self, modules: dict[str, nn.Module], settings: dict[str, Any]) -> None:
        for stage, setting in settings.items():
            child, _ = parse(setting)
            module = modules.get(child_name(stage, child))
            if module is None:
                raise ValueError(f"a tiled MLP names a child of its stage; {stage!r} has no {child!r}")
            why = refusal(module)
            if why is not None:
                raise ValueError(f"stage {stage!r}: {child!r} is not tiled over the sequence: {why}")

    def install(self, target: Target, settings: dict[str, Any]) -> None:
        for stage, setting in settings.items():
            child, chunks = parse(setting)
            record_of(target.modules[child_name(stage, child)]).behaviours[self.name] = (chunks, (stage, child))

    def wrap(self, module: nn.Module, setting: Any, state: Any, call: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(_tiled_call, module, setting, call)

    def read(self, modules: Any, only_running: bool = False) -> dict[str, Any]:
        found = {}
        for name in super().read(modules, only_running):  # per child with a record: the stage it is tiled for
            chunks, (stage, child) = modules[name].__dict__[RECORD].behaviours[self.name]
            found[stage] = spec(child, chunks)
        return found


TILED_MLP = TiledMLP()


@add_rule
def _tile_rule(actions: Sequence[StageAction]) -> None:
    """A tiled child is not itself recomputed alone, nor is its stage offloaded."""
    tiled = {a.stage: child_name(a.stage, parse(dict(a.extra)[TILE])[0]) for a in actions if TILE in dict(a.extra)}
    recomputed = [m for a in actions if a.action is Action.RECOMPUTE for m in a.modules]
    clash = sorted(s for s, child in tiled.items()
                   if any(m == child or m.startswith(child + ".") for m in recomputed) or
                   any(a.action is Action.OFFLOAD and overlaps(a.stage, [s]) for a in actions))
    if clash:
        raise InvalidPlanError(f"stage(s) {clash}: a tiled MLP is neither recomputed alone nor offloaded")
