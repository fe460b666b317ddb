"""What a user asks for (budget, cost kind, how to profile), checked once in one ``RematConfig``. Each field's
``help`` is the one description of that setting: the docstrings and the command line's ``--help`` use it."""

from __future__ import annotations

import textwrap
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from .budget import Budget
from . import hardware
from .errors import ConflictingArgumentsError, ShardingError
from .vocabulary import CostKind, Policy, Precision

DEFAULT_COST = None  # the target's (``RematConfig.for_target``)
DTYPES = ("bfloat16", "float16", "float32")
# Per precision, the dtype parameters, gradients and optimizer state are kept in, and the autocast dtype (None: none).
PRECISIONS = {Precision.FP32_TRUE.value: ("float32", None), Precision.BF16_MIXED.value: ("float32", "bfloat16"),
              Precision.FP16_MIXED.value: ("float32", "float16"), Precision.BF16_TRUE.value: ("bfloat16", None),
              Precision.FP16_TRUE.value: ("float16", None)}

# Bounds of the whole-number settings: far above any real use, low enough that a typo (10**20) fails at once.
MAX_WARMUP = 1_000
MAX_STEPS = 100_000  # profile_steps, accumulation_steps
MAX_WORLD_SIZE = 65_536
# The least device memory a target may have: below it not even a toy model's step fits (0 or "1KB": typos).
MIN_DEVICE_MEMORY = 2**20
# torch's device types, so that the core (no torch) refuses ``device="banana"`` as the setting it is.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "hpu", "mtia", "meta", "xla", "lazy", "ipu", "hip", "ve", "fpga",
                "maia", "vulkan", "mkldnn", "opengl", "opencl", "ideep", "privateuseone", "npu")


def check_int(name: str, value: Any, low: int, high: int, why: str = "") -> int:
    """``value`` if it is an int from ``low`` to ``high``, else a ValueError naming ``name`` and ``why``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int >= {low} and <= {high}{why}, got {value!r}")
    return value


def check_device(device: Any) -> str | None:
    """A device's name (``"cuda"``, ``"cuda:1"``, a ``torch.device``) as text; None stays None."""
    if device is None:
        return None
    text = str(device).strip()
    kind, _, index = text.partition(":")
    if kind not in DEVICE_TYPES or (index and not (index.isdigit() and int(index) <= MAX_WORLD_SIZE)):
        raise ValueError(f"device must be a device type with an optional index, such as 'cuda' or 'cuda:1' (a type "
                         f"among {', '.join(DEVICE_TYPES)}), got {device!r}")
    return text


def check_device_memory(total: Any) -> Any:
    """A target device's total memory (a size of at least 1 MiB), returned as given; None stays None."""
    if total is None:
        return None
    try:
        nbytes = Budget.parse(total).nbytes
    except ValueError:
        nbytes = None
    if nbytes is None or nbytes < MIN_DEVICE_MEMORY:
        raise ValueError(f"device_memory must be a size of at least 1 MiB ({MIN_DEVICE_MEMORY} bytes): the target "
                         f"device's total memory, such as \"80GB\"; got {total!r}")
    return total


def normalize_candidates(candidates: Any) -> tuple | None:
    """None, or a non-empty tuple of module classes, class names or name patterns (text: comma-separated)."""
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


def parse_policies(text: Any) -> tuple | None:
    """Policies from text (comma-separated names; ``"all"``: None; ``"none"``: ``()``); non-text passes through."""
    if not isinstance(text, str):
        return text
    words = tuple(part.strip() for part in text.split(",") if part.strip())
    if words in ((), ("none",)):
        return ()
    return None if words == ("all",) else words


def check_policies(policies: Any) -> tuple | None:
    """The policies a user offers as None (every policy) or a tuple of plain policy names (text: ``parse_policies``)."""
    policies = parse_policies(policies)
    if policies is None:
        return None
    try:  # a generator is read once, here
        names = tuple(policies) if not isinstance(policies, (bytes, dict)) else None
    except TypeError:
        names = None
    if names is None or not all(isinstance(p, str) for p in names):
        raise ValueError(f"policies must be None (every policy), () (none), or a list of policy names among "
                         f"{', '.join(Policy.values())} (each also spelled 'sac:' + the name), got {policies!r}")
    return tuple(Policy.check(p).value for p in names)


