"""Profile one training step in the terms of the memory model, each term measured under the option it
describes; gradients, buffers, RNG and optimizer state are put back afterwards."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ...core.allowances import DDP_REDUCER_ALLOWANCE
from ...core.budget import format_bytes
from ...core.config import PRECISIONS, ProfileOptions, profile_options
from ...core.errors import AlreadyCheckpointedError, StepError
from ...core.memory_model import Profile, priced, seconds_per_flop
from ...core.plan import Plan, StageAction
from ...core.offload_model import OFFLOAD, OFFLOAD_HIDDEN, OFFLOAD_INPUT
from ..installing import chunked_loss, sac
from ..installing.apply import applied, existing_checkpointing
from ..installing.compiled import fabric_forward_context, runs_compiled, uncompiled
from ..installing.fingerprint import binding_of
from ..measuring.exclusive import exclusive, long_lived_frozen
from ..measuring.tracking import rng_states_count
from ..measuring.measure import RandomState, Step, model_device, preserved_training_state
from ..measuring.optimizers import as_optimizers, map_optimizers
from ..measuring.observe import observe_step
from ..measuring.roofline import device_peaks, sac_seconds_per_op, training_flops_per_second
from ..measuring.runner import run_step
from ..measuring.tracking import eager_stance
from ..measuring.user_hooks import user_hooks_suspended
from ..targets.fake import (clone_optimizer, existing_fake_mode, explain_fake_failures, fake_model, new_fake_mode,
                            real_code_paths)
from ..targets.fake_attention import AttentionNotes, cuda_attention
from ..targets.fake_moe import fixed_shape_experts, grouped_mm_in_every_dtype
from ..targets.offload_link import check_offload_target, hidden_limits, price_offload
from ..targets.sharded import sharded_twin, sharding_info, sharding_note
from .assemble import assemble, gap_figures
from .candidates import CandidateSpec, find_stages
from .hierarchy import Hierarchy, expand
from .loss_stage import measure_head, with_head_stage
from .optimizer_step import MeasuredOnRead, OptimizerStepCost, optimizer_step_alternatives, optimizer_step_cost
from .profile_adjust import with_always_alive, with_pooled_timings, with_unobserved
from .repeated import alternatives_in_depth, repeated_profile, repeated_stack
from .residual_twins import twin_stages
from .stage_options import measure_options, option_actions, span_groups
from .tiled_options import add_tiled_options, tiled_settings

COMPILED_NOTE = ("priced for torch.compile: recomputed pointwise ops cost nothing (fused into the backward's "
                 "kernels), eager selective checkpointing's per-op cost is not counted")
CHUNKS_UNDER_COMPILE_NOTE = ("chunk_loss: the step runs under torch.compile, whose inductor fuses the head's chunks "
                             "back together, so their eager figures do not hold; the head and loss are kept whole "
                             "(docs/long_context.md)")


@exclusive()
def profile_step(model: nn.Module, step: Callable[[nn.Module], torch.Tensor], *,
                 optimizer: torch.optim.Optimizer | None = None, warmup: int = 1,
                 candidates: CandidateSpec = None, fake: bool = False, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, gpu: str | None = None,
                 device_memory: int | str | None = None, precision: str | None = None, accumulation_steps: int = 1,
                 gradient_buckets: bool = False, world_size: int = 1, repeated_blocks: bool = True,
                 policies: Sequence[str] | None = (), offload: bool = False, chunk_loss: bool = False,
                 host_memory: int | str | None = None, tile_mlp: bool = False,
                 options: ProfileOptions | None = None) -> Profile:
    """Profile one training step of ``model`` for the solver.

    Args:
        step: ``step(model)`` runs a forward pass and returns the scalar loss; called several times on one batch.
        optimizer: its state (or what its first step will create) and its step's temporaries count.
        fake: profile on fake tensors (nothing allocated); the model may be real, on meta or fake.
        gpu: with ``fake``, a GPU name whose throughput turns FLOPs into seconds.
        options: every setting as one ``ProfileOptions`` (the one description of each); not beside keywords.

    Raises:
        AlreadyCheckpointedError: the model uses Hugging Face or torch checkpointing already.
        NoCandidateError: the model has no candidate block.
        FakeProfileError: with ``fake``, the model's code needs real values; it names the op.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
        >>> x = torch.randn(32, 64)
        >>> profile = profile_step(net, lambda m: m(x).square().mean())
        >>> [s.name for s in profile.stages], [o.name for o in profile.stages[0].options]
        (['0', '1', '2', '3'], ['keep', 'whole'])
        >>> fake = profile_step(net, lambda m: m(x).square().mean(), fake=True, device="cuda", gpu="h100")
        >>> # on the CPU a checkpoint also keeps the host's RNG state, which a GPU's memory never holds
        >>> fake.device, profile.stages[0].options[1].stored_bytes - fake.stages[0].options[1].stored_bytes
        ('cuda', 5056)
    """
    options = profile_options(
        options, candidates=candidates, fake=fake, dtype=dtype, device=device, gpu=gpu, warmup=warmup,
        device_memory=device_memory, precision=precision, accumulation_steps=accumulation_steps,
        gradient_buckets=gradient_buckets, world_size=world_size, repeated_blocks=repeated_blocks, policies=policies,
        offload=offload, chunk_loss=chunk_loss, host_memory=host_memory, tile_mlp=tile_mlp)
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
    step = _in_context(step, fabric_forward_context(model))
    # A compiled model is profiled as its original modules (hooks must fire), eagerly (dynamo would
    # never compile code first met under our dispatch modes); recompute is priced as compiled.
    compiled, chunk_loss_asked = runs_compiled(model), options.chunk_loss
    if compiled and options.chunk_loss:
        warnings.warn(f"lightning-remat: {CHUNKS_UNDER_COMPILE_NOTE}", UserWarning, stacklevel=2)
        options = replace(options, chunk_loss=False)
    # The user's hooks see training forwards only; a fake profile without a device plans for the CPU.
    target = options.device or ("cpu" if options.fake else model_device(model))
    with user_hooks_suspended(model), eager_stance(), uncompiled(model) as model, rng_states_count(target):
        if not options.fake:
            profile = _profile(model, step, optimizer, options, timed=True, compiled=compiled)
            profile = replace(profile, optimizer_step_alternatives=optimizer_step_alternatives(
                optimizer, options.device or model_device(model)))
        else:
            with long_lived_frozen():
                profile = _fake_profile(model, step, optimizer, options, compiled)
    if compiled and chunk_loss_asked:
        profile = profile.noted(CHUNKS_UNDER_COMPILE_NOTE)
    profile = replace(profile, fingerprint=binding_of(model, [*(s.name for s in profile.stages),
                                                               *(m for m, _ in profile.blocks)]))
    refusal = chunked_loss.refused(model) if options.chunk_loss else None
    if refusal is not None:  # a causal LM with a loss of the user's own: said, not silently left whole
        warnings.warn(f"lightning-remat: {refusal}", UserWarning, stacklevel=2)
        profile = profile.noted(refusal)
    return profile


def _in_context(step: Step, context: contextlib.AbstractContextManager) -> Step:
    """``step`` inside ``context`` (Fabric's precision around the module profiling looks through, autocast)."""
    if isinstance(context, contextlib.nullcontext):
        return step

    def step_in_context(model: nn.Module) -> torch.Tensor:
        with context:
            return step(model)
    return step_in_context


def _precision(options: ProfileOptions) -> tuple[torch.dtype | None, torch.dtype | None, str]:
    """(dtype of parameters, gradients and state; autocast dtype or None; a note)."""
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
                  options: ProfileOptions, compiled: bool = False) -> Profile:
    rate = seconds_per_flop(1.0, training_flops_per_second("cuda", options.gpu)) if options.gpu is not None else 0.0
    dtype, autocast, precision_note = _precision(options)
    sharded = options.world_size > 1  # sharded: mixed precision is FSDP2's policy, not autocast
    if autocast is not None and not sharded:
        # Fake tensors live on the CPU, so the CPU's autocast stands in for the target's: both run
        # matmuls, linears and convolutions (what activations are mostly made of) in ``autocast``.
        step = _in_context(step, torch.autocast("cpu", dtype=autocast))
    mode = existing_fake_mode(model) or new_fake_mode()
    # Planned for a GPU (named, or device="cuda"): attention with dropout as its fused kernels run it.
    targets_cuda = options.gpu is not None or torch.device(options.device or "cpu").type == "cuda"
    names = {id(p): name for name, p in model.named_parameters()}
    model = fake_model(model, mode, dtype)
    fake_params = dict(model.named_parameters())
    moe_notes: list[str] = []
    attention_notes = AttentionNotes()  # attention that is quadratic on the target GPU, told in the plan
    optimizer = map_optimizers(optimizer, lambda o: clone_optimizer(o, {i: fake_params[n] for i, n in names.items()},
                                                                    mode))

    # A depth's optimizer is given to the runs of both ballast phases: its step, which no ballast
    # touches, is measured in the first (kept beside its figure, the optimizer's id is not reused).
    step_costs: dict[int, tuple[Any, OptimizerStepCost]] = {}

    def run(model: nn.Module, optimizer: torch.optim.Optimizer | None, wrap: Callable | None = None) -> Profile:
        def step_cost(clone: Any, device: str, given: Any = optimizer) -> OptimizerStepCost:
            if id(given) not in step_costs:
                step_costs[id(given)] = (given, optimizer_step_cost(clone, device))
            return step_costs[id(given)][1]

        # Sharded: each model profiled (the whole one, or a truncated copy) gets a twin of its own
        # sharded over a fake process group, and an optimizer over the twin's sharded parameters.
        with sharded_twin(model, optimizer, options.world_size, options.candidates, mode,
                          autocast) as (twin, optimizer):
            with mode, explain_fake_failures(), real_code_paths(), cuda_attention(targets_cuda, attention_notes), \
                    grouped_mm_in_every_dtype(), fixed_shape_experts(twin, moe_notes):
                # No warm-up and no timing: fake tensors have no caches to warm and no time to measure.
                wrapped = wrap(step) if wrap else step
                return _profile(twin, attention_notes.watched(wrapped) if targets_cuda else wrapped, optimizer,
                                replace(options, warmup=0, device=options.device or "cpu"), timed=False,
                                compiled=compiled, step_cost_of=step_cost)

    stack = repeated_stack(model, options.candidates) if options.repeated_blocks else None
    repeated = repeated_profile(model, stack, optimizer, run)
    profile = repeated or run(model, optimizer)
    if sharded:
        profile = replace(profile, sharding=sharding_info(model, options.world_size, options.candidates, autocast))
        precision_note = sharding_note(profile.sharding)
    else:
        # Measured when first read (only the optimizer-step advice reads it; its clone here steps no more), for a
        # stack on a line in depth through its 1- and 2-layer copies' optimizers.
        def alternatives(device: str = options.device or "cpu") -> dict[str, int]:
            with mode:
                deep = alternatives_in_depth(model, stack, optimizer, lambda o: optimizer_step_alternatives(o, device))
                return dict(deep) if deep is not None else optimizer_step_alternatives(optimizer, device)
        profile = replace(profile, optimizer_step_alternatives=MeasuredOnRead(alternatives))
    # Nothing real ran, so wall-clock times mean nothing: costs come from FLOPs.
    profile = priced(profile, rate)
    if options.offload:
        profile = price_offload(profile, options, options.device or "cuda")
    profile = profile.noted(precision_note, *dict.fromkeys(moe_notes), *attention_notes.lines())
    return profile


