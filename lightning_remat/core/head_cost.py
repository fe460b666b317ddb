"""What a causal LM's head and loss over sequence chunks, recomputed (``"chunks:k"``) or fused (``"fused:k"``),
costs beyond computing them whole, priced per op on a roofline: max(FLOPs / peak FLOP/s, bytes / bandwidth)."""

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

    def _accumulation(self, chunks: int) -> int:
        """Bytes a chunked head moves per step beyond a whole one in elementwise work: per chunk after the first the
        weight cast again (where autocast does not cache a frozen weight), and where the weight trains, its chunk
        gradient cast and summed into the total."""
        weight, grad = self.hidden * self.vocab * self.compute_bytes, self.hidden * self.vocab * self.param_bytes
        cast = weight + grad if self.compute_bytes != self.param_bytes else 0
        return (chunks - 1) * (cast + 3 * grad if self.trains else cast)


def _matmuls(shape: HeadShape, tokens: int, flops_per_second: float, bytes_per_second: float) -> float:
    """Roofline seconds of the head's matmuls over ``tokens`` tokens, each op priced alone: the logits, the hidden's
    gradient and, where the weight trains, the weight's. A chunk's matmul reads the whole weight again, which
    costs time only where the chunk is too short to be compute-bound."""
    h, v, size = shape.hidden, shape.vocab, shape.compute_bytes
    flops = 2 * tokens * h * v
    moved = (tokens * h + h * v + tokens * v) * size
    ops = [moved, moved] + ([moved - h * v * size + h * v * shape.param_bytes] if shape.trains else [])
    return sum(max(flops / flops_per_second if flops_per_second else 0.0,
                   nbytes / bytes_per_second if bytes_per_second else 0.0) for nbytes in ops)


def _chunking(shape: HeadShape, chunks: int, flops_per_second: float, bytes_per_second: float) -> float:
    """Roofline seconds the matmuls per chunk and the gradient accumulation cost beyond the whole head."""
    per_chunk = -(-shape.tokens // chunks)
    extra = (chunks * _matmuls(shape, per_chunk, flops_per_second, bytes_per_second)
             - _matmuls(shape, shape.tokens, flops_per_second, bytes_per_second))
    return max(extra, 0.0) + (shape._accumulation(chunks) / bytes_per_second if bytes_per_second else 0.0)


def fused_cost(shape: HeadShape, chunks: int, flops_per_second: float, bytes_per_second: float) -> float:
    """Roofline seconds a fused head and loss (``"fused:k"``) costs beyond the whole head: no FLOPs (the backward's
    matmuls run in forward instead), the matmuls per chunk, the weight's gradient summed per chunk, and the kept
    gradients copied into one tensor and scaled by the upstream gradient in backward.

    Example:
        >>> llama = HeadShape(tokens=4096, hidden=4096, vocab=128256, compute_bytes=2, param_bytes=2, trains=False)
        >>> round(fused_cost(llama, 8, 989e12, 3.35e12) * 1e3, 3)  # ms: 512-token chunks are compute-bound
        0.04
    """
    if not bytes_per_second:
        return 0.0
    hidden_grad = shape.tokens * shape.hidden * shape.compute_bytes
    scaled = 2 * hidden_grad + (2 * shape.hidden * shape.vocab * shape.param_bytes if shape.trains else 0)
    return (_chunking(shape, chunks, flops_per_second, bytes_per_second)
            + (2 * hidden_grad + scaled) / bytes_per_second)


def recompute_cost(shape: HeadShape, chunks: int, flops_per_second: float, bytes_per_second: float) -> float:
    """Roofline seconds a chunked head and loss recomputed in backward (``"chunks:k"``) costs beyond the whole head:
    the projection again per chunk, the loss's logits-sized elementwise work again (the logits upcast to float,
    log-softmax), the matmuls per chunk and the weight's gradient summed per chunk.

    Example:
        >>> llama = HeadShape(tokens=4096, hidden=4096, vocab=128256, compute_bytes=2, param_bytes=2, trains=False)
        >>> round(recompute_cost(llama, 8, 989e12, 3.35e12) * 1e3, 2)  # ms: 4.35 of them the projection's FLOPs
        6.55
    """
    logits = shape.tokens * shape.vocab
    per_chunk = -(-shape.tokens // chunks)
    h, v, size = shape.hidden, shape.vocab, shape.compute_bytes
    projection = chunks * max(2 * per_chunk * h * v / flops_per_second if flops_per_second else 0.0,
                              (per_chunk * h + h * v + per_chunk * v) * size / bytes_per_second
                              if bytes_per_second else 0.0)
    upcast = logits * (size + FLOAT_BYTES) if size != FLOAT_BYTES else 0
    elementwise = upcast + 2 * logits * FLOAT_BYTES  # log-softmax reads and writes float logits
    return (projection + _chunking(shape, chunks, flops_per_second, bytes_per_second)
            + (elementwise / bytes_per_second if bytes_per_second else 0.0))
