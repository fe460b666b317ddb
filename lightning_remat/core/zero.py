"""What one rank of DeepSpeed ZeRO-2 (``Zero2Facts``) or ZeRO-3 (``Zero3Facts``, its own docstring) holds beside
a whole-model step, computed from its configuration and the parameter count (no torch here:
``integrations.accelerate.deepspeed`` reads the figures from the live engine).

ZeRO-2 keeps every parameter whole on every rank and partitions the gradients and the optimizer state. A profile
of the whole model's step (whole parameters, whole gradients, the whole optimizer state and its step) is turned
into a rank's by these terms, each counted in every term of the step (a bound, not a timeline):

- the optimizer state: the rank keeps its partition, ``1/N`` of the whole (the rest is subtracted);
- DeepSpeed's float32 master copy of the rank's partition (the optimizer steps it, then copies it back);
- the gradient partition (``contiguous_gradients``): allocated at the first gradient of the rank's partition,
  which may come early in backward, while the activations are at their largest;
- the reduce bucket (``reduce_bucket_size`` elements; two with ``overlap_comm``) and one reduction's temporary,
  as large as the bucket or the largest parameter (a parameter larger than the bucket is reduced on its own).

The whole gradients the profile counts bound what the rank holds of them otherwise: the gradients not yet
reduced, and in the optimizer step the partition and its flattened copy (2/N of the whole, at most the whole
for N >= 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from .budget import format_bytes


class _RankTerms:
    """What both stages' facts share: a stage's ``terms`` summed, and said in one note."""

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

    stage = 2  # not a field: the class says it
    world: int
    partition: int
    gradient_bytes: int = 4
    reduce_bytes: int = 4
    bucket: int = 0
    overlap: bool = False
    contiguous: bool = True
    largest: int = 0

    def terms(self, optimizer_state_bytes: int) -> list[tuple[str, int]]:
        """(label, bytes) of what a rank holds beside a whole-model step whose optimizer state is
        ``optimizer_state_bytes`` (the whole model's); negative where it holds less."""
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
    """One rank's ZeRO-3 figures, read from the live engine: ``world`` ranks; ``held`` bytes DeepSpeed's ZeRO-3
    optimizer holds from ``deepspeed.initialize`` on (the rank's parameter partition, the float32 master partition
    where it is another tensor, the gradient partitions, the reduce buckets); ``numel`` elements of the whole model
    and ``partition`` of the rank's (padded); ``padding`` bytes a gather adds to the whole parameters (each is
    gathered as ``world`` equal partitions); ``bucket`` elements (``reduce_bucket_size``), ``reduce_bytes`` per
    element, the ``largest`` parameter's elements.

    ZeRO-3 partitions the parameters too, and gathers a module's whole parameters for its forward and again for
    its backward. How many stay gathered at once is not bounded by DeepSpeed's configuration: its
    ``stage3_max_live_parameters`` limits only what is prefetched (a module's own fetch is never refused), and
    ``stage3_max_reuse_distance`` keeps a parameter gathered until its next use when that comes soon, so on a small
    model every parameter can stay gathered from forward to backward; ``stage3_param_persistence_threshold``'s
    small parameters are kept whole for good. The bound: every parameter gathered at once, the whole parameters
    the profile counts, plus the gather's padding. Beside them the rank holds its partitions and buffers
    (``held``), the optimizer state of its partition, and one reduction's temporary.

    Example:
        >>> facts = Zero3Facts(world=2, held=1_305_344, numel=160320, partition=80160, padding=0, bucket=4096,
        ...                    reduce_bytes=4, largest=16384)
        >>> [nbytes for _, nbytes in facts.terms(1282720)]  # state kept 1/2, partitions and buffers, gather, reduction
        [-641360, 1305344, 0, 65536]
        >>> facts.kept(1282720)
        641360
    """

    stage = 3  # not a field: the class says it
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
        """(label, bytes) of what a rank holds beside a whole-model step whose optimizer state is
        ``optimizer_state_bytes``; negative where it holds less."""
        temporary = max(self.bucket, self.largest)
        return [(f"optimizer state beyond the rank's partition ({self.partition} of {self.numel} elements kept)",
                 self.kept(optimizer_state_bytes) - optimizer_state_bytes),
                ("DeepSpeed's partitions and buffers (parameters, float32 master, gradients, reduce buckets)",
                 self.held),
                ("every parameter gathered at once: the whole ones counted, plus the gather's padding",
                 self.padding),
                (f"a reduction's temporary ({temporary} elements: the bucket or the largest parameter)",
                 temporary * self.reduce_bytes)]

