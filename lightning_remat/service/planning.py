"""The planning service: every entry point decides, falls back and shares a plan through ``Planner``."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..core.config import DEFAULT_COST, ProfileOptions, RematConfig
from ..core.binding import Binding
from ..core.budget import Budget, format_bytes
from ..core.errors import BudgetTooSmallError, UnsupportedShardingError
from ..core.offload_model import to_host
from ..core.plan import Plan
from ..core.profile_algebra import merge_profiles
from ..core.solve import solve_recompute_everything, solve_sharded
from ..runtime.profiling.candidates import CandidateSpec, find_stages
from ..runtime.installing.compiled import is_data_parallel
from ..runtime.installing.fingerprint import bound
from ..runtime.measuring.exclusive import exclusive
from ..runtime.measuring.measure import Step, is_out_of_memory, model_device, release_device_memory
from ..runtime.measuring.roofline import target_gpu
from ..runtime.profiling import profile as profiling
from .channel import Channel, torch_distributed_channel

FSDP1_HINT = ("Use FSDP2 instead (torch.distributed.fsdp.fully_shard; in Lightning ModelParallelStrategy with "
              "fully_shard in configure_model; in Accelerate FullyShardedDataParallelPlugin(fsdp_version=2)), "
              "or call plan_remat and apply_plan on the model before it is wrapped, on every rank.")
# Said with every plan priced in measured seconds: its overhead moves from run to run on a busy machine.
MEASURED_TIME_NOTE = ("cost 'time': the overhead is in seconds measured on this machine, which vary from run to run "
                      "when it is busy (so may the plan); cost='flops' (counted, the same on every run; the CPU's "
                      "default) or cost='roofline' give figures that do not move")


def fsdp2_sharded(model: nn.Module) -> bool:
    """Whether ``model`` or one of its modules is sharded with FSDP2's ``fully_shard``.

    >>> fsdp2_sharded(nn.Linear(2, 2))
    False
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def refuse_fsdp1(model: nn.Module, where: str) -> None:
    """Raise ``UnsupportedShardingError`` if ``model`` is wrapped by FSDP1."""
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        raise UnsupportedShardingError(f"{where}: the model is wrapped by FSDP1 (FullyShardedDataParallel), whose "
                                       "flat parameters and forward cannot be profiled or wrapped. " + FSDP1_HINT)


def _warn_if_beyond_the_device(budget: int | str, device: torch.device) -> None:
    if not isinstance(budget, int) or device.type != "cuda" or not torch.cuda.is_available():
        return
    free, _ = torch.cuda.mem_get_info(device)
    available = int(free) + int(torch.cuda.memory_reserved(device))
    if budget > available:
        warnings.warn(f"lightning-remat: the budget ({format_bytes(budget)}) is above what {device} has available to "
                      f"this process ({format_bytes(available)}: free memory and this process's cache): the device "
                      "would run out before the budget binds. Lower the budget.", UserWarning, stacklevel=3)


def _refuse_beyond_device_memory(plan: Plan, device_memory: Any, profile: Any) -> None:
    total = Budget.parse(device_memory).nbytes if device_memory is not None else None
    peak = plan.predicted_peak_bytes
    if total is None or peak is None or peak <= total:
        return
    raise BudgetTooSmallError(total, peak, profile.static_bytes, message=(
        f"No recompute plan fits the target device's memory, device_memory={device_memory!r} ({total} bytes): the "
        f"least peak is {format_bytes(peak)} ({peak} bytes), of which {format_bytes(profile.static_bytes)} is "
        "parameters, gradients and optimizer state. Give the device's real memory, or reduce the batch size."
        # What binds, as a plan says it: what a shorter sequence or another option would have to lower.
        + (f" At the least peak, {Binding.from_dict(plan.binding).text()}." if plan.binding else "")))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def resolve_cost(config: RematConfig, model: nn.Module) -> tuple[RematConfig, str | None]:
    """``config`` with an unset cost set for ``model``'s target (``RematConfig.for_target``), and the note saying so.

    >>> config, note = resolve_cost(RematConfig("min", profile=ProfileOptions(fake=True, gpu="h100")), nn.Linear(2, 2))
    >>> config.cost.value, resolve_cost(RematConfig("min"), nn.Linear(2, 2))[0].cost.value
    ('roofline', 'flops')
    """
    if config.cost is not None:  # given: no target to look at (a search may not hold a model yet)
        return config, None
    options = config.profile
    return config.for_target(*target_gpu(options.device or model_device(model), options.gpu if options.fake else None))


