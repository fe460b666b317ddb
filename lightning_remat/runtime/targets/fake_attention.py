"""Attention as a CUDA GPU runs it, on the fake CPU tensors of a profile planned for one: the CPU's SDPA picks
other kernels (the math path with dropout, flash for shapes CUDA's fused kernels lack), so within
``cuda_attention()`` every SDPA call runs the kernel CUDA (sm80+) would pick, with what it saves and holds
(the table in docs/without_hardware.md; cuDNN attention is priced as flash). A call that computes a quadratic
matrix is recorded in ``AttentionNotes`` under the attention module's class, so the plan says so."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ...core.budget import format_bytes

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD = 256
_SOFTMAX = {aten._softmax.default, aten._safe_softmax.default}


def cuda_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                is_causal: bool = False) -> str:
    """The SDPA kernel a CUDA GPU (sm80+) runs for these inputs, as torch's ``select_sdp_backend``.

    >>> q = torch.empty(1, 8, 128, 64, dtype=torch.bfloat16)
    >>> cuda_kernel(q, q, q, is_causal=True)
    'flash'
    >>> cuda_kernel(q, q, q, attn_mask=torch.ones(128, 128, dtype=torch.bool))
    'efficient'
    >>> odd = torch.empty(1, 8, 128, 60, dtype=torch.bfloat16)
    >>> cuda_kernel(odd, odd, odd, attn_mask=torch.ones(128, 128, dtype=torch.bool))
    'math'
    """
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or not query.shape[-2] or not key.shape[-2]:
        return "math"
    head_q, head_k, head_v = query.shape[-1], key.shape[-1], value.shape[-1]
    square = not is_causal or query.shape[-2] == key.shape[-2]
    if (attn_mask is None and query.dtype in _HALF and head_q == head_k == head_v <= _FLASH_MAX_HEAD and square):
        return "flash"
    alignment = 8 if query.dtype in _HALF else 4
    if (query.dtype in (*_HALF, torch.float32) and head_q == head_k and head_q % alignment == 0
            and head_v % alignment == 0):
        return "efficient"
    return "math"


def _round(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _backward_workspace(kernel: str, query: torch.Tensor, key: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What the kernel's backward allocates beside dq, dk, dv (module docstring): (shape, dtype) each."""
    batch, heads, n_q, head = query.shape
    f32 = torch.float32
    if kernel == "flash":
        n_q_rounded, head_rounded = _round(n_q, 128), (_round(head, 32) if head <= 192 else 256)
        shapes = [((batch, heads, n_q_rounded), f32), ((batch, n_q_rounded, heads, head_rounded), f32)]
        if key.shape[1] != heads:  # grouped-query: dk and dv at every query head, then summed per group
            shapes += [((batch, key.shape[2], heads, head), query.dtype)] * 2
        return shapes
    if kernel == "efficient":
        return [((batch, heads, n_q), f32), ((batch, n_q, heads, _round(head, 8)), f32)]
    return []


def _hold_in_backward(out: torch.Tensor, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Allocate ``shapes`` while the backward of ``out``'s node runs (a kernel's workspace), then free them."""
    node = out.grad_fn
    if node is None or not shapes:
        return
    # The hooks live as long as the graph: they must not hold ``out`` (a checkpointed layer would keep it).
    mode, device = getattr(out, "fake_mode", None) or contextlib.nullcontext(), out.device
    held: list[torch.Tensor] = []

    def allocate(grad_outputs: Any) -> None:
        with mode:
            held.extend(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes)

    node.register_prehook(allocate)
    node.register_hook(lambda grad_inputs, grad_outputs: held.clear())


def _as_bias(attn_mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The mask as the efficient kernel takes it: SDPA's own conversion (False masks the position out)."""
    bias = attn_mask
    if bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill(bias.logical_not(), float("-inf"))
    return bias.to(query.dtype).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _run_as_cuda(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any,
                 dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    if kernel == "flash":
        out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    elif kernel == "efficient":
        bias = None if attn_mask is None else _as_bias(attn_mask, query, key)
        key, value = _repeat_heads(key, query.shape[1]), _repeat_heads(value, query.shape[1])
        out = aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout_p, is_causal,
                                                           scale=scale)[0]
    else:
        return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                       scale=scale, enable_gqa=enable_gqa)[0]
    _hold_in_backward(out, _backward_workspace(kernel, query, key))
    return out