@dataclass(frozen=True)
class ProfileOptions:
    """How a step is profiled.

    Example:
        >>> ProfileOptions(gpu="h100")
        Traceback (most recent call last):
        ...
        ValueError: gpu=, dtype= and precision= apply to fake profiles (fake=True); a real profile times the real step
    """

    candidates: Any = field(default=None, metadata={"help": (
        "which modules may be recomputed: module classes, class names or fnmatch patterns over module names "
        "('GPT2Block', 'transformer.h.*'; in text, separated by commas); unset (None), found automatically: the "
        "blocks of the model's layer stack"), "parse": normalize_candidates})
    fake: bool = field(default=False, metadata={"group": "target", "help": (
        "profile on fake tensors (nothing is allocated, nothing real runs): a model larger than this machine, "
        "a device that is not here; costs are counted FLOPs")})
    dtype: Any = field(default=None, metadata={"group": "target", "choices": DTYPES, "help": (
        "fake profiles only: the dtype floating-point parameters, gradients and optimizer state are kept in "
        "(pure: no autocast), bfloat16, float16 or float32 (a torch.dtype or its name)")})
    device: str | None = field(default=None, metadata={"group": "target", "help": (
        "the device planned for, such as 'cuda'; unset (None), the model's")})
    gpu: str | None = field(default=None, metadata={"group": "target", "help": (
        "fake profiles only: a GPU name (h100, a100, l4, ...) whose throughput prices FLOPs in seconds")})
    device_memory: int | str | None = field(default=None, metadata={"group": "target", "help": (
        "the target device's total memory ('80GB') when it is not this machine's: percentages refer to it, and "
        "a budget above it is an error")})
    warmup: int = field(default=1, metadata={"help": "unmeasured steps run before profiling (lazy set-up, allocator)"})
    precision: str | None = field(default=None, metadata={"group": "target", "choices": tuple(PRECISIONS), "help": (
        "fake profiles only: how the step trains, in Lightning's names: bf16-mixed (float32 parameters, gradients "
        "and optimizer state, the step under bfloat16 autocast), bf16-true (everything in bfloat16), 16-mixed, "
        "16-true, 32-true. A real profile runs the step as it is given")})
    accumulation_steps: int = field(default=1, metadata={"help": (
        "micro-batches per optimizer step (gradient accumulation); above 1, every micro-batch but the first of a "
        "window runs with all gradients alive from its start, and that one is profiled")})
    gradient_buckets: bool = field(default=False, metadata={"help": (
        "the model trains under DDP, whose reducer keeps its gradient buckets (a copy of the gradients, or the "
        "gradients themselves with gradient_as_bucket_view) for the whole run: counted in every term")})
    world_size: int = field(default=1, metadata={"group": "target", "help": (
        "fake profiles only: plan one GPU of an FSDP2 step sharded over this many GPUs (fully_shard of each "
        "candidate block, then the root, over a fake process group); the budget and every figure are per GPU, "
        "and the step's batch is one GPU's (docs/sharded.md)")})
    repeated_blocks: bool = field(default=True, metadata={"group": "target", "help": (
        "fake profiles only: N interchangeable layers (same class, parameters and settings, in one ModuleList) "
        "are profiled at 4 and 5 layers and the profile extrapolated to N (exact: every term is linear in the "
        "depth); off profiles all N")})
    policies: Any = field(default=(), metadata={"help": (
        "op-level selective-checkpointing policies offered as options of every stage: save_matmuls (matmul "
        "and attention outputs saved, the rest recomputed), " + ", ".join(Policy.values()[1:]) + " (each also "
        "spelled as its option name, sac:save_matmuls; in text, separated by commas); 'all' (None) "
        "for every one; none by default (). Opt-in: each costs one more measured step, eager SAC is slower in "
        "wall-clock on the CPU, and plans that mix a policy with other options can exceed their prediction "
        "(docs/selective_checkpointing.md)"), "parse": parse_policies})
    offload: bool = field(default=False, metadata={"group": "target", "help": (
        "also offer each stage's offload option (its saved tensors go to host memory and come back for backward, "
        "where the transfer hides behind compute; docs/offload.md); an accelerator target only (a CUDA model, or "
        "fake with a gpu), and never more host memory than the host has free")})
    chunk_loss: bool = field(default=False, metadata={"help": (
        "also plan a causal LM's head and its loss as a stage whose options compute the projection and the "
        "cross-entropy over 2, 4, 8, 16 or 32 sequence chunks, each recomputed in backward or fused (each chunk's "
        "gradients computed in forward, nothing recomputed), so the full logits never exist (found for Hugging Face "
        "*ForCausalLM / *LMHeadModel models called with labels=, and for a head whose loss the model computes with "
        "lightning_remat.head_loss). The loss and gradients are the same; a plan that chunks makes the model return "
        "logits=None (docs/long_context.md)")})
    tile_mlp: bool = field(default=False, metadata={"help": (
        "also offer each stage's MLP over sequence chunks (keep, whole and whole+offload-input, each with the MLP "
        "tiled): each chunk checkpointed in forward and recomputed alone in backward, so no sequence-long "
        "intermediate exists, for one more forward of the MLP; only a child of a position-wise class (*MLP, "
        "*FeedForward, T5's DenseActDense) with no active dropout, its output checked on the profiled batch "
        "(docs/long_context.md)")})
    host_memory: int | str | None = field(default=None, metadata={"group": "target", "help": (
        "the host memory offloading may use ('256GB'); unset (None): for a fake profile for a named gpu, one GPU's "
        "share of a typical node with it (core/hardware.py GPUS), otherwise this machine's free memory")})

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", normalize_candidates(self.candidates))
        object.__setattr__(self, "policies", check_policies(self.policies))
        check_int("warmup", self.warmup, 0, MAX_WARMUP, " (unmeasured steps before profiling)")
        if not self.fake and (self.gpu is not None or self.dtype is not None or self.precision is not None):
            raise ValueError("gpu=, dtype= and precision= apply to fake profiles (fake=True); a real profile times "
                             "the real step")
        if self.precision is not None:
            object.__setattr__(self, "precision", Precision.check(self.precision))
            if self.dtype is not None:
                raise ValueError("give precision= or dtype=, not both (dtype=torch.bfloat16 is precision='bf16-true')")
        object.__setattr__(self, "device", check_device(self.device))
        check_device_memory(self.device_memory)
        if self.host_memory is not None and Budget.parse(self.host_memory).nbytes is None:
            raise ValueError(f"host_memory must be a size ('256GB') or a number of bytes, got {self.host_memory!r}")
        check_int("accumulation_steps", self.accumulation_steps, 1, MAX_STEPS, " (micro-batches per optimizer step)")
        size = self.world_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_WORLD_SIZE:
            raise ShardingError(f"world_size must be an int >= 1 and <= {MAX_WORLD_SIZE} (the number of GPUs the step "
                                f"is sharded over), got {size!r}")
        if size > 1 and not self.fake:
            raise ShardingError(
                f"world_size={size} needs fake=True: a single process cannot run a real step sharded over {size} GPUs",
                "Pass fake=True (the step is sharded with fully_shard over a fake process group in this process), "
                "or plan inside the real sharded run (torchrun, one process per GPU) with world_size=1")


