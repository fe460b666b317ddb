"""A causal LM's head and loss fused over sequence chunks (Liger-Kernel's fused linear cross-entropy, in
autograd): each chunk's gradients are computed in forward and its logits freed; backward only scales them by
the upstream gradient, so accumulation and loss scaling act as on the model's own loss (docs/long_context.md)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from ...core.vocabulary import Action
from .chunked_loss import IGNORE_INDEX, ChunkedLoss, _chunk_loss, _divided, chunked_cross_entropy

Project = Callable[[torch.Tensor], torch.Tensor]


class _FusedHeadLoss(torch.autograd.Function):
    """The summed loss of the chunks; its gradients were computed in forward and are only scaled in backward."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], hidden: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        total, grads = run()
        # Saved (not attributes of ctx): backward without retain_graph frees them, however long the loss lives.
        ctx.save_for_backward(*grads)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        # Out of place: a second backward (retain_graph=True) finds the gradients as they were.
        return (None, *(None if g is None else g * grad_output.to(g.dtype) for g in ctx.saved_tensors))


def _chunk_grads(project: Project, hidden: torch.Tensor, params: Sequence[torch.Tensor], labels: torch.Tensor,
                 chunks: int, ignore_index: int, smoothing: float) -> tuple[torch.Tensor, list[Any]]:
    """The summed loss of ``chunks`` chunks and its gradients w.r.t. ``hidden`` and ``params`` (None: no grad)."""
    size = -(-hidden.shape[-2] // chunks)
    trained = [p.requires_grad for p in params]
    grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
    sums: list[Any] = [None] * len(params)
    total = None
    start = 0
    for h, y in zip(hidden.split(size, dim=-2), labels.split(size, dim=-1)):
        with torch.enable_grad():
            h = h.detach().requires_grad_(hidden.requires_grad)
            loss = _chunk_loss(project, h, y, ignore_index, smoothing)
            wanted = [t for t, w in zip((h, *params), (h.requires_grad, *trained)) if w]
            grads = list(torch.autograd.grad(loss, wanted, allow_unused=True))
        total = loss.detach() if total is None else total + loss.detach()
        if grad_hidden is not None:
            got = grads.pop(0)
            part = grad_hidden.narrow(-2, start, h.shape[-2])
            if got is None:
                part.zero_()
            else:
                part.copy_(got)
        for i in (i for i, w in enumerate(trained) if w):
            got = grads.pop(0)
            if got is not None:  # summed in the parameter's dtype, as autograd sums a gradient over several uses
                sums[i] = got if sums[i] is None else sums[i].add_(got)
        start += h.shape[-2]
    return total, [grad_hidden, *sums]


def fused_cross_entropy(project: Project, hidden: torch.Tensor, shift_labels: torch.Tensor, chunks: int,
                        params: Sequence[torch.Tensor], ignore_index: int = IGNORE_INDEX,
                        num_items_in_batch: Any = None, smoothing: float = 0.0) -> torch.Tensor:
    """``ForCausalLMLoss(project(hidden), ...)`` over ``chunks`` chunks, its gradients computed in the forward
    (``params``: the head's weight and bias; those that require grad get theirs).

    >>> head, hidden = nn.Linear(8, 32), torch.randn(2, 6, 8, requires_grad=True)
    >>> labels = torch.randint(0, 32, (2, 6))
    >>> loss = fused_cross_entropy(head, hidden, labels, 3, list(head.parameters()))
    >>> plain = torch.nn.functional.cross_entropy(head(hidden).reshape(-1, 32), labels.reshape(-1))
    >>> loss.backward(); torch.allclose(loss, plain)
    True
    >>> torch.allclose(hidden.grad, torch.autograd.grad(plain, hidden)[0])
    True
    """
    params = list(params)
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (hidden, *params)):
        with torch.no_grad():  # nothing to differentiate: the chunks' losses alone
            return chunked_cross_entropy(project, hidden, shift_labels, chunks, ignore_index, num_items_in_batch,
                                         smoothing)
    total = _FusedHeadLoss.apply(
        lambda: _chunk_grads(project, hidden, params, shift_labels, chunks, ignore_index, smoothing), hidden, *params)
    return _divided(total, shift_labels, ignore_index, num_items_in_batch)


class FusedLoss(ChunkedLoss):
    """A ``FUSE`` action: the head returns its loss fused over sequence chunks; its causal LM hands it the labels.

    >>> from lightning_remat.core.actions import StageAction
    >>> FusedLoss().settings(StageAction.fuse("lm_head", 8)), FusedLoss().settings(StageAction.chunk("lm_head", 8))
    ({'lm_head': 8}, {})
    """

    name = "fused_loss"
    action = Action.FUSE

    def loss(self, head: nn.Module, project: Project, hidden: torch.Tensor, labels: torch.Tensor, chunks: int,
             p: Any) -> torch.Tensor:
        return fused_cross_entropy(project, hidden, labels, chunks, list(head.parameters()), p.ignore_index,
                                   p.num_items_in_batch, p.smoothing)
