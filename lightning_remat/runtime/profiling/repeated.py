"""Profile a stack of identical layers once: measure 4 and 5 layers, extrapolate to N.

A transformer is N interchangeable layers between an embedding and a head, and every term of its
profile is linear in where a stage sits, which lets a deep model be profiled from two shallow copies:

- a stage's stored bytes, saved bytes and FLOPs do not depend on the depth;
- a peak is the higher of a forward figure and a backward figure. Each counts the static memory
  (parameters, buffers, the optimizer state counted ahead), which grows by the same bytes per
  layer, and the backward one also the gradients of the layers after the stage:
  ``figure = a + s * N + g * d``, ``d`` the number of layers after it.

The higher of two lines is not a line, so the two figures are measured apart: each copy is profiled
with ballast (a pebibyte of fake memory) held through forward, which makes every peak its forward
figure, and again with it held through backward. Each figure is extrapolated alone and the peak is
the higher. The first and last layers (and the gaps beside them) may differ from the middle ones (the
first layer's input is the embedding's output, the last one feeds the head); they are fitted in
``N`` alone. The middle layers give five points for three unknowns, so the linear form is checked,
not assumed; whatever does not fit returns None and the caller profiles the whole model.

Only the fake (``FakeTensorMode``) path uses it: the shallow copies share the fake model's
tensors, so nothing is allocated and the user's model is never changed.

Example:
    >>> import transformers, torch
    >>> config = transformers.LlamaConfig(num_hidden_layers=12, hidden_size=64, intermediate_size=128,
    ...                                   num_attention_heads=4, vocab_size=128)
    >>> with torch.device("meta"):
    ...     model = transformers.LlamaForCausalLM(config)
    >>> stack = repeated_stack(model, None)
    >>> stack.prefix, stack.layers
    ('model.layers', 12)
"""

from __future__ import annotations

import copy
import functools
import math
import re
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from ...core.config import ProfileOptions
from ...core.errors import RematError
from ...core.memory_model import Profile, Segment, predict_peak
from .candidates import find_stages
from ..targets.fake import _shallow_module_copy

# Fewer layers than this are profiled whole: 4 + 5 layers cost about as much.
MIN_LAYERS = 10
# The two depths profiled. Five points on the middle layers (two in the first, three in the
# second) check the three-term linear form.
DEPTHS = (4, 5)
_SIMPLE = (str, bool, int, float, type(None))

ProfileRun = Callable[[nn.Module, "torch.optim.Optimizer | None", "Callable | None"], Profile]


@dataclass(frozen=True)
class RepeatedStack:
    """The model's stages are the ``layers`` interchangeable children of the ``ModuleList`` at ``prefix``.

    Example:
        >>> RepeatedStack("transformer.h", 48).stage(3)
        'transformer.h.3'
    """

    prefix: str
    layers: int

    def stage(self, index: int) -> str:
        """The name of layer ``index``."""
        return f"{self.prefix}.{index}"


def repeated_stack(model: nn.Module, candidates: Any) -> RepeatedStack | None:
    """The model's stack of interchangeable layers, or None when its stages are not one.

    The stages must be every child of one ``nn.ModuleList``, at least ``MIN_LAYERS`` of them, of one
    class, with the same parameters and buffers (names, shapes, dtypes, ``requires_grad``), the same
    submodule tree and the same plain attributes (strings, numbers, flags; a layer's own index
    excepted). A config with per-layer settings that differ (``layer_types`` mixing sliding and full
    attention, any other list with one entry per layer) is refused.
    """
    try:
        names = find_stages(model, candidates)
    except RematError:
        return None
    if len(names) < MIN_LAYERS or "." not in names[0]:
        return None
    prefix = names[0].rsplit(".", 1)[0]
    parent = model.get_submodule(prefix)
    if not isinstance(parent, nn.ModuleList) or names != [f"{prefix}.{i}" for i in range(len(parent))]:
        return None
    layers = list(parent)
    if len({type(layer) for layer in layers}) != 1:
        return None
    signatures = [_signature(layer) for layer in layers]
    if any(s != signatures[0] for s in signatures[1:]):
        return None
    attributes = [_attributes(layer) for layer in layers]
    # A layer's index (layer_idx: which cache slot it writes) is the one attribute allowed to differ.
    own_index = {key for key in attributes[0] if all(a.get(key) == i for i, a in enumerate(attributes))}
    attributes = [{k: v for k, v in a.items() if k not in own_index} for a in attributes]
    if any(a != attributes[0] for a in attributes[1:]):
        return None
    if _config_differs_per_layer(getattr(model, "config", None), len(layers)):
        return None
    return RepeatedStack(prefix, len(layers))


