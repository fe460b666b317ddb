"""Attention as a CUDA GPU runs it, on the fake CPU tensors of a profile planned for one.

A fake profile runs the step on fake *CPU* tensors, so ``scaled_dot_product_attention`` picks the
CPU's kernel. That saves for backward what a GPU's kernel saves (the output and its log-sum-exp)
except with attention dropout: the CPU's fused kernel has none, so SDPA falls back to its math
path and saves the score and probability matrices, quadratic in the sequence. A GPU runs dropout
inside its fused kernels (flash attention for half precision without a mask, memory-efficient
attention otherwise) and saves the output, the log-sum-exp and the dropout's random seed. Planned
on the CPU path, a model with attention dropout is predicted to hold far more activations than a
GPU holds, and plans recompute far more than needed.

``cuda_attention()`` routes SDPA calls with dropout to the fused kernel CUDA would choose, as
torch's own dispatch does (flash first, then memory-efficient). Those ops have meta kernels and
autograd formulas, so they run on fake tensors, save what they save on a GPU, and count their
FLOPs. Calls without dropout keep the CPU's fused kernel, which saves the same tensors.

Example:
    >>> import torch
    >>> from lightning_remat.runtime.targets.fake import new_fake_mode
    >>> with new_fake_mode(), cuda_attention():
    ...     q = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    ...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
    >>> out.shape
    torch.Size([1, 2, 16, 8])
"""

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
    """Within it, SDPA calls with dropout run CUDA's fused kernel (on fake tensors); a no-op when
    not ``enabled``.

    ``torch.nn.functional.scaled_dot_product_attention`` itself is replaced for the duration: a
    checkpoint's recompute runs inside the autograd engine, where a ``TorchFunctionMode`` entered
    around the step no longer applies, and the recompute must take the forward's kernel.
    """
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