def _attention_module() -> str:
    """The class of the innermost module whose ``forward`` is on the stack (the layer calling attention)."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and isinstance(owner, nn.Module):
            return type(owner).__name__
        frame = frame.f_back
    return "a module"


class AttentionNotes:
    """Attention that computes a quadratic matrix on the GPU, per layer class, told in the plan's notes.

    >>> notes = AttentionNotes()
    >>> notes.record("LlamaAttention", "an eager softmax", 4096, 2 * 2**20)
    >>> print(notes.lines()[0][:60])
    LlamaAttention computes attention as a 4096 x 4096 matrix (a
    """

    def __init__(self) -> None:
        self.found: dict[str, tuple[str, int, int]] = {}

    def record(self, layer: str, how: str, tokens: int, nbytes: int) -> None:
        self.found.setdefault(layer, (how, tokens, nbytes))

    def watched(self, step: Callable[[nn.Module], Any]) -> Callable[[nn.Module], Any]:
        """``step`` that also records an explicit quadratic softmax (eager attention) until a call of it returns: one
        step runs every layer later ones do, and the dispatch mode is left off every later op.

        >>> notes = AttentionNotes()
        >>> step = notes.watched(lambda model: torch.zeros(1, 2, 8, 8).softmax(-1))
        >>> _ = step(None)
        >>> list(notes.found.values())
        [('an explicit softmax: eager attention', 8, 512)]
        >>> notes.found.clear()
        >>> _ = step(None)  # its later calls run without the watch
        >>> notes.found
        {}
        """
        done: list[bool] = []

        def watched_step(model: nn.Module) -> Any:
            if done:
                return step(model)
            with _QuadraticSoftmax(self):
                result = step(model)
            done.append(True)
            return result
        return watched_step

    def lines(self) -> list[str]:
        return [f"{layer} computes attention as a {tokens} x {tokens} matrix ({how}): {format_bytes(nbytes)} per "
                f"call, quadratic in the sequence (4x at twice the length); SDPA without a mask runs flash attention "
                f"on the GPU, linear in the sequence (a batch without padding: pass no attention_mask)"
                for layer, (how, tokens, nbytes) in self.found.items()]


class _QuadraticSoftmax(TorchDispatchMode):
    """Records a 4-D softmax over a square last pair of dims (an "eager" attention's probabilities)."""

    def __init__(self, notes: AttentionNotes):
        super().__init__()
        self.notes = notes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SOFTMAX:
            x = args[0]
            if x.dim() == 4 and x.shape[-1] == x.shape[-2] > 1 and args[1] in (-1, 3):
                self.notes.record(_attention_module(), "an explicit softmax: eager attention", x.shape[-1],
                                  x.numel() * x.element_size())
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def cuda_attention(enabled: bool = True, notes: AttentionNotes | None = None) -> Iterator[None]:
    """Within it, SDPA runs the kernel CUDA would pick (recomputes too); quadratic SDPA goes in ``notes``
    (an explicit softmax: ``AttentionNotes.watched``)."""
    if not enabled:
        yield
        return
    original, notes = F.scaled_dot_product_attention, notes if notes is not None else AttentionNotes()

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False) -> torch.Tensor:
        if attn_mask is not None and is_causal or not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        kernel = cuda_kernel(query, key, value, attn_mask, is_causal)
        n_q, n_k = query.shape[-2], key.shape[-2]
        if kernel == "math":
            notes.record(_attention_module(), "SDPA's math kernel on the GPU", n_k,
                         query[..., :1].numel() * n_k * query.element_size())
        elif attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2:] == (n_q, n_k) and n_q > 1:
            notes.record(_attention_module(), "an explicit mask: the memory-efficient kernel keeps it as a bias",
                         n_k, attn_mask.numel() * query.element_size())
        return _run_as_cuda(kernel, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
