"""Every error lightning-remat raises on purpose: a ``RematError`` and a builtin (``except ValueError`` works)."""

from __future__ import annotations

import traceback
from typing import Any

from .budget import format_bytes

# Frames of these packages are the machinery around a step, not the code that failed in it.
_MACHINERY = ("/torch/", "/lightning_remat/", "/lightning/", "/lightning_fabric/", "/accelerate/", "contextlib.py", "<frozen")


def where_it_failed(error: BaseException) -> str:
    """The innermost frame of ``error``'s traceback in the user's or the model's code: ``file:line in function``.

    Example:
        >>> def step():
        ...     return 1 / 0
        >>> try:
        ...     step()
        ... except ZeroDivisionError as err:
        ...     where_it_failed(err).endswith("in step")
        True
    """
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not any(part in frame.filename for part in _MACHINERY):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return ""


def _rebuild(cls: type, message: str, fields: dict[str, Any]) -> "RematError":
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(fields)
    return error


class RematError(Exception):
    """The base of lightning-remat's errors; they pickle with every field and their full message (rank 0
    decides, the other ranks raise the very same error).

    Example:
        >>> import pickle
        >>> err = BudgetTooSmallError(100, 150, 80)
        >>> err.add_hint("(AutoRemat, budget='100B')")
        >>> again = pickle.loads(pickle.dumps(err))
        >>> isinstance(again, ValueError), str(again) == str(err), again.smallest_peak_bytes
        (True, True, 150)
    """

    def add_hint(self, hint: str) -> None:
        """Append context (which integration, which setting) to the message."""
        self.args = (f"{self.args[0]} {hint}" if self.args else hint, *self.args[1:])

    def __reduce__(self) -> tuple:
        # Rebuilt from the message and fields, so that a hint added on one rank reaches the others.
        return (_rebuild, (type(self), str(self.args[0]) if self.args else "", dict(self.__dict__)))


class BudgetTooSmallError(RematError, ValueError):
    """No plan fits the budget; ``smallest_peak_bytes`` is the least peak that can be reached."""

    def __init__(self, budget_bytes: int, smallest_peak_bytes: int, static_bytes: int = 0, message: str | None = None):
        self.budget_bytes = budget_bytes
        self.smallest_peak_bytes = smallest_peak_bytes
        self.static_bytes = static_bytes
        # Per knob that lowers the least peak: {"knob", "setting", "peak_bytes", "fits"} (service.knobs).
        self.knobs: list[dict[str, Any]] = []
        super().__init__(message or (
            f"No recompute plan fits a budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes): "
            f"the smallest reachable peak is {format_bytes(smallest_peak_bytes)} ({smallest_peak_bytes} bytes), "
            f"of which {format_bytes(static_bytes)} is parameters, gradients and optimizer state. "
            f"Raise the budget to at least that, or reduce the batch size."))

    def with_knobs(self, knobs: list[dict[str, Any]]) -> "BudgetTooSmallError":
        """This error with ``knobs`` (each a predicted setting and its least peak) held and said in the message."""
        self.knobs = sorted(knobs, key=lambda k: (not k["fits"], k["peak_bytes"] is None, k["peak_bytes"] or 0))
        if self.knobs:
            said = "; ".join(f"{k['knob']} could not be predicted ({k['error']})" if k["peak_bytes"] is None else
                             f"{k['knob']} ({k['setting']}) reaches {format_bytes(k['peak_bytes'])}, "
                             + ("within the budget" if k["fits"] else "still above it") for k in self.knobs)
            self.add_hint(f"Knobs, each predicted: {said}.")
        return self


class BatchSizeTooSmallBudgetError(BudgetTooSmallError):
    """Even a batch of one does not fit the budget (or not within ``max_overhead``); a ``BudgetTooSmallError``."""


class NoCandidateError(RematError, ValueError):
    """The model has no module that recomputation could wrap."""


class PlanFormatError(RematError, ValueError):
    """A saved plan holds a value a plan cannot have; ``field`` names where, ``value`` is what was found.

    Example:
        >>> err = PlanFormatError("budget_bytes", "10GB", "a whole number of bytes")
        >>> str(err), err.field
        ("a plan's 'budget_bytes' must be a whole number of bytes, got '10GB'", 'budget_bytes')
    """

    def __init__(self, field: str, value: Any, expected: str, owner: str = "a plan's"):
        self.field = field
        self.value = value
        shown = repr(value)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        super().__init__(f"{owner} '{field}' must be {expected}, got {shown}")


class PlanMismatchError(RematError, ValueError):
    """A plan was made for a model with other parameter shapes or stages; nothing was applied."""


