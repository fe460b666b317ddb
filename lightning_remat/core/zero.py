"""What one rank of DeepSpeed ZeRO-2 (``Zero2Facts``) or ZeRO-3 (``Zero3Facts``) holds beside a whole-model step,
from its configuration and the parameter count (``integrations.accelerate.deepspeed`` reads them from the engine).

Each term is counted in every term of the step (a bound, not a timeline). ZeRO-2 pitfalls: the gradient partition
is allocated at the first gradient of the rank's partition, which may come early in backward, at the activations'
largest; a parameter larger than the reduce bucket is reduced on its own. The whole gradients the profile counts
bound the rank's unreduced gradients and, in the optimizer step, its partition and flattened copy (2/N <= 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from .budget import format_bytes


class _RankTerms:
    stage = 0  # the ZeRO stage, set by each subclass

    def extra_bytes(self, optimizer_state_bytes: int) -> int:
        """What a rank holds beyond the whole-model step: the sum of ``terms``."""
        return sum(nbytes for _, nbytes in self.terms(optimizer_state_bytes))

    def note(self, optimizer_state_bytes: int) -> str:
        """The profile's note: the terms, in words."""
        said = "; ".join(f"{label} {'-' if n < 0 else '+'}{format_bytes(abs(n))}"
                         for label, n in self.terms(optimizer_state_bytes))
        return (f"DeepSpeed ZeRO-{self.stage} over {self.world} ranks: per rank, the whole-model step with {said}; "
                "counted in every term")


@dataclass(frozen=True)
class Zero2Facts(_RankTerms):
    """One rank's ZeRO-2 figures: ``world`` ranks, ``partition`` elements per rank (DeepSpeed pads the flat
    parameters so every rank's is equal), element bytes of the gradients (``gradient_bytes``) and of the
    reduction (``reduce_bytes``), ``bucket`` elements (``reduce_bucket_size``), ``overlap`` (``overlap_comm``:
    two buckets), ``contiguous`` (``contiguous_gradients``: the partition's gradient buffer), ``largest``
    parameter's elements.

    Example:
        >>> facts = Zero2Facts(world=2, partition=80160, gradient_bytes=4, reduce_bytes=4, bucket=4096,
        ...                    overlap=False, contiguous=True, largest=16384)
        >>> [nbytes for _, nbytes in facts.terms(1282720)]  # state kept 1/2, master, gradients, bucket, reduction
        [-641360, 320640, 320640, 16384, 65536]
        >>> facts.extra_bytes(1282720)
        81840
    """

    stage = 2  # not a field
    world: int
    partition: int
    gradient_bytes: int = 4
    reduce_bytes: int = 4
    bucket: int = 0
    overlap: bool = False
    contiguous: bool = True
    largest: int = 0

    def terms(self, optimizer_state_bytes: int) -> list[tuple[str, int]]:
        """(label, bytes) of what a rank holds beside a whole-model step; negative where it holds less."""
        kept = -(-optimizer_state_bytes // self.world)
        terms = [(f"optimizer state beyond the rank's partition (1/{self.world} kept)", kept - optimizer_state_bytes),
                 (f"DeepSpeed's float32 master partition ({self.partition} elements)", 4 * self.partition)]
        if self.contiguous:
            terms.append((f"the rank's gradient partition ({self.partition} elements)",
                          self.gradient_bytes * self.partition))
        buckets = 2 if self.overlap else 1
        terms.append((f"reduce bucket{'s' if buckets > 1 else ''} ({buckets} x {self.bucket} elements)",
                      buckets * self.bucket * self.reduce_bytes))
        terms.append((f"a reduction's temporary ({max(self.bucket, self.largest)} elements: the bucket or the "
                      "largest parameter)", max(self.bucket, self.largest) * self.reduce_bytes))
        return terms

    def kept(self, optimizer_state_bytes: int) -> int:
        """The optimizer state the rank keeps (its partition's) and DeepSpeed's float32 master partition."""
        return -(-optimizer_state_bytes // self.world) + 4 * self.partition


@dataclass(frozen=True)
class Zero3Facts(_RankTerms):
    """One rank's ZeRO-3 figures, read from the live engine: ``held`` bytes DeepSpeed's optimizer holds from
    ``deepspeed.initialize`` on (parameter, float32 master and gradient partitions, reduce buckets); ``numel``
    elements of the whole model, ``partition`` of the rank's (padded); ``padding`` bytes a gather adds (each
    parameter is gathered as ``world`` equal partitions); the rest as in ``Zero2Facts``.

    The bound is every parameter gathered at once: ``stage3_max_live_parameters`` limits only prefetching (a
    module's own fetch is never refused) and ``stage3_max_reuse_distance`` can keep every parameter of a small
    model gathered from forward to backward.

    Example:
        >>> facts = Zero3Facts(world=2, held=1_305_344, numel=160320, partition=80160, padding=0, bucket=4096,
        ...                    reduce_bytes=4, largest=16384)
        >>> [nbytes for _, nbytes in facts.terms(1282720)]  # state kept 1/2, partitions and buffers, gather, reduction
        [-641360, 1305344, 0, 65536]
        >>> facts.kept(1282720)
        641360
    """

    stage = 3  # not a field
    world: int
    held: int
    numel: int
    partition: int
    padding: int = 0
    bucket: int = 0
    reduce_bytes: int = 4
    largest: int = 0

    def kept(self, optimizer_state_bytes: int) -> int:
        """The optimizer state of the rank's partition (the whole model's scaled to it, padding included)."""
        return -(-optimizer_state_bytes * self.partition // max(1, self.numel))

    def terms(self, optimizer_state_bytes: int) -> list[tuple[str, int]]:
        """(label, bytes) of what a rank holds beside a whole-model step; negative where it holds less."""
        temporary = max(self.bucket, self.largest)
        return [(f"optimizer state beyond the rank's partition ({self.partition} of {self.numel} elements kept)",
                 self.kept(optimizer_state_bytes) - optimizer_state_bytes),
                ("DeepSpeed's partitions and buffers (parameters, float32 master, gradients, reduce buckets)",
                 self.held),
                ("every parameter gathered at once: the whole ones counted, plus the gather's padding",
                 self.padding),
                (f"a reduction's temporary ({temporary} elements: the bucket or the largest parameter)",
                 temporary * self.reduce_bytes)]