def _signature(layer: nn.Module) -> tuple:
    tensors = [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in layer.named_parameters()]
    tensors += [(n, tuple(t.shape), t.dtype) for n, t in layer.named_buffers()]
    modules = [(n, type(m)) for n, m in layer.named_modules()]
    return tuple(tensors), tuple(modules)


def _attributes(layer: nn.Module) -> dict[tuple[str, str], Any]:
    found = {}
    for name, module in layer.named_modules():
        for key, value in vars(module).items():
            if key.startswith("_") or key == "training":
                continue
            if isinstance(value, _SIMPLE) or (isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value)):
                found[(name, key)] = value
    return found


def _config_differs_per_layer(config: Any, layers: int) -> bool:
    if config is None:
        return False
    for value in _config_items(config).values():
        if isinstance(value, (list, tuple)) and len(value) == layers and len({repr(v) for v in value}) > 1:
            return True
    # Qwen2-style: sliding-window attention in the layers from max_window_layers on.
    window_layers = getattr(config, "max_window_layers", None)
    if getattr(config, "use_sliding_window", False) and isinstance(window_layers, int) and window_layers < layers:
        return True
    return False


def _config_items(config: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


def truncated(model: nn.Module, stack: RepeatedStack, layers: int) -> nn.Module:
    """A shallow copy of ``model`` with only the first ``layers`` layers of ``stack``.

    The copy shares the model's tensors and layer objects' tensors (nothing is allocated); a
    transformers config is copied with ``num_hidden_layers`` (and any per-layer list) cut to match,
    for forwards that read it (``self.layers[: config.num_hidden_layers]``).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.ReLU())] * 12))
        >>> len(truncated(net, RepeatedStack("1", 12), 4)[1]), len(net[1])
        (4, 12)
    """
    twin = _shallow_module_copy(model)
    parent = twin.get_submodule(stack.prefix)
    object.__setattr__(parent, "_modules", {str(i): parent._modules[str(i)] for i in range(layers)})
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):
        short = copy.copy(config)
        for key, value in _config_items(config).items():
            if isinstance(value, (list, tuple)) and len(value) == stack.layers:
                setattr(short, key, type(value)(value[:layers]))
        short.num_hidden_layers = layers
        for module in twin.modules():
            if module.__dict__.get("config") is config:
                module.__dict__["config"] = short
    return twin


def _sub_optimizer(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> torch.optim.Optimizer | None:
    """An optimizer of the same class and settings over the parameters ``model`` still has."""
    if optimizer is None:
        return None
    kept = {id(p) for p in model.parameters()}
    groups = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if id(p) in kept]
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    clone = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k not in groups[0]})
    for group in clone.param_groups:
        for p in group["params"]:
            if p in optimizer.state:
                clone.state[p] = optimizer.state[p]
    return clone


def repeated_profile(model: nn.Module, optimizer: torch.optim.Optimizer | None, options: ProfileOptions,
                     run: ProfileRun) -> Profile | None:
    """The profile of ``model`` extrapolated from ``run`` on 4- and 5-layer copies, or None.

    None when ``options.repeated_blocks`` is off, when the model's stages are not a stack of
    interchangeable layers (``repeated_stack``), or when the profiles do not fit (``extrapolate``);
    the caller then profiles the whole model. Each copy is profiled twice, with ballast held in
    forward and with ballast held in backward, so every peak shows its forward figure in one run
    and its backward figure in the other.

    Args:
        model: the (fake) model; not changed.
        optimizer: its optimizer, over ``model``'s parameters.
        options: the profile options (``candidates``, ``repeated_blocks``).
        run: ``run(model, optimizer, wrap)`` profiles a model: the same call the whole model would
            get, with its step replaced by ``wrap(step)``.
    """
    if not getattr(options, "repeated_blocks", True):
        return None
    stack = repeated_stack(model, options.candidates)
    if stack is None:
        return None
    shorts = [truncated(model, stack, layers) for layers in DEPTHS]
    lifted = {phase: tuple(run(short, _sub_optimizer(optimizer, short),
                               lambda step, phase=phase: with_ballast(step, BALLAST, phase)) for short in shorts)
              for phase in ("forward", "backward")}
    return extrapolate(lifted["forward"], lifted["backward"], BALLAST, stack.prefix, stack.layers)


