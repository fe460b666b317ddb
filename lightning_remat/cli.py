"""The ``lightning-remat`` command line: where does my memory go, and what would a budget cost?

    lightning-remat plan examples/factories.py:gpt2 --budget 200MB
    lightning-remat plan train.py:make_model --budget 80% --cost flops --out report/
    lightning-remat plan train.py:make_model --budget min --json > plan.json
    lightning-remat plan examples/factories.py:llama7b --fake --device cuda --device-memory 80GB --budget 90% --gpu h100

``FILE.py:FACTORY`` names a function in a Python file that takes no arguments and returns one of

- ``(model, step)``: ``step(model)`` runs a forward pass on a representative batch and returns the
  scalar loss (the command runs backward itself);
- ``(model, step, optimizer)``: the optimizer's state counts in the budget (Adam: two tensors the
  size of each parameter, counted before its first step too);
- ``(lightning_module, batch)``: the step is ``lightning_module.training_step(batch, 0)`` (its
  loss, or ``["loss"]`` of the dict it returns); the optimizer from ``configure_optimizers()``.

The command profiles one training step, prints where the memory goes (parameters, gradients,
optimizer state, activations, temporaries, the blocks that save the most), the least-cost plan
within ``--budget`` and a table of budgets from the least reachable peak to no recomputation, and
writes plots (memory over one step before and after the plan, peak against overhead) and the plan
as JSON to ``--out``.

The budget is the peak memory of a whole training step, in the forms of ``parse_budget``: "10GB",
"512MiB", a number of bytes, "min", or a percentage, which is a percentage of the device's total
memory (for a model on the CPU, the host's RAM), as everywhere in lightning-remat.

Exit codes: 0 success; 1 the budget cannot be met (the smallest reachable peak is printed) or the
step failed while profiling; 2 a usage error (missing file or factory, a factory that raises or
returns something else, a malformed budget).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from .budget import format_bytes, parse_budget

EXIT_OK, EXIT_NO_PLAN, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A mistake in the command line or the factory; printed without a traceback, exit code 2.

    Example:
        >>> str(UsageError("no such file"))
        'no such file'
    """


@dataclass
class Target:
    """What a factory gave: the model, its step and (optionally) its optimizer.

    Example:
        >>> Target(model=None, step=None).optimizer is None
        True
    """

    model: Any
    step: Callable[[Any], Any]
    optimizer: Any = None
    kind: str = "model"


def _lightning_optimizer(module: Any) -> Any:
    """The first optimizer ``configure_optimizers()`` returns, or None if there is none to find."""
    import torch

    try:
        configured = module.configure_optimizers()
    except Exception:  # noqa: BLE001 - some need a trainer; the plan is then made without optimizer state
        return None
    for _ in range(3):
        if isinstance(configured, torch.optim.Optimizer):
            return configured
        if isinstance(configured, dict):
            configured = configured.get("optimizer")
        elif isinstance(configured, (list, tuple)) and configured:
            configured = configured[0]
        else:
            return None
    return configured if isinstance(configured, torch.optim.Optimizer) else None


def normalize(result: Any, name: str = "factory") -> Target:
    """Turn what a factory returned into a ``Target``; raise ``UsageError`` for anything else.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 1)
        >>> normalize((net, lambda m: m(torch.ones(1, 2)).sum())).kind
        'model'
        >>> normalize(net)
        Traceback (most recent call last):
        ...
        lightning_remat.cli.UsageError: factory returned a Linear; expected (model, step), (model, step, optimizer) or (lightning_module, batch)
    """
    from torch import nn

    expected = "expected (model, step), (model, step, optimizer) or (lightning_module, batch)"
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise UsageError(f"{name} returned a {type(result).__name__}; {expected}")
    model = result[0]
    if not isinstance(model, nn.Module):
        raise UsageError(f"{name} returned a {type(model).__name__} as the model; {expected}")
    if len(result) == 2 and not callable(result[1]) and hasattr(model, "training_step"):
        batch = result[1]
        from .lightning_step import training_step_closure

        return Target(model, training_step_closure(model, batch), _lightning_optimizer(model), "lightning")
    if not callable(result[1]):
        raise UsageError(f"{name} returned a {type(result[1]).__name__} as the step, which is not callable; {expected}")
    optimizer = result[2] if len(result) == 3 else None
    if optimizer is not None:
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(f"{name} returned a {type(optimizer).__name__} as the optimizer; {expected}")
    return Target(model, result[1], optimizer)


