"""The subcommands' runs: ``plan`` (profile a factory's step, show where memory goes, plan within a budget, plot) and
``seq-len`` (the longest sequence a factory's step fits in a budget: ``find_remat_seq_len``; the factory returns
``(model, make_step[, optimizer])``, ``make_step(seq_len)`` giving ``step(model) -> loss``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from dataclasses import asdict, fields
from typing import Any, Callable

from ...core.config import ProfileOptions, RematConfig
from ...core.errors import BudgetTooSmallError, RematError, ShardedBudgetTooSmallError, where_it_failed
from ...core.plan import Plan
from ...core.plan_text import per_gpu_breakdown
from ...report.render import PhaseProgress, breakdown_renderables, pareto_table, plan_renderables, print_renderables
from .factory import Target, UsageError, load_factory, normalize

EXIT_OK, EXIT_NO_PLAN, EXIT_USAGE = 0, 1, 2


class ProfilingFailed(RematError):
    """The factory's step failed while it was profiled: exit code 1, one line on stderr."""


def one_line_error(err: BaseException) -> str:
    """An error as the command prints it, on one line."""
    return "lightning-remat: error: " + " ".join(str(err).split())


NO_FLOPS = ("no FLOPs were attributed to the candidate modules (does the step call the model's own forward? "
            "FlopCounterMode names modules from the first one called), so every plan looks free; "
            "use --cost time or call model(...) in the step")


def _config(args: argparse.Namespace) -> RematConfig:
    # Text (--candidates A,B, --policies all) is ProfileOptions' to read, as from Python.
    profile = {f.name: getattr(args, f.name) for f in fields(ProfileOptions)}
    try:
        config = RematConfig(args.budget, cost=args.cost, profile=ProfileOptions(**profile))
    except ValueError as err:
        message = str(err).replace("gpu=, dtype= and precision= apply to fake profiles (fake=True)",
                                   "--gpu, --dtype and --precision apply with --fake").replace(
            "world_size=", "--world-size ").replace("fake=True", "--fake").replace("cost='flops'", "--cost flops")
        if message.startswith("unknown selective-checkpointing policy"):
            message = f"--policies: {message}, or all, or none"
        raise UsageError(message) from err
    if args.gpu is not None:
        from ...core.hardware import gpu

        try:
            gpu(args.gpu)
        except ValueError as err:
            raise UsageError(f"--gpu: {err}") from err
    return config


def _target(args: argparse.Namespace, advance: Callable[[str], None]) -> tuple[Target, str]:
    advance(f"importing {args.target}")
    factory, name = load_factory(args.target)
    advance(f"building the model ({name}())")
    try:
        produced = factory()
    except Exception as err:  # noqa: BLE001
        raise UsageError(f"{name}() raised {type(err).__name__}: {err}") from err
    return normalize(produced, f"{name}()"), name


def _breakdown(args: argparse.Namespace, target: Target, profile: Any) -> Any:
    from ...report.breakdown import breakdown_from_profile, memory_breakdown

    if args.fake:  # nothing real can run: the breakdown comes from the profile alone
        counted_ahead = target.optimizer is not None and not target.optimizer.state
        return breakdown_from_profile(profile, None, counted_ahead, args.top)
    return memory_breakdown(target.model, target.step, target.optimizer, profile=profile, top=args.top, show=False)