# Above any figure a profile measures (a pebibyte); fake tensors allocate nothing.
BALLAST = 2**50


def _ballast_tensor(nbytes: int, device: torch.device | None) -> torch.Tensor:
    """Two bytes ``nbytes - 1`` apart: a storage of ``nbytes`` (what the memory tracker counts) in a
    tensor of two elements (what the roofline's op recorder counts as moved: an ``empty`` of
    ``nbytes`` would price the step hundreds of seconds higher)."""
    return torch.empty_strided((2,), (nbytes - 1,), dtype=torch.uint8, device=device)


class _Ballast(torch.autograd.Function):
    """Identity on the loss. Forward phase: releases ``held`` (allocated before the forward) when the
    backward pass starts. Backward phase: allocates ``nbytes`` when it starts, held until it ends."""

    @staticmethod
    def forward(ctx, loss, held, nbytes):  # type: ignore[no-untyped-def, override]
        ctx.held, ctx.nbytes = held, nbytes
        return loss.view_as(loss)  # a view: no storage of its own

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        ctx.held = None
        if ctx.nbytes:
            held = [_ballast_tensor(ctx.nbytes, grad.device)]
            torch.autograd.Variable._execution_engine.queue_callback(held.clear)
        return grad, None, None


def with_ballast(step: Callable, nbytes: int, phase: str) -> Callable:
    """``step`` whose forward (``phase="forward"``) or backward pass holds ``nbytes`` more throughout.

    Every peak of a profile is the higher of a forward and a backward figure; with ballast larger
    than any figure, the profile shows one of the two (plus ``nbytes``).

    Example:
        >>> net = nn.Linear(4, 4)
        >>> loss = with_ballast(lambda m: m(torch.ones(2, 4)).sum(), 1000, "backward")(net)
        >>> loss.backward(); net.weight.grad.shape
        torch.Size([4, 4])
    """
    if phase not in ("forward", "backward"):
        raise ValueError(f"phase must be 'forward' or 'backward', got {phase!r}")

    def lifted(model: nn.Module) -> torch.Tensor:
        held = _ballast_tensor(nbytes, None) if phase == "forward" else None
        loss = step(model)
        return _Ballast.apply(loss, held, nbytes if phase == "backward" else 0)

    return lifted


