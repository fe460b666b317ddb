"""Profile one training step in the terms of the memory model (``memory_model``).

What is measured, and how:

- Memory, with torch's ``MemTracker`` around forward and backward, once per option: nothing
  recomputed (``"keep"``), every stage recomputed (``"whole"``), and each heavy child recomputed in
  every stage (``"attn"``, ``"mlp"``, ...). A stage's stored bytes are what its forward leaves
  allocated; its local peak is the peak during its forward or backward less what the stages
  before it store. The gaps between stages (embeddings, head, loss) are segments. Because each
  term is measured under the option it describes, the model reproduces every measured run exactly.
- The optimizer step, under ``FakeTensorMode`` on fake copies of the parameters, gradients and
  state: its temporaries and the state it creates are counted without allocating them.
- Time per module with forward hooks; FLOPs per module with ``FlopCounterMode``; bytes saved for
  backward per stage (unique storages, parameters and buffers excluded) with saved-tensor hooks.

Gradients, buffers (BatchNorm statistics), RNG states and optimizer state are put back afterwards,
so profiling does not change training.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from .apply import AlreadyCheckpointedError, applied, existing_checkpointing
from .candidates import CandidateSpec, find_stages
from .fake import (GPU_EFFICIENCY, clone_optimizer, existing_fake_mode, explain_fake_failures, fake_like, fake_model,
                   gpu_peak_flops, new_fake_mode, real_code_paths)
from .measure import Step, _total, model_device, preserved_training_state, synchronize
from .memory_model import Profile, Segment, StageOption, StageProfile, predict_peak

# A child (itself a block, not a single layer) becomes an option of its stage when it saves at least this share of the stage's
# activation bytes (and is not almost all of it, which "whole" already covers).
MIN_CHILD_SHARE = 0.15
MAX_CHILD_SHARE = 0.9
MAX_CHILD_OPTIONS = 2


def _storages(value: Any) -> dict[int, int]:
    """Unique storages (by address) of the tensors in ``value``, with their sizes in bytes."""
    found = {}
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            found[storage._cdata] = storage.nbytes()
    return found


@dataclass
class _ModuleStats:
    seconds: float = 0.0
    flops: int = 0
    saved: dict[int, int] = field(default_factory=dict)
    inputs: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, int] = field(default_factory=dict)


def _run_step(model: nn.Module, step: Step) -> None:
    loss = step(model)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(f"step(model) must return the scalar loss tensor, got {type(loss).__name__}"
                        + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
    loss.backward()
    del loss
    for p in model.parameters():
        p.grad = None


def _observe(model: nn.Module, step: Step, stage_names: Sequence[str],
             timed: bool = True) -> tuple[list[str], dict[str, _ModuleStats], float, int]:
    """One plain step: execution order of stages, per-module time, forward FLOPs and saved bytes.

    Returns (stages in execution order, stats per module name, step seconds, step FLOPs).
    """
    modules = dict(model.named_modules())
    watched = {n: modules[n] for n in stage_names}
    for n in stage_names:
        for child, module in modules[n].named_children():
            watched[f"{n}.{child}"] = module
    stats = {n: _ModuleStats() for n in watched}
    # Storages are keyed by their C++ object, which real and fake tensors both have (fake
    # tensors have no data pointer).
    params = {p.untyped_storage()._cdata for p in [*model.parameters(), *model.buffers()]}
    active: list[str] = []
    order: list[str] = []
    started: dict[str, float] = {}
    flops_before: dict[str, int] = {}
    counter: list[FlopCounterMode] = []  # the FLOP counter of the counting run, when it runs
    device = model_device(model)
    handles = []

    def counted() -> int:
        # A module's FLOPs are the counter's growth across its forward: this does not depend on
        # how the step reaches the module (model(x), model.net(x), a LightningModule...).
        return int(sum(counter[0].flop_counts["Global"].values())) if counter else 0

    def pre(name):
        def hook(module, args, kwargs):
            if name in stage_names and name not in order:
                order.append(name)
            stats[name].inputs.update(_storages((args, kwargs)))
            active.append(name)
            flops_before[name] = counted()
            synchronize(device)
            started[name] = time.perf_counter()
        return hook

    def post(name):
        def hook(module, args, kwargs, output):
            synchronize(device)
            stats[name].seconds += time.perf_counter() - started.pop(name)
            stats[name].flops += counted() - flops_before.pop(name)
            stats[name].outputs.update(_storages(output))
            active.remove(name)
        return hook

    for name, module in watched.items():
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name), with_kwargs=True, always_call=True))

    def pack(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            if storage._cdata not in params:
                for name in active:
                    stats[name].saved[storage._cdata] = storage.nbytes()
        return tensor

    try:
        # Timing first, without modes that would slow it; then FLOPs and saved bytes. (On fake
        # tensors nothing real runs, so there is nothing to time.)
        step_seconds = 0.0
        if timed:
            synchronize(device)
            start = time.perf_counter()
            _run_step(model, step)
            synchronize(device)
            step_seconds = time.perf_counter() - start
        seconds = {n: s.seconds for n, s in stats.items()}
        for s in stats.values():
            s.saved.clear()
            s.inputs.clear()
            s.outputs.clear()
        order.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with FlopCounterMode(display=False) as forward_counter:
                counter.append(forward_counter)
                loss = step(model)
            counter.clear()
            with FlopCounterMode(display=False) as backward_counter:
                loss.backward()
            del loss
        for p in model.parameters():
            p.grad = None
    finally:
        for h in handles:
            h.remove()
    for name, s in stats.items():
        s.seconds = seconds[name]  # from the timing pass, not the slower counting pass
    step_flops = int(forward_counter.get_total_flops() + backward_counter.get_total_flops())
    return order, stats, step_seconds, step_flops


class _SegmentTracker(MemTracker):
    """MemTracker that also records the peak of every segment of the step.

    Segments are labelled ("fw", i) / ("bw", i) while stage i runs forward / backward, and
    ("gap", k) between stages, where k stages have run forward and not yet backward.
    """

    def __init__(self, stage_ids: dict[int, int], device: torch.device):
        super().__init__()
        self.stage_ids = stage_ids
        self.device = device
        self.label: tuple[str, int] = ("gap", 0)
        self.segment_peaks: dict[tuple[str, int], int] = {}
        self.pre_fw: dict[int, int] = {}
        self.post_fw: dict[int, int] = {}

    def current_total(self) -> int:
        return int(_total(self._curr_mem_snap, self.device).get("Total", 0))

    def _note(self) -> None:
        total = self.current_total()
        if total > self.segment_peaks.get(self.label, -1):
            self.segment_peaks[self.label] = total

    def _update_peak_stats(self, peak_state):  # type: ignore[no-untyped-def]
        super()._update_peak_stats(peak_state)
        self._note()

    def _pre_fw_hook(self, module, inputs):  # type: ignore[no-untyped-def]
        super()._pre_fw_hook(module, inputs)
        index = self.stage_ids.get(id(module))
        if index is not None and not self._mod_tracker.is_bw:
            self.pre_fw[index] = self.current_total()
            self.label = ("fw", index)
            self._note()

    def _post_fw_hook(self, module, inputs, outputs):  # type: ignore[no-untyped-def]
        super()._post_fw_hook(module, inputs, outputs)
        index = self.stage_ids.get(id(module))
        if index is not None and not self._mod_tracker.is_bw:
            self.post_fw[index] = self.current_total()
            self.label = ("gap", index + 1)
            self._note()

    def _pre_bw_hook(self, module, args):  # type: ignore[no-untyped-def]
        super()._pre_bw_hook(module, args)
        index = self.stage_ids.get(id(module))
        if index is not None:
            self.label = ("bw", index)
            self._note()

    def _post_bw_hook(self, module, args):  # type: ignore[no-untyped-def]
        super()._post_bw_hook(module, args)
        index = self.stage_ids.get(id(module))
        if index is not None:
            self.label = ("gap", index)
            self._note()


@dataclass
class _MemoryRun:
    stored: list[int]
    local: list[int]
    segments: dict[int, int]  # stages alive -> peak beyond their stored bytes
    peak: int
    gradient_bytes: int
    parameter_bytes: int
    buffer_bytes: int
    residual_bytes: int  # what the step still holds after backward (its loss, outputs), besides static memory


def _memory_run(model: nn.Module, step: Step, order: Sequence[str], wrapped: Sequence[str],
                optimizer: torch.optim.Optimizer | None) -> _MemoryRun:
    modules = dict(model.named_modules())
    device = model_device(model)
    tracker = _SegmentTracker({id(modules[n]): i for i, n in enumerate(order)}, device)
    tracker.track_external(model, *([optimizer] if optimizer is not None else []))
    with applied(model, wrapped), tracker:
        loss = step(model)
        loss.backward()
        after_backward = tracker.current_total()
        del loss
    n = len(order)
    missing = [order[i] for i in range(n) if i not in tracker.pre_fw or i not in tracker.post_fw]
    if missing:
        raise RuntimeError(f"stages {missing} did not run forward during the profiled step")
    stored = [tracker.post_fw[i] - tracker.pre_fw[i] for i in range(n)]
    prefix = [0]
    for s in stored:
        prefix.append(prefix[-1] + s)
    local = [0] * n
    segments: dict[int, int] = {}
    for (kind, k), peak in tracker.segment_peaks.items():
        if kind in ("fw", "bw"):
            local[k] = max(local[k], peak - prefix[k])
        else:
            segments[k] = max(segments.get(k, 0), peak - prefix[k])
    snapshot = {getattr(k, "value", k): v for k, v in _total(tracker.get_tracker_snapshot("current"), device).items()}
    static_now = sum(int(snapshot.get(k, 0)) for k in ("Gradient", "Parameter", "Buffer", "Optstate"))
    result = _MemoryRun(
        stored=stored, local=local, segments=segments,
        peak=int(_total(tracker.get_tracker_snapshot("peak"), device).get("Total", 0)),
        gradient_bytes=int(snapshot.get("Gradient", 0)),
        parameter_bytes=int(snapshot.get("Parameter", 0)),
        buffer_bytes=int(snapshot.get("Buffer", 0)),
        residual_bytes=max(0, after_backward - static_now),
    )
    for p in model.parameters():
        p.grad = None
    return result


def _optimizer_step_cost(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
    """(state bytes the optimizer holds after a step, peak bytes of its step beyond parameters and gradients).

    The step runs under FakeTensorMode on fake copies of the parameters, gradients and state, so
    nothing real is allocated or changed, and whatever the optimizer's implementation (for-loop,
    foreach, fused) allocates is counted.
    """
    if optimizer is None:
        return 0, 0
    mode = new_fake_mode()
    fakes: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in fakes:
                copy = nn.Parameter(fake_like(mode, p), requires_grad=p.requires_grad)
                if p.requires_grad:
                    copy.grad = fake_like(mode, p)
                fakes[id(p)] = copy
    clone = clone_optimizer(optimizer, fakes, mode)
    tracker = MemTracker()
    # Parameters and gradients are tracked up front so that only the state and the step's own
    # temporaries land in the optimizer category.
    tracker.track_external(*fakes.values(), *[f.grad for f in fakes.values() if f.grad is not None], clone)
    with mode, tracker:
        clone.step()
    step_peak = 0
    for snapshot in tracker.get_tracker_snapshot("peak").values():
        step_peak += sum(v for k, v in snapshot.items() if getattr(k, "value", k) == "Optstate")
    state_bytes = 0
    seen = set()
    for state in clone.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and id(v) not in seen:
                seen.add(id(v))
                state_bytes += v.untyped_storage().nbytes()
    return state_bytes, max(step_peak, state_bytes)


def _child_options(stage: str, stats: dict[str, _ModuleStats], modules: dict[str, nn.Module]) -> list[str]:
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
                 device: str | torch.device | None = None, gpu: str | None = None) -> Profile:
    """Profile one training step of ``model`` for the solver.

    Args:
        model: the model, in the mode it trains in (``model.train()``).
        step: ``step(model)`` runs a forward pass on a batch and returns the scalar loss; the
            profiler runs backward itself. It is called several times on the same batch.
        optimizer: its state counts in the budget: the state it holds, or, before its first step,
            the state it will create (Adam: two tensors per parameter), and its step's temporaries.
        warmup: steps run first and not measured (lazy initialisation, allocator warm-up).
        candidates: as ``find_stages``: None for automatic, or module classes / name patterns.
        fake: profile on fake tensors (no memory is allocated, nothing real runs): for models
            larger than this machine and for devices that are not here. The model may be real (it
            is not changed), on the meta device, or built under a ``FakeTensorMode``; ``step``
            may make its inputs as real tensors. Byte counts are exact; costs are counted FLOPs.
        dtype: with ``fake``, the dtype floating-point parameters train in (``torch.bfloat16``).
        device: the device the profile plans for (``"cuda"``); the default is the model's.
        gpu: with ``fake``, a GPU name (``"h100"``, ``"a100"``, ...: ``fake.GPU_PEAK_FLOPS``) whose
            throughput turns FLOPs into seconds; without it, a fake profile has FLOP costs only.

    Returns:
        A ``Profile``: per stage in execution order its options (stored bytes, local peak, recompute
        cost in seconds and FLOPs), its saved/input/output bytes and forward cost; the segments
        between stages; static bytes and the baseline peak of the step.

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
        >>> fake.device, fake.stages[0].options[1].stored_bytes == profile.stages[0].options[1].stored_bytes
        ('cuda', True)
    """
    existing = existing_checkpointing(model)
    if existing:
        raise AlreadyCheckpointedError("Cannot plan recomputation: " + "; ".join(existing))
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if not fake and (gpu is not None or dtype is not None):
        raise ValueError("gpu= and dtype= apply to fake profiles (fake=True); a real profile times the real step")
    seconds_per_flop = 1.0 / (gpu_peak_flops(gpu) * GPU_EFFICIENCY) if gpu is not None else 0.0
    target_device = str(torch.device(device)) if device is not None else None
    if not fake:
        return _profile(model, step, optimizer, warmup, candidates, target_device)
    mode = existing_fake_mode(model) or new_fake_mode()
    names = {id(p): name for name, p in model.named_parameters()}
    model = fake_model(model, mode, dtype)
    if optimizer is not None:
        fake_params = dict(model.named_parameters())
        optimizer = clone_optimizer(optimizer, {i: fake_params[n] for i, n in names.items()}, mode)
    with mode, explain_fake_failures(), real_code_paths():
        # No warm-up and no timing: fake tensors have no caches to warm and no time to measure.
        profile = _profile(model, step, optimizer, 0, candidates, target_device or "cpu", timed=False)
    # Nothing real ran, so wall-clock times mean nothing: costs come from FLOPs.
    profile.stages = tuple(
        replace(stage, forward_seconds=stage.forward_flops * seconds_per_flop,
                options=tuple(replace(o, cost_seconds=o.cost_flops * seconds_per_flop) for o in stage.options))
        for stage in profile.stages)
    profile.baseline_step_seconds = profile.baseline_step_flops * seconds_per_flop
    if gpu is None:
        profile.notes = (*profile.notes, "fake profile without a GPU named: costs are FLOPs only (use cost='flops')")
    return profile


def _profile(model: nn.Module, step: Step, optimizer: torch.optim.Optimizer | None, warmup: int,
             candidates: CandidateSpec, device: str | None, timed: bool = True) -> Profile:
    stage_names = find_stages(model, candidates)
    modules = dict(model.named_modules())
    # applied(model, []) lifts any plan the model has for the profile and puts it back after.
    with preserved_training_state(model, optimizer), applied(model, []):
        for p in model.parameters():
            p.grad = None
        for _ in range(warmup):
            _run_step(model, step)
        order, stats, step_seconds, step_flops = _observe(model, step, stage_names, timed)
        if not order:
            raise RuntimeError(f"none of the candidate stages {stage_names[:4]}... ran during step(model)")
        children = {name: _child_options(name, stats, modules) for name in order}
        option_names = ["keep", "whole"] + sorted({c for cs in children.values() for c in cs})
        wraps = {"keep": {n: () for n in order}, "whole": {n: (n,) for n in order}}
        for child in option_names[2:]:
            wraps[child] = {n: (f"{n}.{child}",) for n in order if child in children[n]}
        with warnings.catch_warnings():
            # MemTracker warns when a module's backward hook outlives the module's outputs.
            warnings.simplefilter("ignore")
            runs = {name: _memory_run(model, step, order, [m for ms in wraps[name].values() for m in ms], optimizer)
                    for name in option_names}
        state_bytes, optimizer_step_bytes = _optimizer_step_cost(model, optimizer)

    keep = runs["keep"]
    # State that does not exist yet will exist during every later step.
    future_state = state_bytes if optimizer is not None and not optimizer.state else 0
    stages = []
    for i, name in enumerate(order):
        options = []
        for option in option_names:
            if name not in wraps[option]:
                continue
            wrapped = wraps[option][name]
            run = runs[option]
            options.append(StageOption(
                name=option,
                checkpointed=tuple(wrapped),
                stored_bytes=int(run.stored[i]),
                local_peak_bytes=int(run.local[i] + future_state),
                cost_seconds=float(sum(stats[m].seconds for m in wrapped)),
                cost_flops=int(sum(stats[m].flops for m in wrapped)),
            ))
        s = stats[name]
        stages.append(StageProfile(
            name=name, options=tuple(options), saved_bytes=sum(s.saved.values()),
            input_bytes=sum(s.inputs.values()), output_bytes=sum(s.outputs.values()),
            forward_seconds=s.seconds, forward_flops=s.flops, module_type=type(modules[name]).__name__,
        ))
    segment_peaks: dict[int, int] = {}
    for run in runs.values():
        for k, peak in run.segments.items():
            segment_peaks[k] = max(segment_peaks.get(k, 0), peak)
    segments = [Segment(f"between stages ({k} stored)" if k else "outside stages", k, int(v + future_state))
                for k, v in sorted(segment_peaks.items())]
    if optimizer is not None:
        # The loss (and whatever it keeps) is still referenced while the optimizer steps.
        segments.append(Segment("optimizer step", 0, keep.parameter_bytes + keep.buffer_bytes + keep.gradient_bytes
                                + keep.residual_bytes + optimizer_step_bytes))
    notes = [n for n in [_use_cache_note(model)] if n]
    profile = Profile(
        stages=tuple(stages), segments=tuple(segments),
        parameter_bytes=keep.parameter_bytes, gradient_bytes=keep.gradient_bytes,
        optimizer_state_bytes=state_bytes, buffer_bytes=keep.buffer_bytes,
        baseline_peak_bytes=0, baseline_step_seconds=step_seconds, baseline_step_flops=step_flops,
        device=device or str(model_device(model)), notes=tuple(notes),
    )
    # By construction the model reproduces the measured runs; the baseline is the "keep" run
    # plus the optimizer (its state, and its step when that is the higher point).
    profile.baseline_peak_bytes = predict_peak(profile, [0] * len(stages))
    return profile