def _write_files(args: argparse.Namespace, target: Target, name: str, profile: Any, plan: Plan | None,
                 points: list, advance: Callable[[str], None]) -> dict[str, str]:
    from ...report.plots import pareto_figure, save_figure, timeline_figure
    from ...report.breakdown import memory_timeline

    files: dict[str, str] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.fake:  # a timeline needs a real step
        advance("recording memory over one step")
        timelines = [memory_timeline(target.model, target.step, optimizer=target.optimizer, label="no recomputation")]
        if plan is not None and plan.checkpointed:
            count = len(plan.checkpointed)
            timelines.append(memory_timeline(target.model, target.step, plan, optimizer=target.optimizer,
                                             label=f"plan ({count} module{'s' if count != 1 else ''} recomputed)"))
        files["memory_timeline"] = str(save_figure(timeline_figure(
            timelines, f"{name}: memory over one training step (optimizer state included)",
            plan.budget_bytes if plan is not None else None),
            args.out / "memory_timeline.png"))
    title = f"{name}: predicted peak vs overhead"
    files["pareto"] = str(save_figure(pareto_figure(points, profile.baseline_peak_bytes, args.cost, plan, title=title),
                                      args.out / "pareto.png"))
    if plan is not None:
        (args.out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
        files["plan"] = str(args.out / "plan.json")
    return files


def _show(result: dict[str, Any], breakdown: Any, plan: Plan | None, points: list, cost: str) -> None:
    from rich.console import Console

    console = Console()
    print_renderables(breakdown_renderables(breakdown), console)
    for warning in result["warnings"]:
        Console(stderr=True).print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    if plan is not None:
        print_renderables(plan_renderables(plan), console)
    else:
        print(one_line_error(result["error"]), file=sys.stderr)  # one line, not wrapped by rich
    console.print(pareto_table(points, plan, cost))
    for label, path in result["files"].items():
        console.print(f"wrote {label}: {path}", highlight=False)


def run_plan(args: argparse.Namespace) -> int:
    """The ``plan`` subcommand (``args`` as parsed by the command line)."""
    from ...report.plots import pareto_sweep
    from ...runtime.measuring.measure import model_device
    from ...service.batch_search import flops_unattributed
    from ...service.planning import Planner

    config = _config(args)  # a malformed budget fails before anything heavy is imported
    if args.points < 1 or args.top < 0:
        raise UsageError("--points must be at least 1 and --top at least 0")
    result: dict[str, Any] = {"target": args.target, "budget": args.budget, "cost": args.cost}
    plan = None
    with PhaseProgress(6, enabled=not args.json, delay=0) as advance, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target, name = _target(args, advance)
        try:  # a budget above the device's memory is a usage error, before profiling
            config.budget_bytes(model_device(target.model))
        except ValueError as err:
            raise UsageError(str(err)) from err
        advance("profiling one training step" + (" on fake tensors" if args.fake else ""))
        start = time.perf_counter()
        planner = Planner(config, verbose=False)  # the command's own phases are on the display already
        # Unset, the cost is the target's (the roofline for a GPU of the hardware table): every figure uses it.
        args.cost = result["cost"] = planner.for_model(target.model).cost.value
        try:
            profile = planner.profile(target.model, target.step, target.optimizer)
        except (TypeError, ValueError, RuntimeError) as err:
            if isinstance(err, RematError) and isinstance(err, ValueError):
                # Ours, about what was asked (a candidate that matches nothing): bad input.
                raise UsageError(f"{type(err).__name__}: {err}") from err
            where = getattr(err, "where", None) or where_it_failed(err)
            raise ProfilingFailed(f"profiling {name} failed: {type(err).__name__}: {err}"
                                  + (f" (at {where})" if where and where not in str(err) else "")) from err
        result["profile_seconds"] = time.perf_counter() - start
        result["warnings"] = [NO_FLOPS] if args.cost == "flops" and flops_unattributed(profile) else []
        advance("measuring where memory goes")
        breakdown = _breakdown(args, target, profile)
        advance("solving")
        try:
            plan = planner.solve_or_advise(target.model, target.step, target.optimizer, profile)
        except BudgetTooSmallError as err:
            result.update(error=str(err), smallest_peak_bytes=err.smallest_peak_bytes, knobs=err.knobs)
            if isinstance(err, ShardedBudgetTooSmallError):
                result.update(world_size=err.world_size, smallest_world_size=err.smallest_world_size)
        except RematError as err:  # the host memory cannot hold what the budget needs offloaded
            result.update(error=str(err))
        points = pareto_sweep(profile, args.points, cost=args.cost)
        files = {} if args.no_plots else _write_files(args, target, name, profile, plan, points, advance)
    import torch

    result.update({
        "device": profile.device, "breakdown": breakdown.to_dict(), "plan": plan.to_dict() if plan is not None else None,
        "binding": plan.binding if plan is not None else None,
        "per_gpu": per_gpu_breakdown(plan) if plan is not None else {},
        # An infeasible budget's overhead is NaN, which JSON has not: null.
        "pareto": [{**asdict(p), "predicted_overhead": None if math.isnan(p.predicted_overhead)
                    else p.predicted_overhead} for p in points],
        "files": files, "torch": torch.__version__,
    })
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _show(result, breakdown, plan, points, args.cost)
    return EXIT_OK if plan is not None else EXIT_NO_PLAN


def run_seq_len(args: argparse.Namespace) -> int:
    """The ``seq-len`` subcommand: search, then print the answer, what binds and the lengths profiled."""
    from ...service.seq_len import find_remat_seq_len

    config = _config(args)  # a malformed flag fails before anything heavy runs
    if config.budget.is_min:
        raise UsageError('--budget is required for seq-len: a size such as "80GB" or "80%" ("min" has no longest length)')
    target, _ = _target(args, lambda _: None)
    options = {k: v for k, v in asdict(config.profile).items() if k != "warmup"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = find_remat_seq_len(target.model, target.step, args.budget, optimizer=target.optimizer,
                                        init_val=args.init_val, max_seq_len=args.max_seq_len,
                                        multiple_of=args.multiple_of, max_overhead=args.max_overhead, cost=args.cost,
                                        max_profiles=args.max_profiles, advice=args.advice, apply=False, verbose=not args.json, **options)
        except BudgetTooSmallError as err:
            print(json.dumps({"error": str(err)}) if args.json else one_line_error(err),
                  file=sys.stdout if args.json else sys.stderr)
            return EXIT_NO_PLAN
        except (TypeError, ValueError) as err:
            raise UsageError(f"{type(err).__name__}: {err}") from err
    if args.json:
        print(json.dumps(_as_json(result), indent=1))
    else:
        print(result.summary())
    return EXIT_OK


def _as_json(result: Any) -> dict[str, Any]:
    return {"seq_len": result.seq_len, "first_failing": result.first_failing, "budget_bytes": result.budget_bytes,
            "predicted_peak_bytes": result.plan.predicted_peak_bytes, "predicted_overhead": result.predicted_overhead,
            "measured_peak_bytes": result.measured_peak_bytes, "binding": result.binding,
            "failing_binding": result.failing_binding, "failing_knobs": result.failing_knobs, "tried": [asdict(r) for r in result.tried],
            "plan": result.plan.to_dict(), "seconds": result.seconds, "notes": result.notes}