def extrapolate(forward: tuple[Profile, Profile], backward: tuple[Profile, Profile], ballast: int, prefix: str,
                layers: int) -> Profile | None:
    """The profile of ``layers`` layers from profiles of ``DEPTHS`` layers, or None where it does not fit.

    Args:
        forward: the profiles of the model cut to ``DEPTHS[0]`` and ``DEPTHS[1]`` layers, measured
            with ``ballast`` held in forward (``with_ballast``): every peak is its forward figure.
        backward: the same, with the ballast held in backward.
        ballast: its size.
        prefix: the name of the layers' ``ModuleList`` (stages are ``prefix.i``).
        layers: the depth to extrapolate to.

    Every number is linear: in ``N`` and ``d`` (layers after it) for the middle layers, checked on
    five points for three unknowns; in ``N`` for the first and last layers, the gaps beside them and
    the rest. A peak is the higher of its forward and backward figures, each extrapolated alone.

    Example:
        >>> from lightning_remat.core.memory_model import StageOption, StageProfile
        >>> def chain(n, fw=0, bw=0):  # static n bytes; forward peak 25; backward 20 + 3 per later layer
        ...     stages = tuple(StageProfile(f"l.{i}", (StageOption("keep", (), 10, n + max(25 + fw,
        ...                    20 + 3 * (n - 1 - i) + bw), 0.0, 5),)) for i in range(n))
        ...     segs = tuple(Segment(f"between stages ({j} stored)", j, n + max(fw, 3 * (n - j) + bw))
        ...                  for j in range(1, n + 1))
        ...     p = Profile(stages, segs, parameter_bytes=n, baseline_step_flops=10 * n + 1)
        ...     p.baseline_peak_bytes = predict_peak(p, [0] * n)
        ...     return p
        >>> deep = extrapolate((chain(4, fw=99), chain(5, fw=99)), (chain(4, bw=99), chain(5, bw=99)), 99, "l", 12)
        >>> deep.stages == chain(12).stages, deep.segments == chain(12).segments, deep.baseline_step_flops
        (True, True, 121)
    """
    a, b = DEPTHS
    for p, q, n in zip(forward, backward, DEPTHS):
        if [s.name for s in p.stages] != [f"{prefix}.{i}" for i in range(n)] or not _same(_skeleton(p), _skeleton(q)):
            return None
        if p.baseline_peak_bytes != predict_peak(p, [0] * n):
            return None
    if forward[0].notes != forward[1].notes or forward[0].device != forward[1].device:
        return None
    fit = _Fit(layers)
    try:
        small, large = (_paired(p, q, ballast) for p, q in zip(forward, backward))
        build_stages = _stages(small, large, prefix, layers, fit)
        gap_runs = tuple(_gap_runs(p, q, ballast) for p, q in zip(forward, backward))
        build_segments = _segments(small, large, layers, fit, gap_runs)
        top = _fields(small, large, ("stages", "segments", "notes", "device", "baseline_peak_bytes"),
                      lambda v, w, _: fit.boundary(v, w))
        stages, segments = build_stages(), build_segments()
        top = {k: f() for k, f in top.items()}
    except _NoFit:
        return None
    note = (f"extrapolated from profiles of {a} and {b} of the {layers} identical layers of {prefix} (every "
            "forward and backward figure is linear in the depth, checked on the measured layers); "
            "ProfileOptions(repeated_blocks=False) profiles every layer")
    profile = replace(small, stages=stages, segments=segments, notes=(*large.notes, note), **top)
    profile.baseline_peak_bytes = predict_peak(profile, [0] * len(stages))
    return profile