class Planner:
    """Decide plans for one ``RematConfig``: profile, solve, fall back, share between ranks."""

    def __init__(self, config: RematConfig, verbose: bool = True):
        self.config = config
        self.verbose = verbose
        self.cost_note: str | None = None  # why the cost is what it is, where the target chose it

    def for_model(self, model: nn.Module) -> RematConfig:
        """The config, its cost resolved for ``model``'s target the first time (``resolve_cost``)."""
        if self.config.cost is None:
            self.config, self.cost_note = resolve_cost(self.config, model)
        return self.config

    @exclusive()
    def decide(self, model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None = None, *,
               adjust: Callable[[Any], Any] | None = None, warmup: int | None = None) -> Plan:
        """Profile ``step`` and solve within the budget (``adjust`` may correct the profile first)."""
        return self.solve_or_advise(model, step, optimizer, self.profile(model, step, optimizer, adjust=adjust,
                                                                         warmup=warmup))

    def solve_or_advise(self, model: nn.Module, step: Step, optimizer: Any, profile: Any) -> Plan:
        """``solve_profile``; when no plan fits, a ``BudgetTooSmallError`` with the knobs that would."""
        try:
            return self.solve_profile(model, profile)
        except BudgetTooSmallError as error:
            failed = error
        from .knobs import KnobContext, knob_figures

        # The bytes the plan did not fit: the error's (a "min" budget refused for the target's memory has no other).
        context = KnobContext(self, model, step, optimizer, profile, int(failed.budget_bytes))
        raise failed.with_knobs(knob_figures(context))

    def profile(self, model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None = None, *,
                adjust: Callable[[Any], Any] | None = None, warmup: int | None = None) -> Any:
        """The profile ``decide`` solves on (``adjust`` applied)."""
        options = self.config.profile if warmup is None else replace(self.config.profile, warmup=warmup)
        with self.progress(model, options.fake):
            profile = profiling.profile_step(model, step, optimizer=optimizer, options=options)
        if model_device(model).type != "cpu":
            # The unrecomputed pass filled the caching allocator up to the baseline peak: handed back for training.
            release_device_memory()
        return adjust(profile) if adjust is not None else profile

    def progress(self, model: nn.Module, fake: bool) -> Any:
        """The progress display of one profile (rank 0, on a terminal, unless ``verbose=False``)."""
        from ..report.render import PhaseProgress

        display = PhaseProgress(enabled=self.verbose and torch_distributed_channel().is_main)
        display(f"lightning-remat: profiling a training step of {type(model).__name__}" + (" on fake tensors" if fake else ""))
        return display

    def solve_profile(self, model: nn.Module, profile: Any) -> Plan:
        """The least-cost plan within the budget for ``profile``."""
        self.for_model(model)
        budget = self.config.budget_bytes(model_device(model))
        _warn_if_beyond_the_device(budget, model_device(model))
        if any(to_host(o) for s in profile.stages for o in s.options):
            # Host memory is a limit too: never plan more offloaded bytes than the host has free.
            from ..core.offload_model import solve_within_host
            from ..runtime.targets.offload_link import host_limit_bytes

            plan = solve_within_host(profile, host_limit_bytes(self.config.profile),
                                     lambda p: solve_sharded(p, budget, self.config.cost))
        else:
            plan = solve_sharded(profile, budget, self.config.cost)
        notes = plan.notes + ((self.cost_note,) if self.cost_note else ())
        if self.config.cost == "time" and not self.config.profile.fake:
            notes += (MEASURED_TIME_NOTE,)
        options = self.config.profile
        if self.config.cost == "roofline" and options.fake and options.gpu is None:
            # Only here does naming the GPU change the plan: 'flops' is priced the same for every GPU.
            notes += (f"cost 'roofline' on fake tensors without a GPU named prices every op with the nominal "
                      f"ceilings of device '{options.device or 'cpu'}' (for 'cuda': this machine's GPU, else an "
                      "H100); pass gpu= (h100, a100, ...) to price it for the GPU that will train",)
        _refuse_beyond_device_memory(plan, self.config.profile.device_memory, profile)
        return bound(replace(plan, requested_budget=self.config.budget.text, notes=notes), model)

    def decide_or_fall_back(self, model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None = None,
                            **kwargs: Any) -> Plan:
        """``decide``, or on an out-of-memory error while profiling, ``fallback_plan``."""
        try:
            return self.decide(model, step, optimizer, **kwargs)
        except Exception as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
            if not is_out_of_memory(error):
                raise
            reason = f"{type(error).__name__}: {_first_line(error)}"
        # Outside the except block: the traceback no longer pins the failed step's tensors.
        return self.fallback_plan(model, reason)

    def fallback_plan(self, model: nn.Module, reason: str, cause: str = "out of memory while profiling") -> Plan:
        """Every candidate block recomputed whole: the plan most likely to fit when none could be profiled."""
        model.zero_grad(set_to_none=True)
        release_device_memory()
        self.for_model(model)
        stages = find_stages(model, self.config.profile.candidates)
        note = f"fallback: {cause} ({reason}); every candidate block recomputed whole"
        budget = self.config.budget_bytes(model_device(model))
        checked = (f"whether the budget of {budget} bytes holds is known only from the measured peak of a later step"
                   if isinstance(budget, int) else "budget 'min' (the least peak) needs a profile to be found")
        warnings.warn(f"lightning-remat: {cause} ({reason}). Installed the fallback plan: every "
                      f"candidate block recomputed whole ({len(stages)} module(s)). Without a profile no peak is "
                      f"predicted: {checked}.", UserWarning, stacklevel=3)
        return bound(solve_recompute_everything(stages, budget, self.config.cost, self.config.budget.text, note), model)

    @exclusive()
    def shared_plan(self, model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None = None, *,
                    channel: Channel | None = None, hint: str = "", fallback: bool = True,
                    lockstep: bool | None = None, **kwargs: Any) -> Plan:
        """Rank 0 of ``channel`` decides; every rank gets its plan or its error (``hint`` added to ours).

        ``lockstep`` (default: an FSDP2 model on several ranks): every rank profiles, rank 0 solves on the maxima.
        """
        if channel is None:
            channel = Channel()
        if lockstep is None:
            lockstep = channel.distributed and fsdp2_sharded(model)
        if lockstep:
            return self.lockstep_plan(model, step, optimizer, channel=channel, hint=hint, fallback=fallback, **kwargs)
        decide = self.decide_or_fall_back if fallback else self.decide
        return Plan.from_dict(channel.from_main(lambda: decide(model, step, optimizer, **kwargs).to_dict(),
                                                action="planning", hint=hint))

    def lockstep_plan(self, model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None, *,
                      channel: Channel, hint: str = "", fallback: bool = True, **kwargs: Any) -> Plan:
        """Profile on every rank, solve on rank 0 over the termwise maximum, return its plan (or error) on all; with
        ``fallback``, an out-of-memory error on some rank gives every rank the recompute-everything plan.

        >>> planner = Planner(RematConfig("min", profile=ProfileOptions(fake=True)))
        >>> planner.lockstep_plan(nn.Linear(2, 2), lambda m: m(torch.ones(1, 2)).sum(), None, channel=Channel())
        Traceback (most recent call last):
        ...
        lightning_remat.core.errors.UnsupportedShardingError: fake profiling of a model already sharded across processes is not supported: ...
        """
        if self.config.profile.fake:
            # Decided alike on every rank, before any collective.
            raise UnsupportedShardingError(
                "fake profiling of a model already sharded across processes is not supported: profile it for real "
                "(fake=False), or plan the unsharded model in one process with fake=True and world_size=N "
                "(docs/sharded.md)")
        _, results = channel.outcomes(lambda: self.profile(model, step, optimizer, **kwargs), action="profiling")

        def decide() -> dict:
            failed = next((error for _, error in results if error is not None), None)  # the first rank's
            # ``travelling`` marks an out-of-memory error of a rank.
            if failed is not None and fallback and any(getattr(error, "out_of_memory", False) for _, error in results):
                return self.fallback_plan(model, str(failed)).to_dict()
            if failed is not None:
                raise failed
            return self.solve_profile(model, merge_profiles([profile for profile, _ in results])).to_dict()

        return Plan.from_dict(channel.from_main(decide, action="planning", hint=hint))


