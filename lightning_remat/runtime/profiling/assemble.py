"""The Profile from a step's memory runs: options per stage, segments, static memory, baseline peak."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ...core.actions import StageAction
from ...core.memory_model import Costs, Profile, Segment, StageOption, StageProfile
from ..measuring.observe import ObservedStep
from ..measuring.roofline import Peaks, option_costs, roofline_seconds
from .memory_run import MemoryRun
from .stage_options import RUNS_AGAIN

USE_CACHE_NOTE = ("use_cache=True: this transformers model returns the key/value cache of every layer it does not "
                  "recompute (a recomputed layer runs without it, as under Hugging Face's own checkpointing), which "
                  "stays alive until the forward's outputs are released; set model.config.use_cache = False for "
                  "training")


def assemble(model: nn.Module, observed: ObservedStep, offered: dict[str, dict[str, StageAction]],
             runs: dict[str, MemoryRun], state_bytes: int, optimizer_step_bytes: int, future_state: int,
             has_optimizer: bool, device: str, peaks: Peaks, seconds_per_op: float, compiled: bool) -> Profile:
    """The Profile from the measured runs (``offered``: per option, each stage's action); with ``compiled``,
    recompute priced as torch.compile runs it."""
    modules = dict(model.named_modules())
    stats = observed.stats
    stages = []
    total_calls: dict[str, int] = {}
    for name, calls in zip(observed.positions, observed.position_calls):
        total_calls[name] = total_calls.get(name, 0) + calls
    for i, name in enumerate(observed.positions):
        # A module at several places (a trunk run twice): each place its own memory figures, and its
        # share by calls of the module's costs (observed over all its calls), so its places sum to them.
        before = sum(c for n, c in zip(observed.positions[:i], observed.position_calls) if n == name)
        counts = (before, observed.position_calls[i], total_calls[name])
        share, call = counts[1] / counts[2], observed.positions[:i].count(name)
        options = []
        for option, actions in offered.items():
            if name not in actions:
                continue
            action, run = actions[name], runs[option]
            costs = option_costs(name, action.policy, _run_again(action, modules), stats, peaks, seconds_per_op,
                                 compiled)
            options.append(StageOption(
                name=option, action=replace(action, offload_limit=None), stored_bytes=int(run.stored[i]),
                local_peak_bytes=int(run.local[i] + future_state),
                costs=Costs(costs.time * share, _part(costs.flops, counts), costs.roofline * share),
                host_bytes=int(run.host_bytes.get(name, 0) * share),  # offload runs' only
                offload_limit=action.offload_limit or 0, shared_held=run.shared[i], held_before=run.held_before[i]))
        s = stats[name]
        stages.append(StageProfile(
            name=name, options=tuple(options), saved_bytes=_part(sum(s.saved.values()), counts),
            input_bytes=_part(sum(s.inputs.values()), counts),
            output_bytes=_part(sum(s.outputs.values()), counts), forward_seconds=s.seconds * share,
            forward_flops=_part(s.flops, counts), module_type=type(modules[name]).__name__, call=call,
            fresh=i in runs["keep"].fresh))
    segments = _segments(runs, future_state)
    keep, config = runs["keep"], getattr(model, "config", None)
    cached = model.training and getattr(config, "use_cache", False) and hasattr(config, "num_hidden_layers")
    if has_optimizer:
        # The loss (and whatever it keeps) is still referenced while the optimizer steps.
        segments.append(Segment("optimizer step", 0, keep.parameter_bytes + keep.buffer_bytes + keep.gradient_bytes
                                + keep.residual_bytes + optimizer_step_bytes))
    profile = Profile(
        stages=tuple(stages), segments=tuple(segments),
        parameter_bytes=keep.parameter_bytes, gradient_bytes=keep.gradient_bytes,
        optimizer_state_bytes=state_bytes, buffer_bytes=keep.buffer_bytes,
        baseline_peak_bytes=0, device=device, notes=(USE_CACHE_NOTE,) if cached else (),
        baseline_costs=Costs(observed.step_seconds, observed.step_flops, roofline_seconds(observed.step_ops, peaks)),
    )
    # By construction the model reproduces the measured runs; the baseline is the "keep" run
    # plus the optimizer (its state, and its step when that is the higher point).
    return profile.with_baseline()


def _run_again(action: StageAction, modules: dict[str, nn.Module]) -> tuple[str, ...]:
    """The modules ``action`` runs again in backward: those it recomputes, and its settings' (``RUNS_AGAIN``)."""
    extra = dict(action.extra)
    return (*action.modules, *(m for key, again in RUNS_AGAIN.items() if key in extra
                               for m in again(action.stage, extra[key], modules)))


def _part(value: int, calls: tuple[int, int, int]) -> int:
    """A module's integer figure shared among its places by calls, so the places' parts sum to it."""
    before, here, total = calls
    return int(value) * (before + here) // total - int(value) * before // total


def _segments(runs: dict[str, MemoryRun], future_state: int) -> list[Segment]:
    """Each gap's segment: its largest figure over the runs, and how much less without shared held inputs."""
    peaks: dict[int, int] = {}
    held_out: dict[int, int] = {}  # the largest figure with the held shared inputs left out
    labels: dict[int, set[str]] = {}
    for run in runs.values():
        for k, peak in run.segments.items():
            held = run.segments_held.get(k, ())
            peaks[k] = max(peaks.get(k, peak), peak)
            without = peak - sum(nbytes for _, nbytes in held)
            held_out[k] = max(held_out.get(k, without), without)
            labels.setdefault(k, set()).update(label for label, _ in held)
    return [Segment(f"between stages ({k} stored)" if k else "outside stages", k, int(v + future_state),
                    shared_saving=int(v - held_out[k]) if labels[k] else 0, shared_labels=tuple(sorted(labels[k])))
            for k, v in sorted(peaks.items())]


def gap_figures(assembled: Profile, final: Profile, runs: dict[str, MemoryRun],
                future_state: int) -> dict[str, dict[str, int]] | None:
    """Each gap's figure in each memory run, for the depth extrapolation; None when adjustments moved the segments."""
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