def _profile(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None, options: ProfileOptions,
             timed: bool, compiled: bool = False, step_cost_of: Callable = optimizer_step_cost) -> Profile:
    stage_names = find_stages(model, options.candidates)
    modules = dict(model.named_modules())
    # applied(model, Plan()) lifts any plan the model has for the profile and puts it back after.
    with preserved_training_state(model, optimizer), applied(model, Plan()):
        model.zero_grad(set_to_none=True)
        for _ in range(options.warmup):
            run_step(model, step, zero_grad="after", check=True)
        # Every pass takes the random decisions of the first (dropout masks, dropped layers).
        replay = RandomState.capture(model_device(model)).restore
        # Automatic candidates are planned whole or through their children (hierarchy.py); the
        # forward that tells which blocks chain also tells which Sequential items do.
        found = expand(model, step, stage_names, replay) if options.candidates is None else Hierarchy(stage_names)
        groups = span_groups(model, step, found.stages, replay, found.calls)
        found.calls = {}  # the recorded outputs: not held through the memory runs
        stage_names = found.stages
        observed = observe_step(model, step, stage_names, timed, before_pass=replay)
        if not observed.order:
            raise StepError(f"none of the candidate stages {stage_names[:4]}... ran during step(model)")
        policies = sac.POLICIES if options.policies is None else options.policies  # checked by ProfileOptions
        twins = twin_stages(model, step, observed.order, replay)
        offered = option_actions(observed.order, observed, modules, policies, twins)
        if options.offload:
            # Not a module at several places (core.calls): the offloader prefetches by place, unchecked for it.
            single = [n for n in observed.order if observed.positions.count(n) == 1]
            offered[OFFLOAD] = {n: StageAction.offload(n) for n in single}
            limits = hidden_limits(observed, options, str(options.device or model_device(model)), timed)
            if limits:
                offered[OFFLOAD_HIDDEN] = {n: StageAction.offload(n, limits[n]) for n in limits if n in single}
            # Recomputed whole, with the input the checkpoint keeps on the host.
            offered[OFFLOAD_INPUT] = {n: StageAction.recompute(n, offload_input=True) for n in single}
        tiled, tile_note = tiled_settings(model, step, observed.order, replay) if options.tile_mlp else ({}, "")
        add_tiled_options(offered, tiled)
        runs, dropped = measure_options(model, step, observed, offered, optimizer, replay, options.accumulation_steps)
        head = measure_head(model, step, observed, optimizer, replay, options.accumulation_steps,
                            runs["keep"].segments) if options.chunk_loss else None
        device = options.device or str(model_device(model))
        step_cost = step_cost_of(optimizer, device)
    future_state = step_cost.created_state_bytes
    peaks = device_peaks(device, options.gpu)
    # Eager selective checkpointing costs time per op beyond the recomputed ops (measured here);
    # under torch.compile its modes are traced away.
    policy = any(a.policy for actions in offered.values() for a in actions.values())
    per_op = sac_seconds_per_op() if timed and not compiled and policy else 0.0
    assembled = assemble(model, observed, offered, runs, step_cost.state_bytes, step_cost.step_peak_bytes, future_state,
                         optimizer is not None, device, peaks, per_op, compiled)
    # A module at several places (core.calls) is planned alone: no span or block over it; none at all
    # in a step that runs backward more than once (a fresh place).
    several = {n for n in observed.positions if observed.positions.count(n) > 1}
    several = set(observed.positions) if runs["keep"].fresh else several
    assembled = replace(assembled, span_groups=tuple(g for g in groups if not several & set(g)),
                        blocks=tuple(b for b in found.blocks if not several & set(b[1])))
    profile = _adjusted(assembled, model, options, runs, dropped, stage_names, modules, device, timed)
    profile = profile.noted(*[n for n in (COMPILED_NOTE if compiled else "", tile_note) if n])
    profile = profile.with_gap_figures(gap_figures(assembled, profile, runs, future_state))
    return with_head_stage(profile, head, peaks.flops_per_second, peaks.bytes_per_second)


