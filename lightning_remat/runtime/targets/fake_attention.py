"""Attention as a CUDA GPU runs it, on the fake CPU tensors of a profile planned for one.

With dropout the CPU saves SDPA's quadratic matrices, a GPU's fused kernel only output, log-sum-exp and
seed: ``cuda_attention()`` routes such calls to the kernel CUDA would pick."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.nn import functional as F

aten = torch.ops.aten
# Flash attention's limits on the GPU: half precision and a head size it has kernels for.
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD = 256


def _cuda_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> torch.Tensor | None:
    """The fused kernel's output for a call CUDA fuses and the CPU does not; None otherwise."""
    if dropout_p == 0.0 or query.dim() != 4 or key.shape[-3] != query.shape[-3]:
        return None  # no dropout: the CPU's fused kernel saves what CUDA's does
    head = query.shape[-1]
    if (attn_mask is None and query.dtype in _FLASH_DTYPES and head <= _FLASH_MAX_HEAD and head % 8 == 0
            and value.shape[-1] == head):
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    bias = attn_mask
    if bias is not None:
        if bias.dtype == torch.bool:  # SDPA's own conversion: False masks the position out
            bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill(bias.logical_not(), float("-inf"))
        bias = bias.to(query.dtype).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout_p, is_causal,
                                                        scale=scale)[0]


@contextlib.contextmanager
def cuda_attention(enabled: bool = True) -> Iterator[None]:
    """Within it, SDPA calls with dropout run CUDA's fused kernel (the function is replaced, for recomputes too)."""
    if not enabled:
        yield
        return
    original = F.scaled_dot_product_attention

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = _cuda_kernel(*args, **kwargs)
        return original(*args, **kwargs) if out is None else out

    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