def _skeleton(profile: Profile) -> dict:
    """Everything but the peaks (which the ballast lifts) and the baseline."""
    data = profile.to_dict()
    for stage in data["stages"]:
        for option in stage["options"]:
            option.pop("local_peak_bytes")
    for segment in data["segments"]:
        segment.pop("peak_bytes")
    data.pop("baseline_peak_bytes")
    return data


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to a relative 1e-9: roofline seconds are float sums over thousands of ops, whose
    last bits differ between the forward- and backward-ballast runs. Everything else exactly.

    Example:
        >>> _same({"s": [0.1 + 0.2, 3]}, {"s": [0.3, 3]}), _same({"s": [1]}, {"s": [2]})
        (True, False)
    """
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class _NoFit(Exception):
    pass


class _Fit:
    """Fits every number of the profile on the two depths.

    A middle layer's number is ``v(N, d) = α + β N + γ d`` (``d`` layers after it): stored bytes and
    FLOPs are constant; a peak's figures count the static memory (``β`` per layer) and, in backward,
    the later layers' gradients (``γ`` each). Other numbers are linear in ``N``. A peak (a ``_Pair``)
    is the higher of its two figures, each extrapolated alone. Figures are not clamped (the profile
    keeps a figure below zero, as FSDP2 makes them deep in the forward), so every line is exact.
    Results are closures.
    """

    def __init__(self, layers: int):
        self.layers = layers

    def middle(self, points: dict[tuple[int, int], Any]) -> Callable[[int], Any]:
        """``points[(N, d)]`` for the measured middle layers; returns ``d -> value`` at ``self.layers``."""
        if isinstance(next(iter(points.values())), _Pair):
            figures = [self._figure({k: getattr(pair, phase) for k, pair in points.items()})
                       for phase in ("forward", "backward")]
            present = [f for f in figures if f is not None]
            if not present:
                raise _NoFit
            return lambda d: max(f(d) for f in present)
        a, b = DEPTHS
        beta = points[(b, 1)] - points[(a, 1)]
        gamma = points[(a, 2)] - points[(a, 1)]
        base = points[(a, 1)]
        for (n, d), value in points.items():
            expected = base + beta * (n - a) + gamma * (d - 1)
            # Bytes and FLOPs must fit exactly; seconds (a real profile's timings) to rounding.
            if value != expected and not (isinstance(value, float) and math.isclose(value, expected, rel_tol=1e-6,
                                                                                      abs_tol=1e-12)):
                raise _NoFit
        return lambda d: base + beta * (self.layers - a) + gamma * (d - 1)

    def boundary(self, small: Any, large: Any) -> Callable[[], Any]:
        """A number of the first layer, the last, a gap or the whole profile: linear in ``N``."""
        if isinstance(small, _Pair):
            figures = []
            for phase in ("forward", "backward"):
                v, w = getattr(small, phase), getattr(large, phase)
                if (v is None) != (w is None):
                    raise _NoFit  # a pass visits the region at one depth and not at the other
                if v is not None:
                    figures.append(self.boundary(v, w))
            if not figures:
                raise _NoFit
            return lambda: max(f() for f in figures)
        if not _is_number(small):
            if small != large:
                raise _NoFit
            return lambda: small
        return lambda: small + (large - small) * (self.layers - DEPTHS[0])

    def _figure(self, points: dict[tuple[int, int], int | None]) -> Callable[[int], int] | None:
        """One phase's figure of a middle peak: None where that pass visits none of the measured
        regions (FSDP2 leaves no moment between two late layers in backward), a line where it visits all."""
        missing = [k for k, v in points.items() if v is None]
        if len(missing) == len(points):
            return None
        if missing:
            raise _NoFit
        return self.middle(points)


@dataclass(frozen=True)
class _Pair:
    """A peak's forward and backward figures."""

    forward: int | None
    backward: int | None


def _paired(forward: Profile, backward: Profile, ballast: int) -> Profile:
    """``forward`` with every peak a ``_Pair`` of its figures (``_pair``)."""
    pair = functools.partial(_pair, ballast=ballast)
    stages = tuple(replace(s, options=tuple(replace(o, local_peak_bytes=pair(o.local_peak_bytes, q.local_peak_bytes))
                                            for o, q in zip(s.options, t.options)))
                   for s, t in zip(forward.stages, backward.stages))
    segments = tuple(replace(g, peak_bytes=pair(g.peak_bytes, h.peak_bytes))
                     for g, h in zip(forward.segments, backward.segments))
    return replace(forward, stages=stages, segments=segments)


def _pair(up: int, down: int, ballast: int) -> _Pair:
    """A peak's figures from its forward-ballast and backward-ballast values, less the ballast. A
    figure the ballast did not lift is None (that pass never visited the region); a peak lifted in
    neither run (the optimizer step's, outside forward and backward) keeps both values."""

    def lifted(value: int) -> int | None:
        # Half the ballast: a lifted figure sits below it where the region's own figure is negative
        # (FSDP2 frees unsharded parameters the stored bytes count).
        return value - ballast if value >= ballast // 2 else None

    forward, backward = lifted(up), lifted(down)
    if forward is None and backward is None:
        return _Pair(up, down)
    # A run the ballast did not lift never visited the region in that pass (FSDP2 leaves no moment
    # between two late layers in backward): that figure does not exist.
    return _Pair(forward, backward)


def _gap_runs(forward: Profile, backward: Profile, ballast: int) -> dict[str, dict[str, _Pair]] | None:
    """Each gap's figures per memory run (``profile.gap_figures``), paired as ``_paired`` pairs peaks."""
    up, down = getattr(forward, "gap_figures", None), getattr(backward, "gap_figures", None)
    if up is None or down is None or up.keys() != down.keys():
        return None
    if any(up[name].keys() != down[name].keys() for name in up):
        return None
    return {name: {run: _pair(up[name][run], down[name][run], ballast) for run in up[name]} for name in up}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Option fields that hold module names (renamed per layer, not fitted).