def _adjusted(profile: Profile, model: nn.Module, options: ProfileOptions, runs: dict, dropped: Sequence[str],
              stage_names: Sequence[str], modules: dict[str, nn.Module], device: str, timed: bool) -> Profile:
    """The assembled profile plus what the measured runs do not hold (timings, untracked bytes, DDP, offload)."""
    if timed:
        profile = with_pooled_timings(profile)
    untracked = runs["keep"].untracked_bytes  # CUDA's allocator's peak above MemTracker's count
    profile = with_always_alive(profile, untracked, (
        f"calibrated on {profile.device}: the allocator's peak was {format_bytes(untracked)} above the tensors "
        "the profile tracks (the batch already on the device, library workspaces); counted in every term"))
    if dropped:
        profile = profile.noted("selective-checkpointing option(s) dropped, their recompute did not replay "
                                "the forward: " + "; ".join(dropped))
    if options.accumulation_steps > 1:
        profile = profile.noted(f"gradient accumulation over {options.accumulation_steps} micro-batches: "
                                "profiled as a later micro-batch, with every gradient alive from its start")
    if options.gradient_buckets:
        # One copy of the trainable gradients, and the reducer's bookkeeping (core.allowances).
        buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) + DDP_REDUCER_ALLOWANCE
        profile = with_always_alive(profile, buckets, f"DDP's gradient buckets, {format_bytes(buckets)} (one copy of "
                                     "the gradients), alive through the whole step; counted in every term")
    profile = with_unobserved(profile, stage_names, modules)
    return price_offload(profile, options, device) if timed and options.offload else profile
