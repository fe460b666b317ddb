"""Plan without the hardware: run the profiled step on fake tensors (shapes, dtypes, devices, no storage)."""

from __future__ import annotations

import contextlib
import copy
import sys
import types
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    unset_fake_temporarily,
)

from ...core.errors import FakeProfileError, where_it_failed
from ..installing.records import installed_hooks, without_installation
from ..measuring.optimizers import torch_optimizer
from ..measuring.user_hooks import without_user_hooks


def new_fake_mode() -> FakeTensorMode:
    """A fake mode that accepts real inputs (token ids made by the step) and converts them."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def existing_fake_mode(model: nn.Module) -> FakeTensorMode | None:
    return next((t.fake_mode for t in [*model.parameters(), *model.buffers()] if isinstance(t, FakeTensor)), None)


def fake_model(model: nn.Module, mode: FakeTensorMode, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``model`` with fake CPU parameters and buffers, ties kept (``dtype``: floats cast to it)."""
    model = _shallow_module_copy(model)
    memo: dict[int, torch.Tensor] = {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if isinstance(t, FakeTensor) and t.fake_mode is mode and t.dtype == target and t.device.type == "cpu":
            return t
        return fake_like(mode, t, target)

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                # Where ZeRO-3 partitioned a parameter, a meta tensor of the whole one (twins run whole).
                shape = getattr(p, "ds_shape", None)
                whole = (torch.empty(tuple(shape), dtype=p.dtype, device="meta")
                         if shape is not None and tuple(p.shape) != tuple(shape) else p.detach())
                memo[id(p)] = nn.Parameter(convert(whole), requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]
        for name, b in list(module._buffers.items()):
            if b is None:
                continue
            if id(b) not in memo:
                # Fake tensors hold no values: a real buffer (rotary frequencies) becomes a meta one's metadata.
                memo[id(b)] = convert(b)
            module._buffers[name] = memo[id(b)]
    return model


def fake_like(mode: FakeTensorMode, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fake CPU tensor of ``mode`` with the shape, strides and dtype of ``t`` (real, meta or fake; of a ``DTensor``,
    this rank's shard: what its optimizer allocates state for)."""
    if type(t).__name__ == "DTensor":
        t = t.to_local()
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype, device="cpu")


def _fake_scalar(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    # Optimizers read scalar state (Adam's step) with .item(): made inside the mode from a Python
    # number, a fake scalar keeps its value as a constant.
    try:
        value = t.item()
    except Exception:  # a fake scalar without a constant: any positive step count will do
        value = 1
    with mode:
        return torch.tensor(value, dtype=t.dtype) if t.dim() == 0 else torch.tensor([value], dtype=t.dtype)


def clone_optimizer(optimizer: torch.optim.Optimizer, params: dict[int, torch.Tensor], mode: FakeTensorMode,
                    state: bool = True) -> torch.optim.Optimizer:
    """An optimizer of the same class and settings over fake parameters (``params``: id -> fake), with fake state
    (none without ``state``)."""
    optimizer = torch_optimizer(optimizer)
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in params]
        if missing:
            raise ValueError(f"the optimizer holds {len(missing)} parameter(s) that are not the model's")
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [params[id(p)] for p in group["params"]]})
    clone = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k not in groups[0]})
    for group in optimizer.param_groups if state else ():
        for p in group["params"]:
            if p in optimizer.state:
                clone.state[params[id(p)]] = {
                    k: (_fake_scalar(mode, v) if v.numel() == 1 else fake_like(mode, v)) if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state[p].items()}
    return clone


def _shallow_module_copy(model: nn.Module) -> nn.Module:
    """Copy the module tree but not what modules refer to; the copy carries no plan of ours."""
    copies: dict[int, nn.Module] = {}
    ours = installed_hooks(model)

    def copy_module(module: nn.Module) -> nn.Module:
        if id(module) not in copies:
            twin = copy.copy(module)
            # copy.copy may drop a LightningModule's trainer (__getstate__): the twin refers to all its
            # module does, except the installation, which a twin sharing it would uninstall.
            cls, state = without_installation(module, ours)
            for key in [k for k in module.__dict__ if k not in state]:
                twin.__dict__.pop(key, None)
            twin.__dict__.update(state)
            if type(twin) is not cls:
                object.__setattr__(twin, "__class__", cls)
            without_user_hooks(twin)  # the user's hooks do not see fake passes, DeepSpeed's are not run (user_hooks.py)
            # A method bound to the module in its own __dict__ (TRL's fused LM head and Accelerate's
            # mixed precision replace ``model.forward`` so) would run the real module: bound to the twin,
            # with the module's methods its closure keeps (the forward it wraps) bound to the twin too.
            for key, value in list(twin.__dict__.items()):
                if isinstance(value, types.MethodType) and value.__self__ is module:
                    twin.__dict__[key] = types.MethodType(rebound_closure(value.__func__, module, twin), twin)
            copies[id(module)] = twin
            # A plain dict: DeepSpeed ZeRO-3's ZeROOrderedDict neither copies (it takes its module) nor should run
            # on a twin (reading a parameter in a forward gathers it).
            object.__setattr__(twin, "_parameters", dict(dict.items(module._parameters)))
            object.__setattr__(twin, "_buffers", module._buffers.copy())
            object.__setattr__(twin, "_modules", module._modules.copy())
            for name, child in module._modules.items():
                if child is not None:
                    twin._modules[name] = copy_module(child)
        return copies[id(module)]

    return copy_module(model)


