"""The tiled-MLP options of each stage (``tile_mlp=True``): ``BASES`` with the stage's position-wise child over
sequence chunks. A child is tiled where ``refusal`` accepts it, it maps one (..., sequence, hidden) tensor to one
of the same leading shape, and on real tensors its output over chunks equals its whole output."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ...core.actions import StageAction
from ...core.offload_model import OFFLOAD_INPUT
from ..installing.tiled_mlp import TILE, child_name, joined, parse, pieces, refusal, spec
from ..measuring.runner import Step

_PREFIX = TILE + ":"
BASES = ("keep", "whole", OFFLOAD_INPUT)  # the options a tiled MLP is offered with
# How close the chunks' output must be to the whole output (relative, by norm): far above rounding, far below
# what mixing positions (a mean over the sequence, a norm over it) gives.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
HALF_TOLERANCE = 2e-2


def tiled_name(base: str, setting: str) -> str:
    """The option name of ``base`` with its stage's MLP tiled as ``setting``.

    Example:
        >>> tiled_name("keep", "mlp:16"), tiled_name("whole", "mlp:16")
        ('tile:mlp:16', 'whole+tile:mlp:16')
    """
    return _PREFIX + setting if base == "keep" else f"{base}+{_PREFIX}{setting}"


def tiled_modules(stage: str, setting: str) -> tuple[str, ...]:
    """The module a tiled option runs again (its cost: one more forward of it), none for "".

    Example:
        >>> tiled_modules("model.layers.0", "mlp:16"), tiled_modules("model.layers.0", "")
        (('model.layers.0.mlp',), ())
    """
    return (child_name(stage, parse(setting)[0]),) if setting else ()


def chunk_count(tokens: int, hidden: int) -> int:
    """Chunks of about ``hidden`` tokens each (as ALST tiles its MLP), a power of two from 2, at most ``tokens``.

    Example:
        >>> chunk_count(131072, 4096), chunk_count(128, 32), chunk_count(64, 4096)
        (32, 4, 2)
    """
    chunks = 2
    while tokens / chunks > max(hidden, 1) and chunks * 2 <= tokens:
        chunks *= 2
    return min(chunks, max(tokens, 1))


def _same_output(module: nn.Module, x: torch.Tensor, output: torch.Tensor, chunks: int) -> bool:
    if isinstance(x, FakeTensor) or x.device.type == "meta":
        return True  # nothing to compare: the class rule stands alone
    tiled = joined([module.forward(part) for part in pieces(x, chunks)], x)
    tolerance = TOLERANCE.get(output.dtype, HALF_TOLERANCE)
    gap = (tiled.float() - output.float()).norm()
    return bool(gap <= tolerance * output.float().norm() + 1e-30)


def tiled_settings(model: nn.Module, step: Step, order: Sequence[str], replay: Callable[[], None]
                   ) -> tuple[dict[str, str], str]:
    """Per stage of ``order``, the tiled setting of its position-wise child, and a note.

    Example:
        >>> class TinyMLP(nn.Sequential):
        ...     pass
        >>> net = nn.Sequential(*[nn.Sequential(nn.LayerNorm(4), TinyMLP(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)))
        ...                       for _ in range(2)])
        >>> x = torch.randn(2, 64, 4)
        >>> tiled_settings(net, lambda m: m(x).sum(), ["0", "1"], lambda: None)[0]  # 128 positions, chunks of 4
        {'0': '1:32', '1': '1:32'}
    """
    modules = dict(model.named_modules())
    seen: dict[str, list[tuple[str, int, bool]]] = {}  # stage -> per call: child, chunks, whether it holds

    def watch(stage: str, child: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            x = args[0] if len(args) == 1 and not kwargs else None
            shaped = isinstance(x, torch.Tensor) and isinstance(output, torch.Tensor) and x.dim() >= 2 \
                and x.shape[-2] >= 2 and output.shape[:-1] == x.shape[:-1]
            chunks = chunk_count(x.numel() // max(x.shape[-1], 1), x.shape[-1]) if shaped else 0
            seen.setdefault(stage, []).append((child, chunks, shaped and _same_output(module, x, output, chunks)))
        return hook

    with contextlib.ExitStack() as hooks:
        for stage in dict.fromkeys(order):
            for child, module in modules[stage].named_children():
                if refusal(module) is None:
                    hooks.enter_context(module.register_forward_hook(watch(stage, child), with_kwargs=True))
                    break  # one tiled child per stage: the first position-wise one
        replay()
        with torch.no_grad():
            step(model)
    settings = {stage: spec(calls[0][0], min(c for _, c, _ in calls)) for stage, calls in seen.items()
                if all(ok for _, _, ok in calls)}
    if not settings:
        return settings, ("tile_mlp: no stage has a child of a position-wise class (*MLP, *FeedForward, "
                          "DenseActDense) without active dropout whose output over sequence chunks equals its whole "
                          "output; nothing is tiled")
    children = sorted({f"{type(modules[child_name(s, parse(v)[0])]).__name__} over {parse(v)[1]} chunks"
                       for s, v in settings.items()})
    return settings, ("tile_mlp: options with the MLP over sequence chunks, each recomputed in backward: "
                      + ", ".join(children))


def add_tiled_options(offered: dict[str, dict[str, StageAction]], settings: dict[str, str]) -> None:
    """Add to ``offered`` (option -> stage -> action) each base of ``BASES`` with the MLP tiled.

    Example:
        >>> offered = {"keep": {"h.0": StageAction("h.0")}, "whole": {"h.0": StageAction.recompute("h.0")}}
        >>> add_tiled_options(offered, {"h.0": "mlp:8"})
        >>> offered["whole+tile:mlp:8"]["h.0"].extra
        (('tile', 'mlp:8'),)
    """
    for base in [b for b in BASES if b in offered]:
        for setting in sorted(set(settings.values())):
            stages = {s: replace(offered[base][s], extra={**dict(offered[base][s].extra), TILE: setting})
                      for s, v in settings.items() if v == setting and s in offered[base]}
            if stages:
                offered[tiled_name(base, setting)] = stages