_NAMES = ("name", "checkpointed", "offloaded")


def _fields(small: Any, large: Any, skip: tuple, combine: Callable[[Any, Any, str], Any]) -> dict[str, Any]:
    if type(small) is not type(large) or not is_dataclass(small):
        raise _NoFit
    return {f.name: combine(getattr(small, f.name), getattr(large, f.name), f.name)
            for f in fields(small) if f.name not in skip}


def _rename(names: tuple, old: str, new: str) -> tuple:
    out = []
    for name in names:
        if name != old and not name.startswith(old + "."):
            raise _NoFit
        out.append(new + name[len(old):])
    return tuple(out)


def _stages(small: Profile, large: Profile, prefix: str, layers: int, fit: _Fit) -> Callable[[], tuple]:
    a, b = DEPTHS
    middle = {**{(a, a - 1 - i): small.stages[i] for i in range(1, a - 1)},
              **{(b, b - 1 - i): large.stages[i] for i in range(1, b - 1)}}
    reference = large.stages[1]
    for stage in middle.values():
        if [o.name for o in stage.options] != [o.name for o in reference.options] or \
                stage.module_type != reference.module_type:
            raise _NoFit
    numbers = {k: fit.middle({key: getattr(s, k) for key, s in middle.items()})
               for k, v in _fields(reference, reference, ("name", "options"), lambda v, w, _: v).items()
               if _is_number(v)}
    option_numbers = []
    for j, option in enumerate(reference.options):
        for stage in middle.values():
            if [c[len(stage.name):] for c in (*stage.options[j].checkpointed, *stage.options[j].offloaded)] != \
                    [c[len(reference.name):] for c in (*option.checkpointed, *option.offloaded)]:
                raise _NoFit
        option_numbers.append({k: fit.middle({key: getattr(s.options[j], k) for key, s in middle.items()})
                               for k, v in _fields(option, option, _NAMES, lambda v, w, _: v).items()
                               if _is_number(v) or isinstance(v, _Pair)})

    def middle_stage(i: int):
        d = layers - 1 - i
        options = tuple(replace(o, checkpointed=_rename(o.checkpointed, reference.name, f"{prefix}.{i}"),
                                offloaded=_rename(o.offloaded, reference.name, f"{prefix}.{i}"),
                                **{k: f(d) for k, f in option_numbers[j].items()})
                        for j, o in enumerate(reference.options))
        return replace(reference, name=f"{prefix}.{i}", options=options, **{k: f(d) for k, f in numbers.items()})

    def boundary_stage(s, t, i: int):
        if [o.name for o in s.options] != [o.name for o in t.options]:
            raise _NoFit
        options = []
        for o, p in zip(s.options, t.options):
            if _rename(o.checkpointed, s.name, t.name) != p.checkpointed or _rename(o.offloaded, s.name, t.name) != p.offloaded:
                raise _NoFit
            values = _fields(o, p, _NAMES, lambda v, w, _: fit.boundary(v, w))
            values["offloaded"] = functools.partial(_rename, p.offloaded, t.name, f"{prefix}.{i}")
            options.append((p, _rename(p.checkpointed, t.name, f"{prefix}.{i}"), values))
        values = _fields(s, t, ("name", "options"), lambda v, w, _: fit.boundary(v, w))
        return lambda: replace(t, name=f"{prefix}.{i}", options=tuple(
            replace(p, checkpointed=c, **{k: f() for k, f in vs.items()}) for p, c, vs in options),
            **{k: f() for k, f in values.items()})

    first = boundary_stage(small.stages[0], large.stages[0], 0)
    last = boundary_stage(small.stages[a - 1], large.stages[b - 1], layers - 1)
    return lambda: (first(), *(middle_stage(i) for i in range(1, layers - 1)), last())