@dataclass(frozen=True)
class RematConfig:
    """A budget, what recomputation costs, and how to profile: one request for a plan.

    Example:
        >>> RematConfig("1GB", cost="seconds")
        Traceback (most recent call last):
        ...
        ValueError: cost must be one of ('time', 'flops', 'roofline'), got 'seconds'
    """

    budget: Any = field(metadata={"help": (
        "peak memory of a whole training step on the device (parameters, gradients, optimizer state, "
        "activations, temporaries): '10GB', '10 GiB', '512MiB', a number of bytes, '80%' of the device's total "
        "memory (the host's RAM on a CPU), or 'min' for the plan of least peak")})
    cost: CostKind | None = field(default=DEFAULT_COST, metadata={"choices": CostKind.values(), "help": (
        "what recomputation costs, which the plan minimises: flops (counted FLOPs: the same plan on every run, "
        "also on fake tensors), time (measured forward seconds) or roofline (per recomputed op, max(FLOPs / "
        "peak, bytes / bandwidth) for the target device); unset (None), the target's: roofline with the GPU's "
        "own figures for a CUDA model or a fake profile for a named gpu (a GPU in core/hardware.py), flops on the "
        "CPU and on a GPU the table does not know (the plan's notes say which)")})
    profile: ProfileOptions = field(default_factory=ProfileOptions, metadata={"help": (
        "how the step is profiled (ProfileOptions)")})

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", Budget.parse(self.budget))
        if self.cost is not None:
            object.__setattr__(self, "cost", CostKind.check(self.cost))
        if self.profile.fake and self.cost == "time" and self.profile.gpu is None:
            raise ValueError("a fake profile has no timings: pass cost='flops', or gpu= to price FLOPs in seconds")

    def for_target(self, device_type: str, gpu: str | None = None, name: str | None = None
                   ) -> tuple["RematConfig", str | None]:
        """This config with ``cost`` set for the target where unset, and a note (None where the cost was given,
        or on a CPU). ``gpu``: the target's key in ``core.hardware.GPUS`` (None: not in it); ``name``: the device's.

        Example:
            >>> config, note = RematConfig("1GB").for_target("cuda", "h100")
            >>> config.cost.value, note.split(":")[0]
            ('roofline', "cost 'roofline', the default for a GPU")
            >>> config, note = RematConfig("1GB").for_target("cpu")
            >>> config.cost.value, note, RematConfig("1GB", cost="time").for_target("cuda", "h100")[0].cost.value
            ('flops', None, 'time')
        """
        if self.cost is not None:
            return self, None
        if gpu is not None:
            spec = hardware.gpu(gpu)
            return replace(self, cost=CostKind.ROOFLINE.value), (
                f"cost 'roofline', the default for a GPU: recompute priced per op as max(FLOPs / peak, bytes / "
                f"bandwidth) at the {spec.name}'s {spec.flops() / 1e12:.0f} TFLOP/s and "
                f"{spec.memory_bandwidth / 1e12:.2f} TB/s (cost='flops': counted FLOPs)")
        flops = replace(self, cost=CostKind.FLOPS.value)
        if device_type != "cuda":
            return flops, None
        return flops, (f"cost 'flops', the default for a GPU not in core/hardware.py ({name or 'none named'}): "
                       "counted FLOPs; cost='roofline' prices it as an H100")

    def budget_bytes(self, device: Any = None) -> int | str:
        """The budget in bytes for the device planned for (``profile.device``, else ``device``), or ``"min"``."""
        return self.budget.resolve(device=self.profile.device or device, total_memory=self.profile.device_memory)

    def require_size(self, purpose: str) -> None:
        """Refuse ``"min"`` where only a size has a meaning (``purpose`` says where)."""
        if self.budget.is_min:
            raise ValueError(f'budget="min" has no meaning for {purpose}: give a size such as "10GB", '
                             'a number of bytes or a percentage such as "80%"')