def load_factory(spec: str) -> tuple[Callable[[], Any], str]:
    """Import ``FILE.py:FACTORY`` and return the factory and a display name; ``UsageError`` if not found.

    Example:
        >>> load_factory("no/such/file.py:make")
        Traceback (most recent call last):
        ...
        lightning_remat.cli.UsageError: file not found: no/such/file.py
    """
    if ":" not in spec:
        raise UsageError(f"expected FILE.py:FACTORY (for example examples/factories.py:gpt2), got {spec!r}")
    file, factory_name = spec.rsplit(":", 1)
    path = Path(file)
    if not path.is_file():
        raise UsageError(f"file not found: {file}")
    if not factory_name.isidentifier():
        raise UsageError(f"{factory_name!r} is not a function name (expected FILE.py:FACTORY)")
    module_name = f"_lightning_remat_factory_{abs(hash(str(path.resolve())))}"
    spec_obj = importlib.util.spec_from_file_location(module_name, path)
    if spec_obj is None or spec_obj.loader is None:
        raise UsageError(f"cannot import {file} as a Python file")
    module = importlib.util.module_from_spec(spec_obj)
    sys.modules[module_name] = module
    # The factory's own imports of files next to it should work as when it is run as a script.
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec_obj.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - reported to the user as a usage error
        raise UsageError(f"importing {file} failed: {type(err).__name__}: {err}") from err
    factory = getattr(module, factory_name, None)
    if factory is None or not callable(factory):
        found = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module_name)
        what = "no function" if factory is None else "a non-callable"
        raise UsageError(f"{file} has {what} {factory_name!r}; functions defined there: {', '.join(found) or 'none'}")
    return factory, f"{file}:{factory_name}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-remat",
        description="Plan activation recomputation (gradient checkpointing) to fit a training step in a memory budget.")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser(
        "plan", help="profile a training step, show where memory goes and the least-cost plan within a budget",
        description=__doc__.split("\n\n")[2] if __doc__ else None, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("target", metavar="FILE.py:FACTORY",
                      help="a function returning (model, step), (model, step, optimizer) or (lightning_module, batch)")
    plan.add_argument("--budget", default="min",
                      help="peak memory of a training step: 10GB, 512MiB, bytes, min, or a percentage of the device's "
                           "total memory (the host's RAM on CPU). Default: min")
    plan.add_argument("--cost", choices=("time", "flops"), default="time",
                      help="price recomputation by measured seconds (time) or counted FLOPs (flops). Default: time")
    plan.add_argument("--out", type=Path, default=Path("remat-report"),
                      help="folder for the plots and plan.json. Default: ./remat-report")
    plan.add_argument("--no-plots", action="store_true", help="write no files")
    plan.add_argument("--points", type=int, default=10, help="budgets in the table from least peak to baseline. Default: 10")
    plan.add_argument("--top", type=int, default=10, help="blocks to list by saved activation bytes. Default: 10")
    plan.add_argument("--json", action="store_true", help="print machine-readable JSON only (no tables, no progress)")
    target = plan.add_argument_group(
        "planning without the hardware",
        "profile on fake tensors (no memory, nothing real runs): a model larger than this machine, a GPU not here")
    target.add_argument("--fake", action="store_true", help="profile under fake tensors; costs are counted FLOPs")
    target.add_argument("--device", default=None, help='the device to plan for, e.g. "cuda" (default: the model\'s)')
    target.add_argument("--device-memory", default=None,
                        help='the target device\'s total memory, e.g. "80GB": percentages refer to it')
    target.add_argument("--gpu", default=None, help="a GPU name (h100, a100, l4, ...) to price FLOPs in seconds")
    target.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="with --fake, the dtype floating-point parameters train in")
    return parser


