#!/usr/bin/env python
"""Benchmark AutoRemat plans against the usual peers, on CPU, in one run.

For every model (transformers configs with random weights, and a deep plain MLP chain) this runs,
each on its own deep copy of the same model with the same seed and an Adam optimizer:

- no checkpointing (the baseline),
- Hugging Face every-layer checkpointing (``gradient_checkpointing_enable``, non-reentrant), where
  the model supports it,
- ``torch.utils.checkpoint.checkpoint_sequential`` with sqrt(n) segments (the MLP chain only),
- AutoRemat plans (``profile_step`` + ``solve(cost="flops")``) at budgets of static memory plus
  70/50/30% of the baseline's activation memory, and ``"min"``,
- an AutoRemat plan at the peak that Hugging Face checkpointing reaches (to compare overheads),
- op-level selective checkpointing on every layer, torchtitan-style (``save_matmuls``: matmul and
  attention outputs saved, the rest recomputed), where the model has stages.

Plans are solved for ``--cost`` (default ``flops``); ``--policies`` also offers the op-level
selective-checkpointing options (opt-in, as in the package).

Per configuration: the measured peak of the *second* training step (the first creates Adam's
state) with torch's MemTracker, activation memory (peak minus static memory), FLOP overhead with
FlopCounterMode (recomputation included), roofline overhead (per op max(FLOPs / peak FLOP/s,
bytes / bandwidth), this CPU calibrated), the wall-clock ratio against no checkpointing (median of
interleaved steps), predicted vs measured peak, and planning time. Also: a Pareto plot per model,
and the solver's time on a synthetic 1000-stage profile.

    python benchmarks/run.py                      # everything, about 5-10 minutes on 2 CPU cores
    python benchmarks/run.py --models mlp gpt2 --quick
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import time
import warnings
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_remat import format_bytes  # noqa: E402
from lightning_remat.runtime.installing.apply import apply_plan  # noqa: E402
from lightning_remat.runtime.measuring.measure import count_step_flops, measure_step  # noqa: E402
from lightning_remat.core.memory_model import Costs, Profile, Segment, StageOption, StageProfile  # noqa: E402
from lightning_remat.models import MODEL_NAMES, build  # noqa: E402
from lightning_remat.runtime.profiling.profile import profile_step  # noqa: E402
from lightning_remat.report.plots import pareto_sweep, pyplot  # noqa: E402
from lightning_remat.core.errors import BudgetTooSmallError  # noqa: E402
from lightning_remat.core.solve import least_peak, solve  # noqa: E402
from lightning_remat.core.config import ProfileOptions  # noqa: E402
from lightning_remat.core.plan import Plan, StageAction  # noqa: E402
from lightning_remat.runtime.measuring.roofline import OpRecorder, device_peaks, roofline_seconds  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its own modules, also when imported as benchmarks.run
from pareto_plot import draw_with_peers, plot_with_peers  # noqa: E402

ROOT = Path(__file__).resolve().parent
FRACTIONS = (0.7, 0.5, 0.3)
# Fast steps are timed for more rounds (up to 4x --repeats) until each configuration has this many seconds.
MIN_TIMED_SECONDS = 1.0
# Smaller shapes for --quick (a smoke run in well under a minute per model).
QUICK_KWARGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(batch_size=2, seq_len=64, layers=3, hidden=64),
    "bert": dict(batch_size=2, seq_len=64, layers=3, hidden=64),
    "vit": dict(batch_size=2, image_size=32, layers=3, hidden=64),
    "resnet50": dict(batch_size=2, image_size=32, width=4),
    "llama": dict(batch_size=2, seq_len=64, layers=3, hidden=64),
    "mlp": dict(batch_size=128, depth=9, width=64),
}
FULL_KWARGS: dict[str, dict[str, Any]] = {
    # ResNet-50 at 96x96 takes several seconds per step on 2 cores; 64x64 keeps the run short.
    "resnet50": dict(batch_size=8, image_size=64),
}


@dataclass
class Config:
    """One way of running the model, with what was measured of it."""

    label: str
    kind: str  # baseline | hf | sequential | opsac | autoremat
    model: nn.Module | None = None
    step: Callable[[nn.Module], torch.Tensor] | None = None
    optimizer: torch.optim.Optimizer | None = None
    budget: str = ""
    budget_bytes: int | None = None
    plan: Any = None
    planning_seconds: float | None = None
    error: str = ""
    smallest_peak_bytes: int | None = None
    measured: dict[str, Any] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    same_as: "Config | None" = None  # an identical configuration measured once


class SequentialCheckpointed(nn.Module):
    """Runs an ``nn.Sequential`` through ``checkpoint_sequential`` with ``segments`` segments."""

    def __init__(self, chain: nn.Sequential, segments: int):
        super().__init__()
        self.chain = chain
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint_sequential

        return checkpoint_sequential(self.chain, self.segments, x, use_reentrant=False)


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-4)


def _train_step(config: Config) -> float:
    """One plain training step; returns its wall-clock seconds."""
    model, optimizer = config.model, config.optimizer
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = config.step(model)
    loss.backward()
    optimizer.step()
    del loss
    return time.perf_counter() - start


def count_step_roofline(model: nn.Module, step: Callable[[nn.Module], torch.Tensor]) -> float:
    """Roofline seconds of one forward and backward (recomputation included; ops that selective
    checkpointing serves from its cache do not run, so do not count)."""
    with OpRecorder() as recorder:
        loss = step(model)
        loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    return roofline_seconds(recorder.ops, device_peaks("cpu"))


def _measure(config: Config) -> None:
    """Warm-up step (creates Adam's state), then the measured second step, then FLOPs."""
    torch.manual_seed(0)
    _train_step(config)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = measure_step(config.model, config.step, config.optimizer)
    config.measured = {
        "peak_bytes": m.peak_bytes, "parameter_bytes": m.parameter_bytes, "gradient_bytes": m.gradient_bytes,
        "optimizer_bytes": m.optimizer_bytes, "activation_bytes_at_peak": m.activation_bytes,
        "temporary_bytes_at_peak": m.temporary_bytes,
    }
    torch.manual_seed(0)
    config.measured["flops"] = count_step_flops(config.model, config.step)
    torch.manual_seed(0)
    config.measured["roofline_seconds"] = count_step_roofline(config.model, config.step)
    config.optimizer.zero_grad(set_to_none=True)


def _plan_config(case, profile: Profile, profile_seconds: float, label: str, budget: Any, budget_text: str,
                 cost: str = "flops") -> Config:
    config = Config(label, "autoremat", budget=budget_text)
    start = time.perf_counter()
    try:
        plan = solve(profile, budget, cost=cost)
    except BudgetTooSmallError as err:
        config.error = f"infeasible: smallest reachable peak {format_bytes(err.smallest_peak_bytes)}"
        config.smallest_peak_bytes = err.smallest_peak_bytes
        config.budget_bytes = err.budget_bytes
        config.planning_seconds = profile_seconds + time.perf_counter() - start
        return config
    config.planning_seconds = profile_seconds + time.perf_counter() - start
    config.plan = plan
    config.budget_bytes = plan.budget_bytes
    return config


def _instantiate(config: Config, case, unique: dict[tuple, Config]) -> None:
    """Give an AutoRemat configuration its own model copy, unless an identical plan has one."""
    key = (tuple(sorted(config.plan.checkpointed)), tuple(tuple(s) for s in config.plan.segments),
           tuple(sorted(config.plan.policies.items())))
    if key in unique:
        config.same_as = unique[key]
        return
    unique[key] = config
    config.model = copy.deepcopy(case.model)
    apply_plan(config.model, config.plan)
    config.step = case.step
    config.optimizer = _adam(config.model)


def run_model(name: str, quick: bool, repeats: int, curve_points: int, log: Callable[[str], None],
              cost: str = "roofline", policies: bool = True) -> dict[str, Any]:
    kwargs = (QUICK_KWARGS if quick else FULL_KWARGS).get(name, {})
    started = time.perf_counter()
    case = build(name, seed=0, **kwargs)
    base = case.model

    # Profile and plan on a copy (profiling leaves the model as it was, but keep it separate anyway).
    log(f"[{name}] profiling")
    profiled = copy.deepcopy(base)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = profile_step(profiled, case.step, optimizer=_adam(profiled),
                               options=ProfileOptions(policies=None if policies else ()))
    profile_seconds = time.perf_counter() - start
    del profiled

    baseline = Config("no checkpointing", "baseline", copy.deepcopy(base), case.step)
    baseline.optimizer = _adam(baseline.model)
    configs = [baseline]
    log(f"[{name}] measuring the baseline")
    _measure(baseline)
    static = profile.static_bytes
    baseline_activation = baseline.measured["peak_bytes"] - static

    hf = None
    if case.supports_hf_checkpointing:
        hf = Config("HF every layer", "hf")
        model = copy.deepcopy(base)
        try:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            hf.model, hf.step, hf.optimizer = model, case.step, _adam(model)
        except Exception as err:  # transformers raises ValueError for models without support
            hf.error = f"not supported: {str(err).splitlines()[0]}"
        configs.append(hf)
    seq = None
    if case.sequential is not None and case.sequential is base:
        segments = max(1, round(math.sqrt(len(base))))
        model = copy.deepcopy(base)
        seq = Config(f"checkpoint_sequential ({segments} segments)", "sequential",
                     SequentialCheckpointed(model, segments), case.step)
        seq.optimizer = _adam(seq.model)
        configs.append(seq)
    stage_names = [s.name for s in profile.stages]
    if stage_names:
        # torchtitan's op-level SAC on every layer: matmul and attention outputs saved.
        model = copy.deepcopy(base)
        apply_plan(model, Plan([StageAction.recompute(n, policy="save_matmuls") for n in stage_names], 0, 0, 0, 0.0))
        opsac = Config("op-SAC every layer (save_matmuls)", "opsac", model, case.step)
        opsac.optimizer = _adam(model)
        configs.append(opsac)
    for config in configs[1:]:
        if config.model is not None:
            log(f"[{name}] measuring {config.label}")
            _measure(config)

    ours: list[Config] = []
    for fraction in FRACTIONS:
        budget = int(static + fraction * baseline_activation)
        ours.append(_plan_config(case, profile, profile_seconds, f"AutoRemat {fraction:.0%}", budget,
                                 f"static + {fraction:.0%} of activations", cost))
    ours.append(_plan_config(case, profile, profile_seconds, "AutoRemat min", "min", "min", cost))
    hf_matched = None
    if hf is not None and hf.measured:
        hf_matched = _plan_config(case, profile, profile_seconds, "AutoRemat @ HF peak", hf.measured["peak_bytes"],
                                  "HF's measured peak", cost)
        ours.append(hf_matched)
    seq_matched = []
    if seq is not None and seq.measured:
        # Against checkpoint_sequential: our plan at its measured peak, and our least peak at its
        # FLOP overhead (the smallest budget whose plan costs no more, by bisection on the budget).
        seq_matched.append(_plan_config(case, profile, profile_seconds, "AutoRemat @ sequential peak",
                                        seq.measured["peak_bytes"], "checkpoint_sequential's measured peak"))
        seq_overhead = (seq.measured["flops"] - baseline.measured["flops"]) / baseline.measured["flops"]
        low, high = least_peak(profile), profile.baseline_peak_bytes
        while high - low > max(1, profile.baseline_peak_bytes // 1000):
            middle = (low + high) // 2
            plan = solve(profile, middle, cost="flops")
            low, high = (low, middle) if plan.predicted_overhead <= seq_overhead else (middle, high)
        seq_matched.append(_plan_config(case, profile, profile_seconds, "AutoRemat @ sequential overhead", high,
                                        f"least budget at checkpoint_sequential's FLOP overhead ({seq_overhead:.1%})"))
        ours.extend(seq_matched)
    unique: dict[tuple, Config] = {((), ()): baseline}
    for config in ours:
        if config.plan is not None:
            _instantiate(config, case, unique)
    for config in ours:
        if config.model is not None:
            log(f"[{name}] measuring {config.label} ({len(config.plan.checkpointed)} modules)")
            _measure(config)
    configs.extend(ours)

    # Wall clock: one step of each configuration per round, interleaved, so that load from other
    # work on the machine hits every configuration alike.
    timed = [c for c in configs if c.model is not None]
    log(f"[{name}] timing {len(timed)} configurations, at least {repeats} rounds")
    for config in timed:  # one untimed round: allocator and caches settle after the MemTracker runs
        _train_step(config)
    rounds = 0
    while rounds < repeats or (rounds < 4 * repeats and min(sum(c.times) for c in timed) < MIN_TIMED_SECONDS):
        for config in timed:
            torch.manual_seed(0)
            config.times.append(_train_step(config))
        rounds += 1
        gc.collect()

    base_flops = baseline.measured["flops"]
    base_roofline = baseline.measured["roofline_seconds"]
    base_time = statistics.median(baseline.times)
    rows = []
    for config in configs:
        source = config.same_as or config
        row: dict[str, Any] = {"model": name, "config": config.label, "kind": config.kind, "budget": config.budget,
                               "budget_bytes": config.budget_bytes, "error": config.error,
                               "planning_seconds": config.planning_seconds}
        if config.smallest_peak_bytes is not None:
            row["smallest_peak_bytes"] = config.smallest_peak_bytes
        if source.measured:
            peak = source.measured["peak_bytes"]
            row.update({
                "measured_peak_bytes": peak,
                "activation_bytes": peak - static,
                "activation_fraction": (peak - static) / baseline_activation if baseline_activation else None,
                "flops": source.measured["flops"],
                "flop_overhead": (source.measured["flops"] - base_flops) / base_flops,
                "roofline_overhead": (source.measured["roofline_seconds"] - base_roofline) / base_roofline,
                "step_seconds_median": statistics.median(source.times),
                "wall_ratio": statistics.median(source.times) / base_time,
                "measured": source.measured,
            })
        if config.plan is not None:
            plan = config.plan
            row.update({
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "prediction_error": (plan.predicted_peak_bytes - row["measured_peak_bytes"]) / row["measured_peak_bytes"],
                "predicted_overhead": plan.predicted_overhead,
                "modules": len(plan.checkpointed),
                "checkpointed": plan.checkpointed,
                "segments": plan.segments,
                "options": {c.option: sum(1 for d in plan.choices if d.option == c.option) for c in plan.choices},
                "cost_kind": plan.cost_kind,
            })
        if config.kind == "baseline":
            row["predicted_peak_bytes"] = profile.baseline_peak_bytes
            row["prediction_error"] = (profile.baseline_peak_bytes - row["measured_peak_bytes"]) / row["measured_peak_bytes"]
        rows.append(row)

    hf_check = None
    if hf_matched is not None:
        hf_row = next(r for r in rows if r["kind"] == "hf")
        ours_row = next(r for r in rows if r["config"] == hf_matched.label)
        hf_check = {"hf_peak_bytes": hf_row["measured_peak_bytes"], "hf_flop_overhead": hf_row["flop_overhead"],
                    "hf_roofline_overhead": hf_row["roofline_overhead"],
                    "hf_wall_ratio": hf_row["wall_ratio"], "error": ours_row["error"]}
        if "measured_peak_bytes" in ours_row:
            hf_check.update({
                "ours_peak_bytes": ours_row["measured_peak_bytes"], "ours_predicted_peak_bytes": ours_row["predicted_peak_bytes"],
                "ours_flop_overhead": ours_row["flop_overhead"], "ours_wall_ratio": ours_row["wall_ratio"],
                "ours_roofline_overhead": ours_row["roofline_overhead"],
                "overhead_ok": ours_row["flop_overhead"] <= hf_row["flop_overhead"] + 1e-9,
                "peak_within_1pct": ours_row["measured_peak_bytes"] <= 1.01 * hf_row["measured_peak_bytes"],
            })

    curve = [{"budget_bytes": p.budget_bytes, "predicted_peak_bytes": p.predicted_peak_bytes,
              "predicted_overhead": p.predicted_overhead if p.feasible else None, "modules": p.modules}
             for p in pareto_sweep(profile, curve_points, cost=cost)]
    return {
        "model": name, "kwargs": kwargs, "stages": len(profile.stages),
        "stage_options": sorted({o.name for s in profile.stages for o in s.options}),
        "parameters": sum(p.numel() for p in base.parameters()),
        "static_bytes": static, "baseline_peak_bytes": baseline.measured["peak_bytes"],
        "baseline_activation_bytes": baseline_activation, "baseline_flops": base_flops,
        "baseline_roofline_seconds": base_roofline, "cost": cost, "policies": policies,
        "baseline_step_seconds": base_time, "profile_seconds": profile_seconds,
        "rows": rows, "hf_check": hf_check, "curve": curve, "seconds": time.perf_counter() - started,
    }


# ----------------------------------------------------------------------------------------------
# The solver on a synthetic 1000-stage profile


def synthetic_profile(stages: int = 1000, seed: int = 0, jitter: float = 0.0) -> Profile:
    """A transformer-like chain: 4 options per stage with realistic sizes (MiB activations, GFLOPs).

    Blocks come in four widths (like the resolutions of a CNN or a model with growing layers);
    ``jitter`` varies every stage's numbers randomly by up to that fraction.
    """
    rng = random.Random(seed)
    mib = 2**20
    static = 6 * 2**30
    options_per_group = []
    for width in (1.0, 1.5, 2.0, 3.0):
        saved = int(40 * mib * width)
        flops = int(8e9 * width)
        options_per_group.append([
            # (name, stored, transient during its own backward, recompute FLOPs)
            ("keep", saved, int(0.3 * saved), 0),
            ("whole", int(0.08 * saved), int(1.3 * saved), flops),
            ("attn", int(0.55 * saved), int(0.6 * saved), int(0.35 * flops)),
            ("mlp", int(0.45 * saved), int(0.7 * saved), int(0.6 * flops)),
        ])
    stage_profiles = []
    total_flops = 0
    for i in range(stages):
        group = options_per_group[min(3, 4 * i // stages)]
        options = []
        scale = 1.0 + (rng.uniform(-jitter, jitter) if jitter else 0.0)
        for name, stored, transient, flops in group:
            stored, transient, flops = int(stored * scale), int(transient * scale), int(flops * scale)
            # Gradients accumulate during backward: the later the stage, the more exist already.
            grads = int(2 * 2**30 * (stages - i) / stages)
            action = StageAction(f"layers.{i}") if name == "keep" else StageAction.recompute(
                f"layers.{i}", () if name == "whole" else (f"layers.{i}.{name}",))
            options.append(StageOption(name, action, stored, static + grads + transient,
                                       Costs(float(flops) * 1e-12, flops)))
        total_flops += 3 * group[1][3]
        stage_profiles.append(StageProfile(f"layers.{i}", tuple(options), saved_bytes=options[0].stored_bytes))
    segments = (Segment("head and loss", stages, static + 600 * mib), Segment("optimizer step", 0, int(1.5 * static)))
    profile = Profile(tuple(stage_profiles), segments, parameter_bytes=static // 4, gradient_bytes=static // 4,
                      optimizer_state_bytes=static // 2, baseline_costs=Costs(time=total_flops * 1e-12, flops=total_flops))
    profile = profile.with_baseline()
    return profile


def _time_solve(profile: Profile, budget: Any) -> dict[str, Any]:
    import importlib

    solve_module = importlib.import_module("lightning_remat.core.solve")  # the package's `solve` is the function

    start = time.perf_counter()
    try:
        plan = solve(profile, budget, cost="flops")
    except BudgetTooSmallError as err:
        return {"seconds": time.perf_counter() - start, "infeasible": True, "predicted_overhead": None,
                "smallest_peak_bytes": err.smallest_peak_bytes, "frontier_cap": solve_module.MAX_FRONTIER}
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_overhead": plan.predicted_overhead, "modules": len(plan.checkpointed),
            "frontier_cap": solve_module.MAX_FRONTIER}


def solver_benchmark(stages: int = 1000) -> dict[str, Any]:
    """Time ``solve`` on synthetic profiles; the headline is ``stages`` x 4 options at half the activations."""
    cases: dict[str, Any] = {}

    def run(label: str, profile: Profile, budgets: dict[str, Any]) -> None:
        static = profile.static_bytes
        activation = profile.baseline_peak_bytes - static
        cases[label] = {"stages": len(profile.stages), "options_per_stage": len(profile.stages[0].options),
                        "budgets": {}}
        for name, fraction in budgets.items():
            budget = "min" if fraction == "min" else int(static + fraction * activation)
            cases[label]["budgets"][name] = _time_solve(profile, budget)

    headline = f"{stages} stages x 4 options (4 block widths)"
    run(headline, synthetic_profile(stages), {"static + 50% activations": 0.5, "min": "min"})
    run(f"{stages} stages x 4 options (every stage +-10%)", synthetic_profile(stages, jitter=0.1),
        {"static + 50% activations": 0.5})
    two = synthetic_profile(stages)
    two = dataclasses.replace(two, stages=tuple(StageProfile(s.name, s.options[:2], saved_bytes=s.saved_bytes)
                                                for s in two.stages))
    run(f"{stages} stages x 2 options (keep/whole)", two, {"static + 50% activations": 0.5})
    quarter = max(1, stages // 4)
    run(f"{quarter} stages x 4 options (4 block widths)", synthetic_profile(quarter), {"static + 50% activations": 0.5})
    seconds = [b["seconds"] for b in cases[headline]["budgets"].values()]
    return {"cases": cases, "headline": headline, "headline_max_seconds": max(seconds),
            "under_1_second": max(seconds) < 1.0}


# ----------------------------------------------------------------------------------------------
# Output


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.1%}" if signed else f"{value:.1%}"


TABLE_COLUMNS = ("model", "configuration", "peak MiB", "activations MiB (% of baseline)", "FLOP overhead",
                 "roofline overhead", "wall-clock ratio", "predicted peak MiB (error)", "planning s")


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    out = []
    for model in results["models"].values():
        for row in model["rows"]:
            if row.get("error") and "measured_peak_bytes" not in row:
                out.append([row["model"], row["config"], "-", row["error"], "-", "-", "-", "-",
                            f"{row['planning_seconds']:.1f}" if row.get("planning_seconds") else "-"])
                continue
            activation = f"{_mib(row['activation_bytes'])} ({row['activation_fraction']:.0%})"
            predicted = "-"
            if row.get("predicted_peak_bytes") is not None:
                predicted = f"{_mib(row['predicted_peak_bytes'])} ({row['prediction_error']:+.1%})"
            name = row["config"] + (f" [{row['modules']} mod.]" if "modules" in row else "")
            out.append([row["model"], name, _mib(row["measured_peak_bytes"]), activation, _pct(row["flop_overhead"]),
                        _pct(row.get("roofline_overhead")), f"{row['wall_ratio']:.2f}", predicted,
                        f"{row['planning_seconds']:.1f}" if row.get("planning_seconds") else "-"])
    return out


def markdown(results: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(results)]
    lines.append("")
    lines.append("| model | HF every layer: peak MiB, FLOP / roofline overhead | AutoRemat at HF's peak: peak MiB, "
                 "FLOP / roofline overhead | ours <= HF (FLOPs) |")
    lines.append("|---|---|---|---|")
    for model in results["models"].values():
        check = model.get("hf_check")
        if not check:
            continue
        if "ours_flop_overhead" in check:
            lines.append(f"| {model['model']} | {_mib(check['hf_peak_bytes'])}, {_pct(check['hf_flop_overhead'])} / "
                         f"{_pct(check.get('hf_roofline_overhead'))} | {_mib(check['ours_peak_bytes'])}, "
                         f"{_pct(check['ours_flop_overhead'])} / {_pct(check.get('ours_roofline_overhead'))} | "
                         f"{'yes' if check['overhead_ok'] else 'NO'} |")
        else:
            lines.append(f"| {model['model']} | {_mib(check['hf_peak_bytes'])}, {_pct(check['hf_flop_overhead'])} | "
                         f"{check['error']} | - |")
    solver = results.get("solver")
    if solver:
        lines.append("")
        lines.append("| solver case | budget | seconds | predicted overhead |")
        lines.append("|---|---|---|---|")
        for label, case in solver["cases"].items():
            for budget, c in case["budgets"].items():
                lines.append(f"| {label} | {budget} | {c['seconds']:.2f} | {_pct(c['predicted_overhead'])} |")
    llama = results.get("llama7b_fake")
    if llama:
        lines.append("")
        lines.append("| planned under fake tensors | layers | tokens | seconds | resident GiB | predicted peak GiB "
                     "(parameters, gradients, optimizer state) | modules recomputed |")
        lines.append("|---|---|---|---|---|---|---|")
        gib = 2**30
        lines.append(f"| Llama-2-7B, bf16, AdamW, for an 80 GB H100 (budget 90%) | {llama['layers']} | {llama['tokens']} | "
                     f"{llama['plan_seconds']:.0f} | {llama['max_resident_bytes'] / gib:.2f} | "
                     f"{llama['predicted_peak_bytes'] / gib:.1f} ({llama['parameter_bytes'] / gib:.1f}, "
                     f"{llama['gradient_bytes'] / gib:.1f}, {llama['optimizer_state_bytes'] / gib:.1f}) | "
                     f"{llama['checkpointed']} |")
    return "\n".join(lines) + "\n"


def print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(150, Console().width))
    table = Table(title="lightning-remat benchmark (CPU, Adam, second step)", title_justify="left")
    for column in TABLE_COLUMNS:
        table.add_column(column, justify="left" if column in ("model", "configuration") else "right")
    previous = None
    for row in table_rows(results):
        if previous is not None and row[0] != previous:
            table.add_section()
        previous = row[0]
        table.add_row(*row)
    console.print(table)
    for model in results["models"].values():
        check = model.get("hf_check")
        if check and "ours_flop_overhead" in check:
            verdict = "[green]ours <= HF[/green]" if check["overhead_ok"] else "[red]ours > HF[/red]"
            console.print(f"{model['model']}: at HF's peak {_mib(check['hf_peak_bytes'])} MiB, HF overhead "
                          f"{_pct(check['hf_flop_overhead'])} FLOPs / {_pct(check.get('hf_roofline_overhead'))} roofline, "
                          f"AutoRemat {_pct(check['ours_flop_overhead'])} / {_pct(check.get('ours_roofline_overhead'))} "
                          f"(peak {_mib(check['ours_peak_bytes'])} MiB): {verdict}")
        elif check:
            console.print(f"{model['model']}: at HF's peak: {check['error']}")
    solver = results.get("solver")
    if solver:
        for label, case in solver["cases"].items():
            times = ", ".join(f"{budget}: {c['seconds']:.2f} s" for budget, c in case["budgets"].items())
            console.print(f"solver, {label}: {times}")
        verdict = "[green]yes[/green]" if solver["under_1_second"] else "[red]NO[/red]"
        console.print(f"solver on {solver['headline']} under 1 second: {verdict} "
                      f"({solver['headline_max_seconds']:.2f} s)")


def plot_model(model: dict[str, Any], path: Path) -> Path:
    curve, points, measured = _plot_data(model)
    return plot_with_peers(path, curve, points, measured, model["baseline_peak_bytes"],
                           f"{model['model']}: peak memory vs FLOP overhead")


def _plot_data(model: dict[str, Any]):
    curve = [(c["predicted_peak_bytes"], c["predicted_overhead"] if c["predicted_overhead"] is not None else float("nan"))
             for c in model["curve"]]
    points, measured = [], []
    for row in model["rows"]:
        if "measured_peak_bytes" not in row:
            continue
        item = (row["config"], row["measured_peak_bytes"], row["flop_overhead"])
        if row["kind"] == "autoremat":
            measured.append((row["config"].replace("AutoRemat ", ""), item[1], item[2]))
        else:
            points.append(item)
    return curve, points, measured


def plot_all(results: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    models = list(results["models"].values())
    columns = min(3, len(models))
    rows = math.ceil(len(models) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 4.2 * rows), squeeze=False)
    for ax, model in zip(axes.flat, models):
        curve, points, measured = _plot_data(model)
        draw_with_peers(ax, curve, points, measured, model["baseline_peak_bytes"], "FLOP overhead (%)")
        ax.set_title(model["model"])
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    fig.suptitle("Peak memory vs FLOP overhead (CPU, Adam, measured second step)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def llama7b_fake_plan(layers: int = 32) -> dict[str, Any]:
    """Run examples/plan_llama7b.py in a fresh process: its time, resident memory and plan."""
    import subprocess

    script = ROOT.parent / "examples" / "plan_llama7b.py"
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(script), "--layers", str(layers), "--json"],
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    plan = result["plan"]
    return {"layers": layers, "tokens": result["tokens"], "wall_seconds": time.perf_counter() - start,
            "plan_seconds": result["seconds"], "max_resident_bytes": result["max_resident_bytes"],
            "predicted_peak_bytes": plan["predicted_peak_bytes"], "budget_bytes": plan["budget_bytes"],
            "parameter_bytes": plan["parameter_bytes"], "gradient_bytes": plan["gradient_bytes"],
            "optimizer_state_bytes": plan["optimizer_state_bytes"], "checkpointed": len(plan["checkpointed"]),
            "under_5_minutes": result["seconds"] < 300, "under_2_gib_resident": result["max_resident_bytes"] < 2 * 2**30}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES, metavar="MODEL",
                        help=f"models to run (default: all of {', '.join(MODEL_NAMES)})")
    parser.add_argument("--quick", action="store_true", help="small shapes and 2 timing rounds (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timing rounds (default 5, quick 3; fast steps get more)")
    parser.add_argument("--curve-points", type=int, default=None, help="budgets in the Pareto sweep (default 10, quick 5)")
    parser.add_argument("--solver-stages", type=int, default=1000, help="stages of the synthetic solver benchmark (0: skip)")
    parser.add_argument("--llama7b-layers", type=int, default=32,
                        help="plan Llama-2-7B (this many layers, 1 x 2048 tokens, bf16) for an 80 GB H100 under fake "
                             "tensors, in a fresh process (0: skip)")
    parser.add_argument("--cost", choices=("flops", "roofline", "time"), default="flops",
                        help="what the plans minimise (default flops: deterministic, as the README's table)")
    parser.add_argument("--policies", action="store_true",
                        help="also offer the op-level selective-checkpointing options (opt-in, as in the package)")
    parser.add_argument("--out", type=Path, default=ROOT / "results", help="output folder (default benchmarks/results)")
    parser.add_argument("--copy-to", type=Path, default=None,
                        help="also copy the JSON, the markdown table and the PNGs here (e.g. docs/benchmarks)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    curve_points = args.curve_points or (5 if args.quick else 10)
    args.out.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)

    import transformers

    transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    results: dict[str, Any] = {
        "meta": {
            "command": "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick, "repeats": repeats,
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "platform": platform.platform(),
            "optimizer": "Adam (lr 1e-4)", "measured_step": "second (Adam's state exists)", "cost": args.cost,
            "policies": args.policies,
        },
        "models": {},
    }
    for name in args.models:
        results["models"][name] = run_model(name, args.quick, repeats if not (name == "resnet50" and not args.quick)
                                            else min(repeats, 3), curve_points, log, args.cost, args.policies)
        gc.collect()
    if args.solver_stages:
        log(f"solver on a synthetic {args.solver_stages}-stage profile")
        results["solver"] = solver_benchmark(args.solver_stages)
    if args.llama7b_layers:
        log(f"Llama-2-7B ({args.llama7b_layers} layers) planned under fake tensors for an 80 GB H100")
        results["llama7b_fake"] = llama7b_fake_plan(args.llama7b_layers)
    results["meta"]["seconds"] = time.perf_counter() - started

    json_path = args.out / "results.json"
    json_path.write_text(json.dumps(results, indent=1))
    (args.out / "results.md").write_text(markdown(results))
    pngs = [plot_model(m, args.out / f"pareto_{m['model']}.png") for m in results["models"].values()]
    if len(results["models"]) > 1:
        pngs.append(plot_all(results, args.out / "pareto_all.png"))
    print_table(results)
    print(f"\nwrote {json_path}, {args.out / 'results.md'} and {len(pngs)} plot(s) in {args.out} "
          f"({results['meta']['seconds']:.0f} s)")
    if args.copy_to:
        args.copy_to.mkdir(parents=True, exist_ok=True)
        for path in [json_path, args.out / "results.md", *pngs]:
            shutil.copy(path, args.copy_to / path.name)
        print(f"copied to {args.copy_to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
