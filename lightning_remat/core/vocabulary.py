"""The words plans and profiles are made of, as ``str`` enums (members equal their values, as torch's
``CheckpointPolicy``); ``check`` turns a user's string into a member or a ValueError naming what is accepted.

Example:
    >>> Policy.check("sac:save_matmuls"), Action.check("recompute")
    (<Policy.SAVE_MATMULS: 'save_matmuls'>, <Action.RECOMPUTE: 'recompute'>)
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


# A policy's option name: "sac:" + the policy (``runtime.profiling.stage_options.option_actions``).
POLICY_PREFIX = "sac:"


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