def _segments(small: Profile, large: Profile, layers: int, fit: _Fit,
              gap_runs: tuple = (None, None)) -> Callable[[], tuple]:
    """Segments by role: stages_alive 0 (by name), 1 (after the first layer), the middle ones
    (``d`` = layers after), and all stages alive (the head)."""
    a, b = DEPTHS

    def by_role(p: Profile, n: int) -> dict:
        roles: dict = {}
        for seg in p.segments:
            k = seg.stages_alive
            key = re.sub(r"\d+", "#", seg.name)
            role = "zero" if k == 0 else "first" if k == 1 else "last" if k == n else "middle"
            roles.setdefault((role, key), []).append(seg)
        return roles

    rs, rl = by_role(small, a), by_role(large, b)
    if rs.keys() != rl.keys():
        raise _NoFit
    builders: list[tuple[int, Callable[[], list[Segment]]]] = []
    for (role, key), segs in rl.items():
        mine = rs[(role, key)]
        if role == "middle":
            points = {**{(a, a - s.stages_alive): s for s in mine}, **{(b, b - s.stages_alive): s for s in segs}}
            if len(points) != (a - 2) + (b - 2) or len(mine) + len(segs) != len(points):
                raise _NoFit
            peak = _gap_line(fit, {k: s.peak_bytes for k, s in points.items()},
                             _run_points(points, dict(zip((a, b), gap_runs))))
            template = segs[0]
            builders.append((2, lambda peak=peak, template=template: [
                replace(template, name=_restate(template.name, template.stages_alive, j), stages_alive=j,
                        peak_bytes=peak(layers - j)) for j in range(2, layers)]))
            continue
        if len(mine) != 1 or len(segs) != 1:
            raise _NoFit
        s, t = mine[0], segs[0]
        values = _fields(s, t, ("name", "stages_alive"), lambda v, w, _: fit.boundary(v, w))
        runs = _run_points({(a, 0): s, (b, 0): t}, dict(zip((a, b), gap_runs)))
        if runs is not None:
            values["peak_bytes"] = _gap_boundary(fit, runs, values["peak_bytes"])
        alive = layers if role == "last" else t.stages_alive
        name = _restate(t.name, t.stages_alive, alive) if role == "last" else t.name
        # The profile's order: by stages alive, the optimizer step (added last) last.
        order = layers + 1 if name == "optimizer step" else alive
        builders.append((order, lambda t=t, name=name, alive=alive, values=values: [
            replace(t, name=name, stages_alive=alive, **{k: f() for k, f in values.items()})]))

    def build() -> tuple:
        result = tuple(seg for _, make in sorted(builders, key=lambda kv: kv[0]) for seg in make())
        if len(result) != len(large.segments) + (layers - b):
            raise _NoFit
        return result

    return build


def _run_points(points: dict[tuple[int, int], Segment], gap_runs: dict[int, Any]) -> dict[str, dict] | None:
    """``points`` (``(N, d)`` -> segment) as each memory run's figures, or None where a profile has
    none (the optimizer step's segment, a profile without ``gap_figures``) or the runs differ."""
    per_point = {}
    for key, seg in points.items():
        runs = gap_runs.get(key[0])
        if runs is None or seg.name not in runs:
            return None
        per_point[key] = runs[seg.name]
    names = {tuple(r) for r in per_point.values()}
    if len(names) != 1:
        return None
    return {run: {key: figures[run] for key, figures in per_point.items()} for run in next(iter(names))}


def _gap_line(fit: _Fit, peaks: dict, runs: dict[str, dict] | None) -> Callable[[int], int]:
    """A middle gap's peak: the largest of each memory run's figure extrapolated alone (the largest
    of a keep run's figure, falling with the depth, and a recompute run's, flat, bends where they
    cross: no line fits it), else of the peaks themselves."""
    if runs is not None:
        try:
            lines = [fit.middle(points) for points in runs.values()]
            return lambda d: max(line(d) for line in lines)
        except _NoFit:
            pass
    return fit.middle(peaks)


def _gap_boundary(fit: _Fit, runs: dict[str, dict], fallback: Callable[[], int]) -> Callable[[], int]:
    """A first or last gap's peak, as ``_gap_line`` does it, linear in ``N``."""
    a, b = DEPTHS
    try:
        lines = [fit.boundary(points[(a, 0)], points[(b, 0)]) for points in runs.values()]
    except _NoFit:
        return fallback
    return lambda: max(line() for line in lines)


def _restate(name: str, old: int, new: int) -> str:
    return name.replace(f"({old} stored)", f"({new} stored)")
