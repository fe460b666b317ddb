"""Profile one training step in the terms of the memory model (``core.memory_model``).

What is measured, and how:

- A plain step is observed first (``observe.observe_step``): the stages' execution order, per
  module time, FLOPs and bytes saved for backward.
- Memory, with torch's ``MemTracker`` around forward and backward, once per option: nothing
  recomputed (``"keep"``), every stage recomputed (``"whole"``), and each heavy child recomputed in
  every stage (``"attn"``, ``"mlp"``, ...), and each selective-checkpointing policy on every
  stage where it differs from the other options (``"sac:save_matmuls"``, ...: ``sac.py``). A
  stage's stored bytes are what its forward leaves allocated; its local peak is the peak during
  its forward or backward less what the stages before it store. The gaps between stages (embeddings, head, loss) are segments. Because each
  term is measured under the option it describes, the model reproduces every measured run exactly.
- The optimizer step, under ``FakeTensorMode`` on fake copies (``optimizer_step``): its
  temporaries and the state it creates are counted without allocating them.

Gradients, buffers (BatchNorm statistics), RNG states and optimizer state are put back afterwards,
so profiling does not change training.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ...core.allowances import DDP_REDUCER_ALLOWANCE
from ...core.budget import format_bytes
from ...core.config import PRECISIONS, ProfileOptions, profile_options
from ...core.errors import AlreadyCheckpointedError, RematError, StepError
from ...core.memory_model import Profile, Segment, StageOption, StageProfile, predict_peak
from ...core.offload_model import OFFLOAD, OFFLOAD_HIDDEN, is_offload
from ..installing.apply import applied, existing_checkpointing
from .candidates import CandidateSpec, find_stages
from ..installing.compiled import fabric_forward_context, uncompiled
from ..targets.fake_attention import cuda_attention
from ..targets.fake import (GPU_EFFICIENCY, clone_optimizer, existing_fake_mode, explain_fake_failures, fake_model,
                   gpu_peak_flops, is_fake, new_fake_mode, real_code_paths)
from ..installing.offload import Offloader, apply_offload, model_offloader, remove_offload
from ..targets.offload_link import check_offload_target, hidden_limits, price_offload
from .held_inputs import DeadInputs, HeldInputs
from ..measuring.measure import RandomState, Step, model_device, preserved_training_state
from ..measuring.optimizers import as_optimizers, map_optimizers
from ..measuring.meter import PeakMeter
from ..measuring.observe import ModuleStats, ObservedStep, observe_step
from ..measuring.runner import run_step
from .optimizer_step import optimizer_step_cost
from ..installing import sac
from ..measuring.roofline import Peaks, device_peaks, option_costs, roofline_seconds, sac_seconds_per_op
from ..installing.segments import chained_groups, sequential_groups
from .profile_adjust import with_always_alive, with_pooled_timings, with_unobserved, with_untracked
from .repeated import repeated_profile
from ..targets.sharded import sharded_twin, sharding_info, sharding_note
from ..measuring.stance import eager_stance
from ..measuring.tracking import SegmentTracker, snapshot_by_category

# A child (itself a block, not a single layer) becomes an option of its stage when it saves at least this share of the stage's
# activation bytes (and is not almost all of it, which "whole" already covers).
MIN_CHILD_SHARE = 0.15
MAX_CHILD_SHARE = 0.9
MAX_CHILD_OPTIONS = 2
DDP_ALLOWANCE = DDP_REDUCER_ALLOWANCE  # the old name (core.allowances names every allowance)


@dataclass
class _MemoryRun:
    """One step measured with some modules recomputed, in the terms of the memory model."""

    stored: list[int]
    local: list[int]
    segments: dict[int, int]  # stages alive -> peak beyond their stored bytes
    peak: int
    gradient_bytes: int
    parameter_bytes: int
    buffer_bytes: int
    residual_bytes: int  # what the step still holds after backward (its loss, outputs), besides static memory
    untracked_bytes: int = 0  # on CUDA: the allocator's peak above MemTracker's (inputs made before, workspaces)
    host_bytes: dict[str, int] | None = None  # offloaded stages: bytes sent to the host


def _memory_run(model: nn.Module, step: Step, order: Sequence[str], calls: dict[int, int], wrapped: Sequence[str],
                optimizer: torch.optim.Optimizer | None, replay: Callable[[], None],
                gradients_alive: bool = False, policy: str = "", offloaded: Sequence[str] = (),
                offload_limits: dict[str, int] | None = None,
                dead: dict[str, set[str]] | None = None) -> _MemoryRun:
    # ``dead``: the arguments of each stage a kept stage frees early (held_inputs.py); a run with
    # nothing recomputed and ``dead`` empty fills it.
    modules = dict(model.named_modules())
    replay()
    if gradients_alive:
        # A later micro-batch of an accumulation window: every gradient exists from the start
        # (backward then accumulates into it).
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    device = model_device(model)
    tracker = SegmentTracker({id(modules[n]): i for i, n in enumerate(order)}, device, calls)
    meter = _SegmentMeter(model, optimizer, tracker)
    with applied(model, wrapped, policies={m: policy for m in wrapped} if policy else None), \
            _offloading(model, offloaded, offload_limits) as offloader, \
            HeldInputs(model, order, dead or {}, wrapped) as held, \
            DeadInputs(model, order if dead == {} and not wrapped and not offloaded else (), dead) as finder:

        def checked(model: nn.Module) -> torch.Tensor:
            loss = step(model)
            finder.check()
            return loss

        run_step(model, checked, watch=meter)
    after_backward = meter.after_backward
    n = len(order)
    missing = [order[i] for i in range(n) if i not in tracker.stored]
    if missing:
        raise RematError(f"stages {missing} ran in one pass over the profiled batch and not in another: the model's "
                         "control flow depends on something other than torch's random generators (which the profile "
                         "replays). Pass candidates= without these modules, or make their use reproducible.")
    stored = [tracker.stored[i] for i in range(n)]
    if offloaded:
        stored = _net_of_released(stored, tracker.forward_starts, calls)
    prefix = [0]
    for s in stored:
        prefix.append(prefix[-1] + s)
    if any(held.bytes):
        # A recomputed stage stores, besides what its forward leaves, the inputs its checkpoint
        # keeps alive that a kept stage would have freed (held_inputs.py): the model stays
        # additive. The later terms are taken net of the bytes only this stage holds.
        exclusive = held.exclusive
        prefix = [0]
        for i in range(n):
            prefix.append(prefix[-1] + stored[i] + exclusive[i])
        stored = [s + h for s, h in zip(stored, held.bytes)]
    # Not clamped at zero: a figure below what the stages before it store is real where they free
    # some of it later (FSDP2 reshards the unsharded parameters a stage's stored bytes count), and
    # the memory model stays exact with it (a clamp overstated 70B at 8 GPUs by tens of GiB).
    local: list[int | None] = [None] * n
    segments: dict[int, int] = {}
    for (kind, k), peak in tracker.segment_peaks.items():
        if kind in ("fw", "bw"):
            local[k] = peak - prefix[k] if local[k] is None else max(local[k], peak - prefix[k])
        else:
            segments[k] = max(segments.get(k, peak - prefix[k]), peak - prefix[k])
    now = snapshot_by_category(tracker.get_tracker_snapshot("current"), device)
    static_now = sum(now.get(k, 0) for k in ("Gradient", "Parameter", "Buffer", "Optstate"))
    model.zero_grad(set_to_none=True)
    peak = snapshot_by_category(tracker.get_tracker_snapshot("peak"), device).get("Total", 0)
    return _MemoryRun(
        # On CUDA the meter's peak is the allocator's, which also sees what the tracker does not (the
        # batch already on the device, library workspaces); elsewhere it is the tracker's own.
        stored=stored, local=[0 if v is None else v for v in local], segments=segments, peak=peak,
        untracked_bytes=max(0, meter.peak_bytes - int(peak)),
        gradient_bytes=now.get("Gradient", 0), parameter_bytes=now.get("Parameter", 0),
        buffer_bytes=now.get("Buffer", 0), residual_bytes=max(0, after_backward - static_now),
        host_bytes=dict(offloader.host_bytes) if offloader is not None else None,
    )


def _net_of_released(stored: list[int], starts: dict[int, int], calls: dict[int, int]) -> list[int]:
    """Stored bytes net of what the gap after each stage's forward released (offload runs).

    A stage's forward leaves its output allocated, and its input is released only after it returns
    (the caller drops it), in the gap before the next stage. Under "offload" the stage does not
    hold its input, so counting the output of every stage and never the release over-counts one
    hidden state per stage whenever the stage is not recomputed (a recomputed stage's checkpoint
    does hold its input: those runs are left as they are). The release belongs to the stage whose
    forward just ran, so the term stays additive. The last stage (no next forward) and stages
    called more than once are left as measured; nothing goes below zero.
    """
    if any(c > 1 for c in calls.values()) or len(starts) != len(stored):
        return stored
    net = list(stored)
    for i in range(len(stored) - 1):
        released = starts[i] + stored[i] - starts[i + 1]
        if released > 0:
            net[i] = max(0, stored[i] - released)
    return net


@contextlib.contextmanager
def _offloading(model: nn.Module, names: Sequence[str], limits: dict[str, int] | None) -> Iterator[Offloader | None]:
    """Offload ``names`` for one memory run: on fake tensors only metadata goes to the "host"
    (the meta device, which MemTracker does not count); tensors come back on demand (the
    prefetch is modelled in ``core.offload_model``)."""
    if not names:
        yield None
        return
    apply_offload(model, names, measure=any(is_fake(p) for p in model.parameters()), limits=limits)
    try:
        yield model_offloader(model)
    finally:
        remove_offload(model)


class _SegmentMeter(PeakMeter):
    """The peak meter of a memory run, over its ``SegmentTracker``; it also reads what the step
    holds right after backward (the loss and what it keeps, besides static memory)."""

    after_backward = 0

    def backward_done(self) -> None:
        self.after_backward = self.tracker.current_total()


def _child_options(stage: str, stats: dict[str, ModuleStats], modules: dict[str, nn.Module]) -> list[str]:
    total = sum(stats[stage].saved.values())
    if total <= 0:
        return []
    scored = []
    for child, module in modules[stage].named_children():
        if not any(True for _ in module.children()):
            continue  # a single layer stores its input under recomputation too: nothing to gain
        share = sum(stats[f"{stage}.{child}"].saved.values()) / total
        if MIN_CHILD_SHARE <= share <= MAX_CHILD_SHARE:
            scored.append((share, child))
    return [child for _, child in sorted(scored, reverse=True)[:MAX_CHILD_OPTIONS]]


def _span_groups(model: nn.Module, step: Step, order: Sequence[str], replay: Callable[[], None]) -> tuple:
    """Stages that may be recomputed together (``core.spans``): consecutive items of one Sequential
    that one forward really chains (checked on a forward without gradients)."""
    groups = sequential_groups(model, order)
    if not groups:
        return ()
    replay()
    return tuple(tuple(g) for g in chained_groups(model, step, groups))


def _use_cache_note(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    if model.training and getattr(config, "use_cache", False) and hasattr(config, "num_hidden_layers"):
        return ("use_cache=True: this transformers model returns every layer's key/value cache, which stays alive "
                "until the forward's outputs are released and which recomputation cannot free; set "
                "model.config.use_cache = False for training (Hugging Face's own checkpointing does)")
    return None


def profile_step(model: nn.Module, step: Callable[[nn.Module], torch.Tensor], *,
                 optimizer: torch.optim.Optimizer | None = None, warmup: int = 1,
                 candidates: CandidateSpec = None, fake: bool = False, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, gpu: str | None = None,
                 device_memory: int | str | None = None, precision: str | None = None, accumulation_steps: int = 1,
                 gradient_buckets: bool = False, world_size: int = 1, repeated_blocks: bool = True,
                 policies: Sequence[str] | None = (), offload: bool = False,
                 options: ProfileOptions | None = None) -> Profile:
    """Profile one training step of ``model`` for the solver.

    Args:
        model: the model, in the mode it trains in (``model.train()``).
        step: ``step(model)`` runs a forward pass on a batch and returns the scalar loss; the
            profiler runs backward itself. It is called several times on the same batch.
        optimizer: its state counts in the budget: the state it holds, or, before its first step,
            the state it will create (Adam: two tensors per parameter), and its step's temporaries.
            A list or tuple of optimizers (manual optimization): each one's state and step, stepped
            one after the other. Lightning's, Fabric's and Accelerate's wrappers are looked through.
        warmup: steps run first and not measured (lazy initialisation, allocator warm-up).
        candidates: as ``find_stages``: None for automatic, or module classes / name patterns.
        fake: profile on fake tensors (no memory is allocated, nothing real runs): for models
            larger than this machine and for devices that are not here. The model may be real (it
            is not changed), on the meta device, or built under a ``FakeTensorMode``; ``step``
            may make its inputs as real tensors. Byte counts are exact; costs are counted FLOPs.
        dtype: with ``fake``, the dtype floating-point parameters, gradients and optimizer state are
            kept in (``torch.bfloat16``: pure bf16; for mixed precision use ``options.precision``).
        device: the device the profile plans for (``"cuda"``); the default is the model's.
        gpu: with ``fake``, a GPU name (``"h100"``, ``"a100"``, ...: ``fake.GPU_PEAK_FLOPS``) whose
            throughput turns FLOPs into seconds; without it, a fake profile has FLOP costs only.
        device_memory, precision, accumulation_steps, gradient_buckets, world_size, repeated_blocks,
            policies, offload: as ``ProfileOptions`` (the one description of each).
        options: all of the above but ``optimizer`` as one ``ProfileOptions``. Give the settings
            either as keywords or as ``options``: a keyword set to anything but its default next to
            ``options`` is a ``ConflictingArgumentsError`` (a ``TypeError``), not ignored.

    Returns:
        A ``Profile``: per stage in execution order its options (stored bytes, local peak, recompute
        cost in seconds and FLOPs), its saved/input/output bytes and forward cost; the segments
        between stages; static bytes and the baseline peak of the step.

    A model compiled with ``torch.compile`` (or holding compiled submodules) is profiled as its
    original modules, and stage names are those of the uncompiled model (no ``_orig_mod.``).

    Raises:
        AlreadyCheckpointedError: the model uses Hugging Face or torch checkpointing already.
        NoCandidateError: the model has no candidate block.
        FakeProfileError: with ``fake``, the model's code needs real values; it names the op.
        ConflictingArgumentsError: keywords and ``options`` both given.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
        >>> x = torch.randn(32, 64)
        >>> profile = profile_step(net, lambda m: m(x).square().mean())
        >>> [s.name for s in profile.stages], [o.name for o in profile.stages[0].options]
        (['0', '1', '2', '3'], ['keep', 'whole'])
        >>> fake = profile_step(net, lambda m: m(x).square().mean(), fake=True, device="cuda", gpu="h100")
        >>> fake.device, fake.stages[0].options[1].stored_bytes == profile.stages[0].options[1].stored_bytes
        ('cuda', True)
    """
    options = profile_options(
        options, candidates=candidates, fake=fake, dtype=dtype, device=device, gpu=gpu, warmup=warmup,
        device_memory=device_memory, precision=precision, accumulation_steps=accumulation_steps,
        gradient_buckets=gradient_buckets, world_size=world_size, repeated_blocks=repeated_blocks, policies=policies,
        offload=offload)
    existing = existing_checkpointing(model)
    if existing:
        raise AlreadyCheckpointedError("Cannot plan recomputation: " + "; ".join(existing))
    if not options.fake and options.device is not None and torch.device(options.device) != model_device(model):
        raise ValueError(f"device={options.device!r} but the model is on {model_device(model)}: a real profile "
                         "measures the device the model is on; to plan for another device, profile on fake "
                         "tensors (fake=True)")
    if options.offload:
        check_offload_target(options, model_device(model))
    optimizer = as_optimizers(optimizer)
    step = _in_forward_context(step, fabric_forward_context(model))
    # A compiled model (or compiled submodules) is profiled as its original modules: hooks must fire;
    # and eagerly, since dynamo would never compile code it first met under our dispatch modes.
    with eager_stance(), uncompiled(model) as model:
        if not options.fake:
            return _profile(model, step, optimizer, options, timed=True)
        return _fake_profile(model, step, optimizer, options)


def _in_forward_context(step: Step, context: contextlib.AbstractContextManager) -> Step:
    """``step`` inside the forward context of the wrapper profiling looks through (Fabric's precision)."""
    if isinstance(context, contextlib.nullcontext):
        return step

    def step_in_context(model: nn.Module) -> torch.Tensor:
        with context:
            return step(model)
    return step_in_context


def _precision(options: ProfileOptions) -> tuple[torch.dtype | None, torch.dtype | None, str]:
    """(dtype of parameters, gradients and state; autocast dtype or None; the note that says so)."""
    if options.precision is not None:
        storage, autocast = (getattr(torch, name) if name else None for name in PRECISIONS[options.precision])
        held = f"parameters, gradients and optimizer state in {str(storage).replace('torch.', '')}"
        computed = f", the step under {str(autocast).replace('torch.', '')} autocast" if autocast else ""
        return storage, autocast, f"precision {options.precision}: {held}{computed}"
    dtype = getattr(torch, options.dtype) if isinstance(options.dtype, str) else options.dtype
    if dtype is None:
        return None, None, "precision: as the model's parameters, no autocast"
    name = str(dtype).replace("torch.", "")
    return dtype, None, (f"precision: parameters, gradients and optimizer state in {name}, no autocast (pure "
                         f"{name}); mixed-precision training keeps them in float32: pass precision='bf16-mixed'")


def _fake_profile(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None,
                  options: ProfileOptions) -> Profile:
    """``_profile`` on a fake twin of the model (and optimizer), costs priced from FLOPs."""
    seconds_per_flop = 1.0 / (gpu_peak_flops(options.gpu) * GPU_EFFICIENCY) if options.gpu is not None else 0.0
    dtype, autocast, precision_note = _precision(options)
    sharded = options.world_size > 1  # sharded: mixed precision is FSDP2's policy, not autocast
    if autocast is not None and not sharded:
        step = _under_autocast(step, autocast)
    mode = existing_fake_mode(model) or new_fake_mode()
    # Planned for a GPU (named, or device="cuda"): attention with dropout as its fused kernels run it.
    targets_cuda = options.gpu is not None or torch.device(options.device or "cpu").type == "cuda"
    names = {id(p): name for name, p in model.named_parameters()}
    model = fake_model(model, mode, dtype)
    fake_params = dict(model.named_parameters())
    optimizer = map_optimizers(optimizer, lambda o: clone_optimizer(o, {i: fake_params[n] for i, n in names.items()},
                                                                    mode))

    def run(model: nn.Module, optimizer: torch.optim.Optimizer | None, wrap: Callable | None = None) -> Profile:
        # Sharded: each model profiled (the whole one, or a truncated copy) gets a twin of its own
        # sharded over a fake process group, and an optimizer over the twin's sharded parameters.
        with sharded_twin(model, options.world_size, options.candidates, mode, autocast) as (twin, _):
            if sharded and optimizer is not None:
                by_name = dict(twin.named_parameters())
                optimizer = map_optimizers(optimizer, lambda o: _sharded_clone(o, model, by_name, mode))
            with mode, explain_fake_failures(), real_code_paths(), cuda_attention(targets_cuda):
                # No warm-up and no timing: fake tensors have no caches to warm and no time to measure.
                return _profile(twin, wrap(step) if wrap else step, optimizer,
                                replace(options, warmup=0, device=options.device or "cpu"), timed=False)

    # N identical layers: profiled at 4 and 5 layers (runtime/profiling/repeated.py) and extrapolated
    # (core/depth_fit.py), sharded or not (each truncated copy gets a sharded twin of its own).
    repeated = repeated_profile(model, optimizer, options, run)
    profile = repeated or run(model, optimizer)
    if sharded:
        profile.sharding = sharding_info(model, options.world_size, options.candidates, autocast)
        precision_note = sharding_note(profile.sharding)
    # Nothing real ran, so wall-clock times mean nothing: costs come from FLOPs.
    profile.stages = tuple(
        replace(stage, forward_seconds=stage.forward_flops * seconds_per_flop,
                options=tuple(replace(o, cost_seconds=o.cost_flops * seconds_per_flop) for o in stage.options))
        for stage in profile.stages)
    profile.baseline_step_seconds = profile.baseline_step_flops * seconds_per_flop
    if options.offload:
        profile = price_offload(profile, options, options.device or "cuda")
    profile.notes = (*profile.notes, precision_note)
    if options.gpu is None:
        profile.notes = (*profile.notes, "fake profile without a GPU named: costs are FLOPs only (use cost='flops')")
    return profile


def _sharded_clone(optimizer: torch.optim.Optimizer, model: nn.Module, by_name: dict, mode: Any) -> torch.optim.Optimizer:
    clone = clone_optimizer(optimizer, {id(p): by_name[n] for n, p in model.named_parameters()}, mode)
    clone.state.clear()  # state of the unsharded parameters: the sharded state is counted ahead
    return clone


def _under_autocast(step: Step, dtype: torch.dtype) -> Step:
    # Fake tensors live on the CPU, so the CPU's autocast stands in for the target's: both run
    # matmuls, linears and convolutions (what activations are mostly made of) in ``dtype``.
    def autocast_step(model: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return step(model)
    return autocast_step


def _option_wraps(order: Sequence[str], observed: ObservedStep, modules: dict[str, nn.Module],
                  policies: Sequence[str] = ()) -> dict[str, dict[str, tuple]]:
    """Per option name, the modules each stage recomputes under it (stages without the option absent)."""
    children = {name: _child_options(name, observed.stats, modules) for name in order}
    wraps: dict[str, dict[str, tuple]] = {"keep": {n: () for n in order}, "whole": {n: (n,) for n in order}}
    for child in sorted({c for cs in children.values() for c in cs}):
        wraps[child] = {n: (f"{n}.{child}",) for n in order if child in children[n]}
    # A policy is an option of the stages where it differs from keep, whole and the other policies.
    offered = {n: sac.distinct_policies(policies, [op.func for op in observed.stats[n].ops]) for n in order}
    for policy in policies:
        stages = {n: (n,) for n in order if policy in offered[n]}
        if stages:
            wraps[sac.option_name(policy)] = stages
    return wraps


def _profile(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None, options: ProfileOptions,
             timed: bool) -> Profile:
    stage_names = find_stages(model, options.candidates)
    modules = dict(model.named_modules())
    # applied(model, []) lifts any plan the model has for the profile and puts it back after.
    with preserved_training_state(model, optimizer), applied(model, []):
        model.zero_grad(set_to_none=True)
        for _ in range(options.warmup):
            run_step(model, step, zero_grad="after", check=True)
        # Every pass takes the random decisions of the first (dropout masks, dropped layers).
        replay = RandomState.capture(model_device(model)).restore
        observed = observe_step(model, step, stage_names, timed, before_pass=replay)
        if not observed.order:
            raise StepError(f"none of the candidate stages {stage_names[:4]}... ran during step(model)")
        policies = sac.POLICIES if options.policies is None else tuple(sac.check_policy(p) for p in options.policies)
        wraps = _option_wraps(observed.order, observed, modules, policies)
        limits: dict[str, int] = {}
        if options.offload:
            wraps[OFFLOAD] = {n: () for n in observed.order}
            limits = hidden_limits(observed, options, str(options.device or model_device(model)), timed)
            if limits:
                wraps[OFFLOAD_HIDDEN] = {n: () for n in limits}
        span_groups = _span_groups(model, step, observed.order, replay)
        dead: dict[str, set[str]] = {}  # filled by the run with nothing recomputed ("keep", the first)
        with warnings.catch_warnings():
            # MemTracker warns when a module's backward hook outlives the module's outputs.
            warnings.simplefilter("ignore")
            calls = {i: observed.stats[n].calls for i, n in enumerate(observed.order)}
            runs, dropped = {}, []
            for name, wrap in list(wraps.items()):
                try:
                    runs[name] = _memory_run(model, step, observed.order, calls, [m for ms in wrap.values() for m in ms],
                                             optimizer, replay, gradients_alive=options.accumulation_steps > 1,
                                             policy=sac.policy_of(name),
                                             offloaded=list(wrap) if is_offload(name) else (),
                                             offload_limits=limits if name == OFFLOAD_HIDDEN else None,
                                             dead=dead)
                except RuntimeError as err:
                    # Selective checkpointing needs the recompute to run the forward's ops again,
                    # which a forward that mutates state it reads (a key/value cache) does not.
                    if not sac.policy_of(name):
                        raise
                    model.zero_grad(set_to_none=True)
                    del wraps[name]
                    dropped.append(f"{name} ({str(err).splitlines()[0][:120]})")
        device = options.device or str(model_device(model))
        step_cost = optimizer_step_cost(optimizer, device)
    # State that does not exist yet will exist during every later step.
    future_state = step_cost.created_state_bytes
    peaks = device_peaks(device, options.gpu)
    # Eager selective checkpointing costs time per op beyond the recomputed ops (measured here).
    per_op = sac_seconds_per_op() if timed and any(sac.policy_of(n) for n in wraps) else 0.0
    profile = _assemble(model, observed, wraps, runs, step_cost.state_bytes, step_cost.step_peak_bytes, future_state,
                        optimizer is not None, device, peaks, per_op, limits)
    assembled = profile
    profile.span_groups = span_groups
    if timed:
        profile = with_pooled_timings(profile)
    profile = with_untracked(profile, runs["keep"].untracked_bytes)
    if dropped:
        profile.notes = (*profile.notes, "selective-checkpointing option(s) dropped, their recompute did not replay "
                         "the forward: " + "; ".join(dropped))
    if options.accumulation_steps > 1:
        profile.notes = (*profile.notes, f"gradient accumulation over {options.accumulation_steps} micro-batches: "
                         "profiled as a later micro-batch, with every gradient alive from its start")
    if options.gradient_buckets:
        # One copy of the trainable gradients, and an allowance for the reducer's small bookkeeping
        # tensors (core.allowances).
        buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) + DDP_REDUCER_ALLOWANCE
        profile = with_always_alive(profile, buckets, f"DDP's gradient buckets, {format_bytes(buckets)} (one copy of "
                                     "the gradients), alive through the whole step; counted in every term")
    profile = with_unobserved(profile, stage_names, modules)
    profile = price_offload(profile, options, device) if timed and options.offload else profile
    profile.gap_figures = gap_figures(assembled, profile, runs, future_state)
    return profile


def gap_figures(assembled: Profile, final: Profile, runs: dict[str, _MemoryRun],
                future_state: int) -> dict[str, dict[str, int]] | None:
    """Each gap's figure in each memory run (its segment's peak is the largest of them), with what
    the adjustments after ``_assemble`` added to the segment (the same bytes to every run's figure).

    Not a field of ``Profile`` (nothing plans with it; an attribute of the profile as made, lost by
    ``replace``): the 4/5-layer extrapolation (``core.depth_fit``) fits each run's figures alone, since
    the largest of two lines of different slopes is no line. None when the adjustments moved the
    segments (stages that did not run, put into the chain).
    """
    pairs = [(a, b) for a, b in zip(assembled.segments, final.segments) if a.name != "optimizer step"]
    if len(assembled.segments) != len(final.segments) or any(
            (a.name, a.stages_alive) != (b.name, b.stages_alive) for a, b in pairs):
        return None
    figures = {}
    for a, b in pairs:
        added = b.peak_bytes - a.peak_bytes
        figures[a.name] = {option: int(run.segments[a.stages_alive] + future_state + added)
                           for option, run in runs.items() if a.stages_alive in run.segments}
    return figures


def _assemble(model: nn.Module, observed: ObservedStep, wraps: dict[str, dict[str, tuple]], runs: dict[str, _MemoryRun],
              state_bytes: int, optimizer_step_bytes: int, future_state: int, has_optimizer: bool,
              device: str, peaks: Peaks, seconds_per_op: float = 0.0,
              offload_limits: dict[str, int] | None = None) -> Profile:
    """The Profile from the measured runs: options per stage, segments, static memory, baseline."""
    modules = dict(model.named_modules())
    stats = observed.stats
    offload_limits = offload_limits or {}
    stages = []
    for i, name in enumerate(observed.order):
        options = []
        for option, wrap in wraps.items():
            if name not in wrap:
                continue
            seconds, flops, roofline = option_costs(name, option, wrap[name], stats, peaks, seconds_per_op)
            options.append(StageOption(
                name=option, checkpointed=tuple(wrap[name]), stored_bytes=int(runs[option].stored[i]),
                local_peak_bytes=int(runs[option].local[i] + future_state), cost_seconds=seconds, cost_flops=flops,
                policy=sac.policy_of(option), cost_roofline=roofline,
                offloaded=(name,) if is_offload(option) else (),
                host_bytes=int((runs[option].host_bytes or {}).get(name, 0)) if is_offload(option) else 0,
                offload_limit=offload_limits.get(name, 0) if option == OFFLOAD_HIDDEN else 0))
        s = stats[name]
        stages.append(StageProfile(
            name=name, options=tuple(options), saved_bytes=sum(s.saved.values()),
            input_bytes=sum(s.inputs.values()), output_bytes=sum(s.outputs.values()),
            forward_seconds=s.seconds, forward_flops=s.flops, module_type=type(modules[name]).__name__))
    segment_peaks: dict[int, int] = {}
    for run in runs.values():
        for k, peak in run.segments.items():
            segment_peaks[k] = max(segment_peaks.get(k, peak), peak)
    segments = [Segment(f"between stages ({k} stored)" if k else "outside stages", k, int(v + future_state))
                for k, v in sorted(segment_peaks.items())]
    keep = runs["keep"]
    if has_optimizer:
        # The loss (and whatever it keeps) is still referenced while the optimizer steps.
        segments.append(Segment("optimizer step", 0, keep.parameter_bytes + keep.buffer_bytes + keep.gradient_bytes
                                + keep.residual_bytes + optimizer_step_bytes))
    profile = Profile(
        stages=tuple(stages), segments=tuple(segments),
        parameter_bytes=keep.parameter_bytes, gradient_bytes=keep.gradient_bytes,
        optimizer_state_bytes=state_bytes, buffer_bytes=keep.buffer_bytes,
        baseline_peak_bytes=0, baseline_step_seconds=observed.step_seconds, baseline_step_flops=observed.step_flops,
        device=device, notes=tuple(n for n in [_use_cache_note(model)] if n),
        baseline_step_roofline=roofline_seconds(observed.step_ops, peaks),
    )
    # By construction the model reproduces the measured runs; the baseline is the "keep" run
    # plus the optimizer (its state, and its step when that is the higher point).
    profile.baseline_peak_bytes = predict_peak(profile, [0] * len(stages))
    return profile