def _finite(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr; yields ``advance(description)`` for each phase."""
    if not enabled:
        yield lambda description: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    phases = 6
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("starting", total=phases)
        first = [True]

        def advance(description: str) -> None:
            if not first[0]:
                progress.advance(task)
            first[0] = False
            progress.update(task, description=description)

        yield advance
        progress.update(task, completed=phases)


def _pareto_table(points: Sequence[Any], chosen: Any, cost: str) -> Any:
    from rich.table import Table

    table = Table(title=f"Budgets from the least reachable peak to no recomputation (predicted, cost: {cost})",
                  title_justify="left")
    for column in ("budget", "predicted peak", "overhead", "modules recomputed"):
        table.add_column(column, justify="right")
    for p in points:
        overhead = f"{p.predicted_overhead:.1%}" if p.feasible else "infeasible"
        style = "bold" if chosen is not None and p.predicted_peak_bytes == chosen.predicted_peak_bytes else None
        table.add_row(format_bytes(p.budget_bytes), format_bytes(p.predicted_peak_bytes), overhead, str(p.modules), style=style)
    return table


def _profile_warnings(profile: Any, cost: str) -> list[str]:
    found = []
    recomputing = [o for s in profile.stages for o in s.options if o.checkpointed]
    if cost == "flops" and profile.baseline_step_flops and recomputing and not any(o.cost_flops for o in recomputing):
        found.append("no FLOPs were attributed to the candidate modules (does the step call the model's own forward? "
                     "FlopCounterMode names modules from the first one called), so every plan looks free; "
                     "use --cost time or call model(...) in the step")
    return found


def run_plan(args: argparse.Namespace) -> int:
    """The ``plan`` subcommand (``args`` as parsed by the command line)."""
    from rich.console import Console

    try:
        parse_budget(args.budget)  # fail on a malformed budget before importing anything heavy
    except ValueError as err:
        raise UsageError(str(err)) from err
    if args.points < 1 or args.top < 0:
        raise UsageError("--points must be at least 1 and --top at least 0")
    console = Console()
    result: dict[str, Any] = {"target": args.target, "budget": args.budget, "cost": args.cost}
    exit_code = EXIT_OK
    with _progress(not args.json) as advance, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        advance(f"importing {args.target}")
        factory, name = load_factory(args.target)
        advance(f"building the model ({name}())")
        try:
            produced = factory()
        except Exception as err:  # noqa: BLE001
            raise UsageError(f"{name}() raised {type(err).__name__}: {err}") from err
        target = normalize(produced, f"{name}()")

        import torch

        from .measure import model_device
        from .profile import profile_step
        from .report import (breakdown_from_profile, memory_breakdown, memory_timeline, pareto_sweep, plot_memory_timeline,
                             plot_pareto)
        from .solve import BudgetTooSmallError, solve

        if not args.fake and (args.gpu or args.dtype):
            raise UsageError("--gpu and --dtype apply with --fake")
        if args.fake and args.cost == "time" and not args.gpu:
            raise UsageError("a fake profile has no timings: use --cost flops, or name a --gpu to price FLOPs")
        try:
            budget = parse_budget(args.budget, device=args.device or model_device(target.model),
                                  total_memory=args.device_memory)
        except ValueError as err:
            raise UsageError(str(err)) from err
        advance("profiling one training step" + (" on fake tensors" if args.fake else ""))
        start = time.perf_counter()
        try:
            profile = profile_step(target.model, target.step, optimizer=target.optimizer, fake=args.fake,
                                   dtype=getattr(torch, args.dtype) if args.dtype else None,
                                   device=args.device, gpu=args.gpu)
        except (TypeError, ValueError, RuntimeError) as err:
            console_err = Console(stderr=True)
            console_err.print(f"[red]error:[/red] profiling {name} failed: {type(err).__name__}: {err}", highlight=False)
            return EXIT_NO_PLAN
        result["profile_seconds"] = time.perf_counter() - start
        result["warnings"] = _profile_warnings(profile, args.cost)
        advance("measuring where memory goes")
        if args.fake:
            # Nothing real can run: the breakdown comes from the profile alone.
            breakdown = breakdown_from_profile(profile, None, target.optimizer is not None and not target.optimizer.state,
                                               args.top)
        else:
            breakdown = memory_breakdown(target.model, target.step, target.optimizer, profile=profile, top=args.top,
                                         show=False)
        advance("solving")
        plan = None
        try:
            plan = solve(profile, budget, cost=args.cost)
            plan.requested_budget = args.budget
        except BudgetTooSmallError as err:
            result["error"] = str(err)
            result["smallest_peak_bytes"] = err.smallest_peak_bytes
            exit_code = EXIT_NO_PLAN
        points = pareto_sweep(profile, args.points, cost=args.cost)
        plots: dict[str, str] = {}
        if not args.no_plots:
            args.out.mkdir(parents=True, exist_ok=True)
            if not args.fake:  # a timeline needs a real step
                advance("recording memory over one step")
                before = memory_timeline(target.model, target.step, optimizer=target.optimizer, label="no recomputation")
                timelines = [before]
                if plan is not None and plan.checkpointed:
                    timelines.append(memory_timeline(target.model, target.step, plan, optimizer=target.optimizer,
                                                     label=f"plan ({len(plan.checkpointed)} modules recomputed)"))
                plots["memory_timeline"] = str(plot_memory_timeline(
                    timelines, args.out / "memory_timeline.png",
                    title=f"{name}: memory over one forward and backward pass"))
            unit = "time overhead (%)" if args.cost == "time" else "FLOP overhead (%)"
            chosen = [("plan", plan.predicted_peak_bytes, plan.predicted_overhead)] if plan is not None else []
            plots["pareto"] = str(plot_pareto(
                args.out / "pareto.png", [(p.predicted_peak_bytes, p.predicted_overhead) for p in points if p.feasible],
                measured=chosen, baseline_peak_bytes=profile.baseline_peak_bytes, overhead_label=unit,
                title=f"{name}: predicted peak vs overhead"))
            if plan is not None:
                (args.out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
                plots["plan"] = str(args.out / "plan.json")
        advance("done")

    result.update({
        "device": profile.device,
        "breakdown": breakdown.to_dict(),
        "plan": plan.to_dict() if plan is not None else None,
        "pareto": [{"budget_bytes": p.budget_bytes, "predicted_peak_bytes": p.predicted_peak_bytes,
                    "predicted_overhead": _finite(p.predicted_overhead), "modules": p.modules, "feasible": p.feasible}
                   for p in points],
        "files": plots,
        "torch": torch.__version__,
    })
    if args.json:
        print(json.dumps(result, indent=1))
        return exit_code
    breakdown.print(console)
    for warning in result["warnings"]:
        Console(stderr=True).print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    if plan is not None:
        console.print(plan.summary(), highlight=False)
    else:
        console.print(f"[red]error:[/red] {result['error']}", highlight=False)
    console.print(_pareto_table(points, plan, args.cost))
    for label, path in plots.items():
        console.print(f"wrote {label}: {path}", highlight=False)
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-remat``; returns the exit code (0 ok, 1 no plan fits, 2 usage error).

    Example:
        >>> main(["plan", "missing.py:factory", "--json"])
        2
    """
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        if args.command == "plan":
            return run_plan(args)
    except UsageError as err:
        print(f"lightning-remat: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("lightning-remat: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