@contextlib.contextmanager
def real_code_paths() -> Iterator[None]:
    """Let transformers take the attention path of real tensors (it reads a fake tensor as tracing and would
    materialise the causal mask); sequences are assumed unpacked."""
    masking = sys.modules.get("transformers.masking_utils")
    decide = getattr(masking, "_ignore_causal_mask_sdpa", None)
    original_is_tracing = getattr(masking, "is_tracing", None)
    if decide is None or original_is_tracing is None:
        yield
        return

    def lenient_is_tracing(tensor=None) -> bool:
        return original_is_tracing(None) or (
            tensor is not None and not isinstance(tensor, FakeTensor) and original_is_tracing(tensor))

    def decide_as_on_real_tensors(padding_mask=None, *args, **kwargs):
        if padding_mask is not None and unpadded.get(id(padding_mask), lambda: None)() is padding_mask:
            padding_mask = None  # made from a real mask of ones: no padding, as the real step finds
        masking.is_tracing = lenient_is_tracing
        try:
            return decide(padding_mask, *args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            masking.is_tracing = original_is_tracing
            return decide(padding_mask, *args, **kwargs)
        finally:
            masking.is_tracing = original_is_tracing

    # A padding mask made inside the step is fake, its values unknown: planned as padded (the n x n mask built).
    # One the step holds as a real tensor is read here, so a batch without padding gets is_causal as on the GPU.
    unpadded: dict[int, weakref.ref] = {}  # by id: a tensor's == compares values
    preprocess = getattr(masking, "_preprocess_mask_arguments", None)

    def preprocess_reading_real_masks(config, inputs_embeds, attention_mask, *args, **kwargs):
        result = preprocess(config, inputs_embeds, attention_mask, *args, **kwargs)
        if isinstance(attention_mask, torch.Tensor) and not isinstance(attention_mask, FakeTensor) \
                and attention_mask.dim() == 2 and isinstance(result[1], torch.Tensor):
            with unset_fake_temporarily():
                if bool(attention_mask.all()):
                    unpadded[id(result[1])] = weakref.ref(result[1])
        return result

    find_packed = getattr(masking, "find_packed_sequence_indices", None)

    def no_packing_on_fake(position_ids, *args, **kwargs):
        # Packed sequences are told apart by the position ids' values, which fake tensors lack.
        if isinstance(position_ids, FakeTensor):
            return None
        return find_packed(position_ids, *args, **kwargs)

    with contextlib.ExitStack() as put_back:
        for name, replacement in (("_ignore_causal_mask_sdpa", decide_as_on_real_tensors),
                                  ("find_packed_sequence_indices", no_packing_on_fake),
                                  ("_preprocess_mask_arguments", preprocess_reading_real_masks)):
            if getattr(masking, name, None) is not None:
                put_back.callback(setattr, masking, name, getattr(masking, name))
                setattr(masking, name, replacement)
        yield


@contextlib.contextmanager
def explain_fake_failures() -> Iterator[None]:
    """Turn fake-tensor failures into a FakeProfileError that names the op."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as err:
        raise FakeProfileError(str(getattr(err, "func", err)), where=where_it_failed(err)) from err
    except UnsupportedFakeTensorException as err:
        raise FakeProfileError("an operation fake tensors do not support", f"({err}) ", where=where_it_failed(err)) from err


def rebound_closure(function: Any, module: Any, twin: Any) -> Any:
    """``function``, or a copy whose closure has ``module``'s bound methods bound to ``twin`` (TRL's fused LM head
    keeps the model's bound ``forward`` in its closure, which a twin would run on the real module).

    >>> class M:
    ...     def f(self): return self
    >>> real, twin = M(), M()
    >>> def wrap(original):
    ...     def wrapper(self): return original()
    ...     return wrapper
    >>> wrapper = wrap(real.f)
    >>> rebound_closure(wrapper, real, twin)(twin) is twin, wrapper(real) is real
    (True, True)
    """
    def contents(cell: Any) -> Any:
        try:
            return cell.cell_contents
        except ValueError:  # an empty cell
            return cell

    cells = function.__closure__ or ()
    bound = [isinstance(v, types.MethodType) and v.__self__ is module for v in map(contents, cells)]
    if not any(bound):
        return function
    closure = tuple(types.CellType(types.MethodType(contents(c).__func__, twin)) if b else c
                    for c, b in zip(cells, bound))
    copy_ = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                               closure)
    copy_.__kwdefaults__, copy_.__dict__ = function.__kwdefaults__, dict(function.__dict__)
    return copy_