class InstallationMismatchError(RematError, RuntimeError):
    """What is installed on a model is not what its plan says (``planned``/``installed``: per kind of action), so
    the step does not run.

    Example:
        >>> err = InstallationMismatchError({"recomputed": {"h.0": ""}}, {"recomputed": {}}, "(ShapePlans.use)")
        >>> print(err)
        lightning-remat: what is installed on the model is not what the plan says: recomputed: the plan says {'h.0': ''}, installed is {}. The step would not run within the plan's budget; install the plan again (apply_plan) or find what changed the model's modules. (ShapePlans.use)
    """

    def __init__(self, planned: dict[str, Any], installed: dict[str, Any], where: str = ""):
        self.planned = planned
        self.installed = installed
        # Only the kinds that differ: a large model's lists are long.
        self.differences = "; ".join(
            f"{key}: the plan says {planned.get(key)!r}, installed is {installed.get(key)!r}"
            for key in dict.fromkeys([*planned, *installed]) if planned.get(key) != installed.get(key))
        super().__init__("lightning-remat: what is installed on the model is not what the plan says: "
                         f"{self.differences}. The step would not run within the plan's budget; install the plan "
                         "again (apply_plan) or find what changed the model's modules." + (f" {where}" if where else ""))


class AlreadyCheckpointedError(RematError, ValueError):
    """The model already uses activation checkpointing that lightning-remat did not put there."""


class FakeProfileError(RematError, RuntimeError):
    """The model's code cannot run under fake tensors; ``requested=False``: the fake pass is the package's own.

    Example:
        >>> error = FakeProfileError("aten.nonzero.default", requested=False)
        >>> "planned on fake tensors whatever fake= says" in str(error)
        True
    """

    def __init__(self, op: str, detail: str = "", requested: bool = True, where: str = ""):
        self.op, self.detail, self.requested, self.where = op, detail, requested, where
        advice = ("Profile it for real (fake=False) on a smaller configuration, or make that code path value-free."
                  if requested else
                  "Every batch shape is planned on fake tensors whatever fake= says (fake=False adds a real profile of "
                  "the first batch only), so that no step runs before its plan exists. Make that code path "
                  "value-free, or give every batch one shape (pad to a fixed length), so that no other shape is "
                  "planned.")
        super().__init__(
            f"The model cannot be profiled under fake tensors: its code{f' ({where})' if where else ''} calls {op}, "
            "which needs real tensor "
            f"values (a .item(), .tolist(), a data-dependent branch or shape). {detail}{advice}")


class PlanningFailedError(RematError, RuntimeError):
    """Planning failed on rank 0 with an error that cannot travel to the other ranks as itself."""


class ShardingError(RematError, ValueError):
    """A sharded plan was asked for in a way that cannot work; the message says what to do instead."""

    def __init__(self, problem: str, hint: str = ""):
        super().__init__(f"{problem}. {hint}" if hint else problem)


class ShardedBudgetTooSmallError(BudgetTooSmallError):
    """No plan fits the budget per GPU at this world size; ``smallest_world_size`` would (None: none would)."""

    def __init__(self, budget_bytes: int, smallest_peak_bytes: int, static_bytes: int, world_size: int,
                 smallest_world_size: int | None):
        self.world_size = world_size
        self.smallest_world_size = smallest_world_size
        if smallest_world_size is None:
            what = ("no world size would fit it: what sharding does not divide (activations of the local batch, "
                    "unsharded parameters in flight) is already above it. Reduce the batch per GPU")
        else:
            what = (f"sharding over more GPUs would: the least peak is estimated to fit from world size "
                    f"{smallest_world_size} on (or reduce the batch per GPU)")
        super().__init__(budget_bytes, smallest_peak_bytes, static_bytes, message=(
            f"No recompute plan fits a budget of {format_bytes(budget_bytes)} per GPU at world size {world_size}: "
            f"the least peak per GPU there is {format_bytes(smallest_peak_bytes)} ({smallest_peak_bytes} bytes), "
            f"of which {format_bytes(static_bytes)} is sharded parameters, gradients and optimizer state; "
            f"{what}."))


class UnsupportedSetupError(RematError, NotImplementedError):
    """A training setup planning does not support (DeepSpeed, Megatron-LM, XLA, ``dynamo_backend``)."""


class StepError(RematError, RuntimeError):
    """The training step does something planning cannot use (no candidate block ran in it, say)."""


class InvalidPlanError(RematError, ValueError):
    """A plan's actions cannot be installed together (a module named twice, or nested checkpoints)."""


class SkippedStepError(StepError):
    """``training_step`` skipped the batch it was profiled on: no loss to plan on; ``AutoRemat`` tries the next."""


class ConflictingArgumentsError(RematError, TypeError):
    """The same setting was given twice (a keyword and inside ``options=``, or two sessions on one model)."""


class UnsupportedShardingError(UnsupportedSetupError):
    """The model is sharded in a way planning cannot profile (FSDP1's flat parameters, for example)."""