def _with_attributes(cls: type) -> str:
    """``cls``'s docstring with an ``Attributes:`` section made from its fields' help, before its example."""
    lines = ["    Attributes:"]
    for f in fields(cls):
        default = "" if f.default is MISSING else f" Default: {f.default!r}."
        lines += textwrap.wrap(f"{f.name}: {f.metadata['help']}.{default}", width=100, initial_indent=" " * 8,
                               subsequent_indent=" " * 12, break_on_hyphens=False)
    doc = cls.__doc__ or ""
    head, example, tail = doc.partition("    Example:")
    return head.rstrip() + "\n\n" + "\n".join(lines) + "\n\n" + example + tail


ProfileOptions.__doc__ = _with_attributes(ProfileOptions)
RematConfig.__doc__ = _with_attributes(RematConfig)


def _same(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def profile_options(options: ProfileOptions | None = None, **keywords: Any) -> ProfileOptions:
    """``options``, or one made from ``keywords``; both is a ``ConflictingArgumentsError``."""
    if options is None:
        return ProfileOptions(**keywords)
    if not isinstance(options, ProfileOptions):
        raise TypeError(f"options must be a ProfileOptions, got {type(options).__name__}")
    defaults = {f.name: f.default for f in fields(ProfileOptions)}
    given = ", ".join(f"{name}={value!r}" for name, value in keywords.items() if not _same(value, defaults[name]))
    if given:
        raise ConflictingArgumentsError(
            f"profile settings given both as keywords ({given}) and as options=ProfileOptions(...): put them in one "
            f"place, e.g. options=dataclasses.replace(options, {given})")
    return options
