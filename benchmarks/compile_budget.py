#!/usr/bin/env python
"""torch.compile's own activation memory budget as a peer (issue 12), on the CPU with inductor.

``torch._functorch.config.activation_memory_budget`` makes AOTAutograd's partitioner recompute
more of the forward in the compiled backward. This compares, for GPT-2 and Llama at the benchmark's
shapes (dropout off: compiled and eager dropout draw different numbers):

- eager, no recomputation; compiled with the default partitioner (budget 1.0);
- compiled with budgets 0.5, 0.2 and 0.05;
- our plans (solved on the eager profile, ``cost="flops"``, at static + 70/50/30% of activations),
  applied and then compiled: the way to use both together;
- the same with op-level policies (``--policies``, ``cost="roofline"``): each policy's decisions
  reach the compiled graph as MUST_SAVE / MUST_RECOMPUTE tags, which the partitioner keeps.

What is measured: the bytes the step saves for backward (distinct storages handed to autograd's
saved-tensor hooks during the forward, parameters left out), and the median wall-clock of a forward
and backward. Not the peak: MemTracker runs the compiled model eagerly (a dispatch mode makes
dynamo fall back) and the CPU profiler records no allocator events here, so no honest peak of a
compiled step exists on this machine. Under compile a checkpointed region is traced into the same
autograd function, so its saved inputs are counted too; eagerly they are not (the checkpoint keeps
them outside the hooks), so eager rows with plans are not shown.

    python benchmarks/compile_budget.py        # about 5 minutes on 2 CPU cores (compiling)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from results_io import RESULTS, log, write_results  # noqa: E402
import torch._functorch.config as functorch_config  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

from lightning_remat import apply_plan, profile_step, solve  # noqa: E402
from lightning_remat.models import build  # noqa: E402

COMPILE_BUDGETS = (0.5, 0.2, 0.05)
FRACTIONS = (0.7, 0.5, 0.3)
# Op-level policies for the rows that give the compiled graph our decisions per op (MUST_SAVE /
# MUST_RECOMPUTE tags, which the partitioner keeps), solved by the roofline cost.
POLICIES = ("save_matmuls", "save_attention")


def saved_bytes(model, step) -> int:
    """Bytes of the distinct storages the forward saves for backward, parameters left out."""
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    seen: dict = {}

    def pack(t):
        key = StorageWeakRef(t.untyped_storage())
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step(model)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def median_seconds(model, step, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step(model).backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(name: str, rounds: int, policies: tuple[str, ...] = ()) -> dict:
    case = build(name, seed=0)
    for module in case.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    rows = []

    def measure(label, model, compiled):
        start = time.perf_counter()
        case.step(model).backward()  # compiles (when compiled) and warms up
        model.zero_grad(set_to_none=True)
        warm = time.perf_counter() - start
        rows.append(dict(config=label, compiled=compiled, saved_bytes=saved_bytes(model, case.step),
                         seconds=median_seconds(model, case.step, rounds), first_step_seconds=warm))
        log(f"[{name}] {label}: {rows[-1]['saved_bytes'] / 2**20:.1f} MiB saved")

    measure("eager, no recomputation", copy.deepcopy(case.model), False)
    for budget in (1.0, *COMPILE_BUDGETS):
        functorch_config.activation_memory_budget = budget
        torch._dynamo.reset()
        label = "compiled" if budget == 1.0 else f"compiled, activation_memory_budget={budget}"
        measure(label, torch.compile(copy.deepcopy(case.model)), True)
    functorch_config.activation_memory_budget = 1.0
    profiled = copy.deepcopy(case.model)
    profile = profile_step(profiled, case.step, optimizer=torch.optim.Adam(profiled.parameters(), lr=1e-4))
    for fraction in FRACTIONS:
        plan = solve(profile, int(profile.static_bytes + fraction * profile.baseline_activation_bytes), cost="flops")
        model = apply_plan(copy.deepcopy(case.model), plan)
        torch._dynamo.reset()
        measure(f"AutoRemat {fraction:.0%} ({len(plan.checkpointed)} modules, +{plan.predicted_overhead:.1%} FLOPs), "
                "compiled", torch.compile(model), True)
    if policies:
        profiled = copy.deepcopy(case.model)
        profile = profile_step(profiled, case.step, optimizer=torch.optim.Adam(profiled.parameters(), lr=1e-4),
                               policies=policies)
        for fraction in FRACTIONS:
            plan = solve(profile, int(profile.static_bytes + fraction * profile.baseline_activation_bytes), cost="roofline")
            model = apply_plan(copy.deepcopy(case.model), plan)
            torch._dynamo.reset()
            measure(f"AutoRemat {fraction:.0%} with policies ({len(plan.policies)} under a policy, "
                    f"{len(plan.checkpointed)} modules, +{plan.predicted_overhead:.1%} roofline), compiled",
                    torch.compile(model), True)
    base = rows[0]
    for row in rows:
        row["saved_fraction"] = row["saved_bytes"] / base["saved_bytes"]
        row["time_ratio"] = row["seconds"] / base["seconds"]
    return dict(model=name, rows=rows)


def table(results: list[dict]) -> str:
    lines = ["| model | configuration | saved for backward (MiB, share of eager) | forward+backward time (x eager) |",
             "|---|---|---|---|"]
    for result in results:
        for r in result["rows"]:
            lines.append(f"| {result['model']} | {r['config']} | {r['saved_bytes'] / 2**20:.1f} ({r['saved_fraction']:.0%}) | "
                         f"{r['time_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--policies", nargs="*", default=list(POLICIES),
                        help="op-level policies for the rows with policies (none: leave them out)")
    args = parser.parse_args(argv)
    results = [run(name, args.rounds, tuple(args.policies)) for name in args.models]
    write_results(args.out, "compile_budget", results, table(results))

if __name__ == "__main__":
    main()
