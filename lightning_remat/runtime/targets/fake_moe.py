"""Mixture-of-Experts layers on fake tensors: grouped matmuls in every dtype, experts in fixed shapes."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.utils.flop_counter import flop_registry, register_flop_formula

aten = torch.ops.aten


def grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``aten._grouped_mm``, which FlopCounterMode has no formula for.

    >>> grouped_mm_flops((10, 8), (4, 8, 16)) == 2 * 10 * 8 * 16   # tokens x experts' weights
    True
    """
    if len(a_shape) == 2 and len(b_shape) == 3:  # tokens (M, K) @ experts (G, K, N) -> (M, N)
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2:  # (M, K) @ (K, N), K split into groups -> (G, M, N): the weights' gradient
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(b_shape) == 2:  # (G, M, K) @ (K, N), N split into groups -> (M, N)
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]  # batched


# Grouped matmuls' FLOPs count in real and fake profiles alike.
if getattr(aten, "_grouped_mm", None) is not None and aten._grouped_mm not in flop_registry:
    register_flop_formula(aten._grouped_mm)(grouped_mm_flops)


def _grouped_mm_any_dtype(mode: Any, func: Any, mat_a: torch.Tensor, mat_b: torch.Tensor, offs: Any = None,
                          bias: Any = None, out_dtype: Any = None) -> Any:
    """Fake-tensor rule for ``aten._grouped_mm`` outside bfloat16: torch's meta code on bfloat16 stand-ins."""
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return NotImplemented  # torch's own meta kernel
    dtype = out_dtype or mat_a.dtype
    with in_kernel_invocation_manager(mode):
        a, b = (torch.empty_strided(t.shape, t.stride(), dtype=torch.bfloat16, device="meta") for t in (mat_a, mat_b))
        o = None if offs is None else torch.empty_strided(offs.shape, offs.stride(), dtype=offs.dtype, device="meta")
        shaped = func(a, b, o, None, None)
        out = torch.empty_strided(shaped.shape, shaped.stride(), dtype=dtype, device="meta")
    return FakeTensor(mode, out, mat_a.device)


@contextlib.contextmanager
def grouped_mm_in_every_dtype() -> Iterator[None]:
    """Within it, ``aten._grouped_mm`` runs on fake tensors in every floating dtype.

    >>> from lightning_remat.runtime.targets.fake import new_fake_mode
    >>> with new_fake_mode(), grouped_mm_in_every_dtype():
    ...     tokens, experts = torch.empty(10, 8), torch.empty(4, 8, 16)
    ...     out = torch.nn.functional.grouped_mm(tokens, experts, offs=torch.tensor([3, 5, 8, 10], dtype=torch.int32))
    >>> out.shape, out.dtype
    (torch.Size([10, 16]), torch.float32)
    """
    entry = (lambda func: func is aten._grouped_mm.default, _grouped_mm_any_dtype)
    fake_impls.op_implementations_checks.insert(0, entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)


@contextlib.contextmanager
def fixed_shape_experts(model: nn.Module, notes: list[str]) -> Iterator[None]:
    """Within it, transformers experts set to ``"eager"`` run with ``"grouped_mm"``; a note goes into ``notes``."""
    get = getattr(model, "get_experts_implementation", None)
    setter = getattr(model, "set_experts_implementation", None)
    previous = get() if callable(get) and callable(setter) else None
    if not previous or not any(v == "eager" for v in previous.values()):
        yield
        return
    try:
        setter({key: "grouped_mm" if value == "eager" else value for key, value in previous.items()})
    except (ValueError, ImportError):  # grouped matmuls not available here: the loop stays
        yield
        return
    notes.append("experts_implementation='eager' picks each expert's tokens by the router's values, which "
                 "fake tensors do not have: the experts were planned with 'grouped_mm' (the same experts on "
                 "the same tokens, transformers' default where grouped matmuls run)")
    try:
        yield
    finally:
        setter(previous)
