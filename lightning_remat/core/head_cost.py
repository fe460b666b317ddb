"""What computing a causal LM's head and loss over sequence chunks costs beyond computing them whole.

Two ways (``chunk_loss``): each chunk recomputed in backward (``"chunks:k"``), or fused, each chunk's gradients
computed in forward (``"fused:k"``). Priced per op on a roofline, max(FLOPs / peak FLOP/s, bytes / bandwidth):
the recomputed projection, the recomputed loss's logits-sized elementwise work, the head's weight read again per
chunk, the weight's gradient summed per chunk. No torch here: shapes and element sizes in, seconds and FLOPs out.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOAT_BYTES = 4  # the loss upcasts the logits to float before its cross-entropy (Hugging Face's ForCausalLMLoss)


@dataclass(frozen=True)
class HeadShape:
    """A head's projection as one step runs it: ``tokens`` x ``hidden`` -> ``vocab``, computed in ``compute_bytes``
    per element (autocast's dtype, else the weight's), the weight kept in ``param_bytes``; ``trains``: its weight
    gets a gradient.

    Example:
        >>> HeadShape(tokens=4096, hidden=4096, vocab=128256, compute_bytes=2, param_bytes=2).flops
        4303557230592
    """

    tokens: int
    hidden: int
    vocab: int
    compute_bytes: int = 4
    param_bytes: int = 4
    trains: bool = True

    @property
    def flops(self) -> int:
        """The projection's forward FLOPs: what a recomputed chunked loss computes again."""
        return 2 * self.tokens * self.hidden * self.vocab

    def _weight_traffic(self, chunks: int) -> int:
        """Bytes a chunked head moves per step beyond a whole one, recompute aside: per chunk after the first the
        weight read by the hidden's gradient matmul (and cast again where autocast does not cache a frozen weight),
        and where the weight trains, its chunk gradient written, cast and summed into the total."""
        weight, grad = self.hidden * self.vocab * self.compute_bytes, self.hidden * self.vocab * self.param_bytes
        cast = weight + grad if self.compute_bytes != self.param_bytes else 0
        per_chunk = weight + (weight + cast + 3 * grad if self.trains else cast)
        return (chunks - 1) * per_chunk


def fused_cost(shape: HeadShape, chunks: int, flops_per_second: float, bytes_per_second: float) -> float:
    """Roofline seconds a fused head and loss (``"fused:k"``) costs beyond the whole head: no FLOPs (the backward's
    matmuls run in forward instead), the weight read per chunk by both matmuls, the weight's gradient summed per
    chunk, and the kept gradients scaled by the upstream gradient in backward.

    Example:
        >>> llama = HeadShape(tokens=4096, hidden=4096, vocab=128256, compute_bytes=2, param_bytes=2, trains=False)
        >>> round(fused_cost(llama, 8, 989e12, 3.35e12) * 1e3, 2)  # ms: 14 more reads of a 1 GB weight
        4.43
    """
    if not bytes_per_second:
        return 0.0
    weight = shape.hidden * shape.vocab * shape.compute_bytes
    hidden_grad = shape.tokens * shape.hidden * shape.compute_bytes
    scaled = 2 * hidden_grad + (2 * shape.hidden * shape.vocab * shape.param_bytes if shape.trains else 0)
    # The forward's matmul reads the weight per chunk too; the hidden's gradient is copied into one tensor.
    moved = shape._weight_traffic(chunks) + (chunks - 1) * weight + 2 * hidden_grad + scaled
    return moved / bytes_per_second


def recompute_cost(shape: HeadShape, chunks: int, flops_per_second: float, bytes_per_second: float) -> float:
    """Roofline seconds a chunked head and loss recomputed in backward (``"chunks:k"``) costs beyond the whole head:
    the projection again (its FLOPs, the weight read per chunk), the loss's logits-sized elementwise work again
    (the logits written, upcast to float, log-softmax), the weight read per chunk by the hidden's gradient and the
    weight's gradient summed per chunk.

    Example:
        >>> llama = HeadShape(tokens=4096, hidden=4096, vocab=128256, compute_bytes=2, param_bytes=2, trains=False)
        >>> round(recompute_cost(llama, 8, 989e12, 3.35e12) * 1e3, 2)  # ms: 4.35 of them the projection's FLOPs
        8.74
    """
    logits = shape.tokens * shape.vocab
    weight = shape.hidden * shape.vocab * shape.compute_bytes
    projection_bytes = chunks * weight + (shape.tokens * shape.hidden + logits) * shape.compute_bytes
    projection = max(shape.flops / flops_per_second if flops_per_second else 0.0,
                     projection_bytes / bytes_per_second if bytes_per_second else 0.0)
    upcast = logits * (shape.compute_bytes + FLOAT_BYTES) if shape.compute_bytes != FLOAT_BYTES else 0
    elementwise = upcast + 2 * logits * FLOAT_BYTES  # log-softmax reads and writes float logits
    moved = elementwise + shape._weight_traffic(chunks)
    return projection + (moved / bytes_per_second if bytes_per_second else 0.0)
