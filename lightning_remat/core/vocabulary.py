"""The words plans and profiles are made of, as ``str`` enums (members equal their values, as torch's
``CheckpointPolicy``); ``check`` turns a user's string into a member or a ValueError naming what is accepted.

Example:
    >>> OptionKind.of("sac:save_matmuls"), OptionKind.of("attn")
    (<OptionKind.POLICY: 'policy'>, <OptionKind.CHILDREN: 'children'>)
    >>> CostKind.check("seconds")
    Traceback (most recent call last):
    ...
    ValueError: cost must be one of ('time', 'flops', 'roofline'), got 'seconds'
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class _Words(str, Enum):
    """A ``str`` enum whose ``str()`` and format are its value on every Python (3.10 prints ``Class.MEMBER``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def _member(cls, value: Any, what: str, accepted: Any = None) -> Any:
        if isinstance(value, str) and value in cls.values():
            return cls(value)
        raise ValueError(f"{what} must be one of {cls.values() if accepted is None else accepted}, got {value!r}")


class CostKind(_Words):
    """What recomputation is priced in."""

    TIME = "time"  # measured forward seconds
    FLOPS = "flops"  # counted FLOPs: deterministic plans
    ROOFLINE = "roofline"  # per op max(FLOPs / peak FLOP/s, bytes / bandwidth)

    @classmethod
    def check(cls, kind: Any) -> "CostKind":
        return cls._member(kind, "cost")


class Policy(_Words):
    """Op-level selective-checkpointing policies (``runtime.installing.sac`` says what each saves)."""

    SAVE_MATMULS = "save_matmuls"
    SAVE_PROJECTIONS = "save_projections"
    SAVE_ALTERNATE_MATMULS = "save_alternate_matmuls"
    SAVE_ATTENTION = "save_attention"

    @classmethod
    def check(cls, policy: Any) -> "Policy":
        """The member named by ``policy``, with or without the ``"sac:"`` of its option name."""
        name = (policy_of(policy) or policy) if isinstance(policy, str) else policy
        if isinstance(name, str) and name in cls.values():
            return cls(name)
        raise ValueError(f"unknown selective-checkpointing policy {policy!r}; known: {', '.join(cls.values())} "
                         f"(each also spelled as its option name, '{POLICY_PREFIX}' + the name)")


# Option names: "sac:" + a policy, "chunks:" + a chunked head's count, "fused:" + a fused head's count.
POLICY_PREFIX = "sac:"
CHUNKS_PREFIX = "chunks:"
FUSED_PREFIX = "fused:"


class OptionKind(_Words):
    """What a profile option of a stage does (``core.memory_model.StageOption``)."""

    KEEP = "keep"  # nothing recomputed: everything the forward saves is kept
    WHOLE = "whole"  # the stage's whole forward recomputed
    CHILDREN = "children"  # some children recomputed (the option is named after them: "attn", "mlp")
    POLICY = "policy"  # recomputed under an op-level policy ("sac:save_matmuls")
    SEGMENT = "segment"  # recomputed with its neighbours as one checkpoint (``core.spans``)
    OFFLOAD = "offload"  # saved tensors to host memory and back
    OFFLOAD_HIDDEN = "offload-hidden"  # only what the host link moves while the next stage computes
    CHUNKS = "chunks"  # the LM head and its loss over sequence chunks, each recomputed in backward ("chunks:8")
    OFFLOAD_INPUT = "offload-input"  # recomputed whole, the input its checkpoint keeps on the host
    FUSED = "fused"  # the LM head and its loss over sequence chunks, gradients computed in forward ("fused:8")

    @classmethod
    def of(cls, name: str) -> "OptionKind":
        """The kind of an option name (a child option's name is the child's)."""
        if name.startswith(POLICY_PREFIX):
            return cls.POLICY
        if name.startswith(CHUNKS_PREFIX):
            return cls.CHUNKS
        if name.startswith(FUSED_PREFIX):
            return cls.FUSED
        if name.startswith("segment "):
            return cls.SEGMENT
        return _FIXED_KINDS.get(name, cls.CHILDREN)


# The option names of the kinds that have one fixed name.
OPTION_NAMES = {OptionKind.KEEP: "keep", OptionKind.WHOLE: "whole", OptionKind.OFFLOAD: "offload",
                OptionKind.OFFLOAD_HIDDEN: "offload:hidden", OptionKind.OFFLOAD_INPUT: "whole+offload-input"}
_FIXED_KINDS = {name: kind for kind, name in OPTION_NAMES.items()}


def option_name(kind: OptionKind, policy: Any = None) -> str:
    """The option name of a kind; ``policy``: a policy's name, or the number of chunks of ``CHUNKS`` and ``FUSED``.

    Example:
        >>> option_name(OptionKind.FUSED, 8), OptionKind.of("fused:8")
        ('fused:8', <OptionKind.FUSED: 'fused'>)
    """
    if kind == OptionKind.POLICY:
        return POLICY_PREFIX + str(Policy.check(policy))
    if kind in (OptionKind.CHUNKS, OptionKind.FUSED):
        return (CHUNKS_PREFIX if kind == OptionKind.CHUNKS else FUSED_PREFIX) + str(check_chunks(policy))
    if kind not in OPTION_NAMES:
        raise ValueError(f"options of kind {kind!r} are named after what they recompute")
    return OPTION_NAMES[OptionKind(kind)]


def policy_of(name: str) -> str:
    """The policy of an option name, or "" for the options that run no policy."""
    return name[len(POLICY_PREFIX):] if name.startswith(POLICY_PREFIX) else ""


def check_chunks(chunks: Any) -> int:
    """A number of sequence chunks for the LM head and its loss: an int >= 1 (1: not chunked)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"the number of chunks of a chunked loss is an int >= 1, got {chunks!r}")
    return chunks


class Action(_Words):
    """What a plan does with a stage (``core.plan.StageAction``)."""

    KEEP = "keep"  # run as it is: everything it saves stays on the device
    RECOMPUTE = "recompute"  # its forward (or some children's) runs again in backward, maybe under a policy
    SEGMENT = "segment"  # recomputed with its neighbours as one checkpoint
    OFFLOAD = "offload"  # what it saves goes to host memory and comes back, maybe only up to a limit
    CHUNK = "chunk"  # the LM head and its loss over sequence chunks, each recomputed in backward
    FUSE = "fuse"  # the same chunks with each chunk's gradients computed in forward: nothing recomputed

    @classmethod
    def check(cls, action: Any) -> "Action":
        return cls._member(action, "a stage's action")


class Precision(_Words):
    """How a (fake) step trains, in Lightning's names (``core.config.PRECISIONS`` says in which dtypes).

    Example:
        >>> Precision.check("bf16-mixed"), Precision.check("bf16-true") == "bf16-true"
        (<Precision.BF16_MIXED: 'bf16-mixed'>, True)
    """

    FP32_TRUE = "32-true"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "16-mixed"
    BF16_TRUE = "bf16-true"
    FP16_TRUE = "16-true"

    @classmethod
    def check(cls, precision: Any) -> "Precision":
        return cls._member(precision, "precision", sorted(cls.values()))
