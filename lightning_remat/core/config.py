"""What a user asks for, checked once and passed whole: the budget, the cost kind, how to profile.

Every entry point (``plan_remat``, ``AutoRemat``, the Accelerate plugin, the batch-size search,
the command line) builds one ``RematConfig`` from its arguments; the checks below run there,
once, and the planning service reads the typed fields instead of a row of keyword arguments.

Example:
    >>> config = RematConfig("10GB", cost="flops", profile=ProfileOptions(candidates=("GPT2Block",)))
    >>> config.budget.text, config.budget_bytes(), config.profile.candidates
    ('10GB', 10000000000, ('GPT2Block',))
    >>> RematConfig("10GB", profile=ProfileOptions(fake=True))
    Traceback (most recent call last):
    ...
    ValueError: a fake profile has no timings: pass cost='flops', or gpu= to price FLOPs in seconds
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .budget import Budget
from .errors import ShardingError
from .vocabulary import CostKind, Policy, Precision

COST_KINDS = CostKind.values()
# Lightning's names for what a fake profile can model: the dtype parameters, gradients and optimizer
# state are kept in, and whether the step runs under autocast (``vocabulary.Precision``).
PRECISIONS = {p.value: p.storage_and_autocast for p in Precision}


def check_cost_kind(kind: Any) -> CostKind:
    """Validate a cost kind (``"time"``, ``"flops"`` or ``"roofline"``): the ``CostKind`` it names.

    Example:
        >>> check_cost_kind("flops") is CostKind.FLOPS
        True
    """
    return CostKind.check(kind)


def normalize_candidates(candidates: Any) -> tuple | None:
    """None, or a non-empty tuple of module classes, class names or name patterns.

    A string is one name or pattern, or several separated by commas (as an environment variable
    gives them).

    Example:
        >>> normalize_candidates("GPT2Block, transformer.h.*")
        ('GPT2Block', 'transformer.h.*')
        >>> normalize_candidates(None) is None
        True
    """
    if candidates is None:
        return None
    if isinstance(candidates, str):
        items: list = [part.strip() for part in candidates.split(",") if part.strip()]
    elif isinstance(candidates, type):
        items = [candidates]
    else:
        try:
            items = list(candidates)
        except TypeError:
            items = [candidates]
    if not items or not all(isinstance(c, (str, type)) for c in items):
        raise ValueError("candidates must be None or a non-empty list of module classes, class names or name "
                         f"patterns (such as 'GPT2Block' or 'transformer.h.*'), got {candidates!r}")
    return tuple(items)


@dataclass(frozen=True)
class ProfileOptions:
    """How a step is profiled.

    Attributes:
        candidates: None for automatic stages, or module classes / class names / name patterns.
        fake: profile on fake tensors (nothing is allocated): a model larger than this machine,
            a device that is not here.
        dtype: with ``fake``, the dtype floating-point parameters train in (a ``torch.dtype`` or
            its name, ``"bfloat16"``).
        device: the device planned for (``"cuda"``); default the model's.
        gpu: with ``fake``, a GPU name whose throughput prices FLOPs in seconds.
        device_memory: the target device's total memory when it is not this machine's.
        warmup: unmeasured steps before profiling.
        accumulation_steps: micro-batches per optimizer step (gradient accumulation). Above 1,
            every micro-batch but the first of a window runs with all gradients alive from its
            start, and the profile measures that one.
        gradient_buckets: the model trains under DDP, whose reducer keeps its gradient buckets
            (a copy of the gradients, or the gradients themselves with ``gradient_as_bucket_view``)
            for the whole run: counted in every term.
        world_size: with ``fake``, plan one rank of an FSDP2 run over this many GPUs: the fake twin
            is sharded with ``fully_shard`` (each candidate block, then the root) over a fake process
            group, and the figures are per GPU (``docs/sharded.md``). The step's batch is one rank's.
        precision: with ``fake``, how the step trains, in Lightning's names: ``"bf16-mixed"``
            (float32 parameters, gradients and optimizer state, the step under bfloat16 autocast),
            ``"bf16-true"`` (everything in bfloat16, as ``dtype=torch.bfloat16``), ``"16-mixed"``,
            ``"16-true"``, ``"32-true"``. A real profile runs the step as it is given.
        repeated_blocks: with ``fake``, a model whose stages are N interchangeable layers (same
            class, parameters and settings, in one ``ModuleList``) is profiled at 4 and 5 layers
            and the profile extrapolated to N (exact: every term is linear in the depth, checked
            on the measured ones; otherwise the whole model is profiled). False profiles all N.
        offload: also offer each stage's "offload" option (its saved tensors go to host memory and
            come back for backward: ``runtime.offload``); only for an accelerator target.
        policies: the op-level selective-checkpointing policies offered as options of every stage
            (``runtime.sac.POLICIES``, e.g. ``("save_matmuls",)``); None for every one of them;
            ``()`` (the default) for none: only keep, whole and heavy children. Opt-in for now:
            each costs one more measured step, eager SAC is slower in wall-clock on the CPU, and
            plans that mix a policy with other options can exceed their prediction (a LoRA Llama
            measured 1.3% above it: docs/selective_checkpointing.md).

    Example:
        >>> ProfileOptions(gpu="h100")
        Traceback (most recent call last):
        ...
        ValueError: gpu=, dtype= and precision= apply to fake profiles (fake=True); a real profile times the real step
    """

    candidates: Any = None
    fake: bool = False
    dtype: Any = None
    device: str | None = None
    gpu: str | None = None
    device_memory: int | str | None = None
    warmup: int = 1
    precision: str | None = None
    accumulation_steps: int = 1
    gradient_buckets: bool = False
    world_size: int = 1
    repeated_blocks: bool = True
    policies: Any = ()
    offload: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", normalize_candidates(self.candidates))
        if self.policies is not None:
            if isinstance(self.policies, str) or not all(isinstance(p, str) for p in self.policies):
                raise ValueError(f"policies must be a sequence of policy names, got {self.policies!r}")
            object.__setattr__(self, "policies", tuple(Policy.check(p).value for p in self.policies))
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        if not self.fake and (self.gpu is not None or self.dtype is not None or self.precision is not None):
            raise ValueError("gpu=, dtype= and precision= apply to fake profiles (fake=True); a real profile times "
                             "the real step")
        if self.precision is not None:
            object.__setattr__(self, "precision", Precision.check(self.precision))
            if self.dtype is not None:
                raise ValueError("give precision= or dtype=, not both (dtype=torch.bfloat16 is precision='bf16-true')")
        if self.device is not None:
            object.__setattr__(self, "device", str(self.device))
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"accumulation_steps must be an int >= 1, got {steps!r}")
        check_world_size(self.world_size, self.fake)


def check_world_size(world_size: Any, fake: bool) -> int:
    """Validate a world size (GPUs an FSDP2 step is sharded over).

    FSDP2 pads a parameter whose first dimension the world size does not divide, so any world
    size >= 1 is valid; above 1 a single process can only plan it on fake tensors.

    Example:
        >>> check_world_size(8, fake=True)
        8
        >>> check_world_size(8, fake=False)
        Traceback (most recent call last):
        ...
        lightning_remat.core.errors.ShardingError: world_size=8 needs fake=True: a single process cannot run a real step sharded over 8 GPUs. Pass fake=True (the step is sharded with fully_shard over a fake process group in this process), or plan inside the real sharded run (torchrun, one process per GPU) with world_size=1
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ShardingError(f"world_size must be an int >= 1 (the number of GPUs the step is sharded over), "
                            f"got {world_size!r}")
    if world_size > 1 and not fake:
        raise ShardingError(
            f"world_size={world_size} needs fake=True: a single process cannot run a real step sharded over "
            f"{world_size} GPUs",
            "Pass fake=True (the step is sharded with fully_shard over a fake process group in this process), "
            "or plan inside the real sharded run (torchrun, one process per GPU) with world_size=1")
    return world_size