def plan_remat(model: nn.Module, step: Callable[[nn.Module], torch.Tensor], budget: int | str, *,
               optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
               cost: str | None = DEFAULT_COST,
               candidates: CandidateSpec = None, warmup: int = 1, fake: bool = False,
               dtype: torch.dtype | None = None, device: str | torch.device | None = None, gpu: str | None = None,
               device_memory: int | str | None = None, precision: str | None = None,
               accumulation_steps: int = 1, world_size: int = 1, policies: Any = (), offload: bool = False,
               repeated_blocks: bool = True, chunk_loss: bool = False, host_memory: int | str | None = None,
               tile_mlp: bool = False, verbose: bool = True) -> Plan:
    """Profile one training step and return the least-cost recompute plan within ``budget``.

    Every argument: ``ProfileOptions``/``RematConfig`` and ``docs/api.md``; the main ones:

    Args:
        step: ``step(model)`` returns the loss of a forward pass on a representative batch.
        budget: "10GB", bytes, "80%" of the device, or "min".
        optimizer: counted in the budget (state and step); a list for manual optimization.
        cost: ``"flops"``, ``"time"`` or ``"roofline"``; None: the target's (``RematConfig.for_target``).
        fake, dtype, device, gpu: plan without the hardware: fake tensors for ``device``, priced at ``gpu``'s speed.

    ``model`` may be wrapped in DDP, ``torch.compile`` or Fabric's wrapper. Under ``torch.distributed`` every
    rank returns rank 0's plan or error; an FSDP2 model is profiled on every rank (call it on each).

    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)])
    >>> x = torch.randn(256, 64)
    >>> plan = plan_remat(net, lambda m: m(x).square().mean(), "min", cost="flops")
    >>> plan.predicted_peak_bytes < plan.baseline_peak_bytes
    True
    """
    config = RematConfig(budget, cost=cost, profile=ProfileOptions(
        candidates=candidates, fake=fake, dtype=dtype, device=device, gpu=gpu, device_memory=device_memory,
        warmup=warmup, precision=precision, accumulation_steps=accumulation_steps,
        gradient_buckets=is_data_parallel(model), world_size=world_size, policies=policies, offload=offload,
        repeated_blocks=repeated_blocks, chunk_loss=chunk_loss, host_memory=host_memory, tile_mlp=tile_mlp))
    config.budget_bytes(model_device(model))  # a budget above the device's memory fails before profiling
    refuse_fsdp1(model, "plan_remat")
    # A model sharded with FSDP2 runs collectives in every pass: every rank profiles (shared_plan).
    return Planner(config, verbose=verbose).shared_plan(model, step, optimizer, channel=torch_distributed_channel(),
                                                        fallback=False)