@dataclass(frozen=True)
class RematConfig:
    """A budget, what recomputation costs, and how to profile: one request for a plan.

    Example:
        >>> RematConfig("min").budget.is_min
        True
        >>> RematConfig("1GB", cost="seconds")
        Traceback (most recent call last):
        ...
        ValueError: cost must be one of ('time', 'flops', 'roofline'), got 'seconds'
    """

    budget: Any
    cost: CostKind = CostKind.TIME
    profile: ProfileOptions = field(default_factory=ProfileOptions)

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", Budget.parse(self.budget))
        object.__setattr__(self, "cost", check_cost_kind(self.cost))
        if self.profile.fake and self.cost == "time" and self.profile.gpu is None:
            raise ValueError("a fake profile has no timings: pass cost='flops', or gpu= to price FLOPs in seconds")

    def budget_bytes(self, device: Any = None) -> int | str:
        """The budget in bytes for the device planned for (``profile.device``, else ``device``), or ``"min"``."""
        return self.budget.resolve(device=self.profile.device or device, total_memory=self.profile.device_memory)

    def require_size(self, purpose: str) -> None:
        """Refuse ``"min"`` where only a size has a meaning (``purpose`` says where).

        Example:
            >>> RematConfig("min").require_size("a batch-size search")
            Traceback (most recent call last):
            ...
            ValueError: budget="min" has no meaning for a batch-size search: give a size such as "10GB", a number of bytes or a percentage such as "80%"
        """
        if self.budget.is_min:
            raise ValueError(f'budget="min" has no meaning for {purpose}: give a size such as "10GB", '
                             'a number of bytes or a percentage such as "80%"')
