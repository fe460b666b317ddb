#!/usr/bin/env python
"""Which cost agrees with measured wall-clock: "time", "flops" or "roofline"? (issue 12)

For each model (the benchmark's shapes, CPU, Adam), one profile gives every cost kind. Plans are
solved for a sweep of budgets under each kind; every distinct plan is applied to a copy of the model
and timed against the plain model, one step of each per round, interleaved, so that load from other
work hits all alike (median of the rounds). For each cost kind: how well its predicted overhead
ranks and matches the measured wall-clock overhead over all plans (Spearman's rank correlation; mean
absolute error in percentage points), and, for "time", whether a second profile of the same model
chooses the same plans (measured seconds are noisy; the other kinds are deterministic).

    python benchmarks/cost_agreement.py                 # 6-8 minutes on 2 CPU cores
    python benchmarks/cost_agreement.py --models gpt2 --rounds 5

Writes benchmarks/results/cost_agreement.json and .md and prints the table.
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

from lightning_remat import BudgetTooSmallError, apply_plan, profile_step, solve  # noqa: E402
from lightning_remat.core.spans import plan_cost_spans  # noqa: E402
from lightning_remat.models import build  # noqa: E402

KINDS = ("time", "flops", "roofline")
FRACTIONS = (0.85, 0.7, 0.55, 0.4, 0.25)


def _plan_key(plan) -> tuple:
    return (tuple(sorted(plan.checkpointed)), tuple(tuple(s) for s in plan.segments),
            tuple(sorted(plan.policies.items())))


def plan_overhead(profile, plan, kind: str) -> float:
    """The plan's predicted overhead under cost ``kind``, priced as the solver prices it
    (``core.spans.plan_cost_spans``: a segment costs its stages' "whole" options)."""
    names = [s.name for s in profile.stages]
    choices, spans = [], set()
    for stage, choice in zip(profile.stages, plan.choices):
        if choice.option.startswith("segment "):
            first, last = choice.option[len("segment "):].split("..")
            spans.add((names.index(first), names.index(last)))
            choices.append(0)
        else:
            choices.append([o.name for o in stage.options].index(choice.option))
    return plan_cost_spans(profile, choices, kind, sorted(spans)) / profile.baseline_costs[kind]


def predicted_overheads(profile, plan) -> dict[str, float]:
    """The plan's overhead under every cost kind."""
    return {kind: plan_overhead(profile, plan, kind) for kind in KINDS}


def _plans(profile) -> dict[tuple, object]:
    budgets = [int(profile.static_bytes + f * profile.baseline_activation_bytes) for f in FRACTIONS] + ["min"]
    plans = {}
    for kind in KINDS:
        for budget in budgets:
            try:
                plan = solve(profile, budget, cost=kind)
            except BudgetTooSmallError:
                continue
            if plan.checkpointed or plan.segments:
                plans.setdefault(_plan_key(plan), plan)
    return plans


def _step(model, optimizer, step) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    step(model).backward()
    optimizer.step()
    return time.perf_counter() - start


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties share their mean rank)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else float("nan")


def run(name: str, rounds: int) -> dict:
    case = build(name, seed=0)
    profiles = []
    for _ in range(2):  # the second profile: does "time" choose the same plans again?
        copied = copy.deepcopy(case.model)
        profiles.append(profile_step(copied, case.step, optimizer=torch.optim.Adam(copied.parameters(), lr=1e-4)))
    profile = profiles[0]
    plans = _plans(profile)
    again = {kind: [] for kind in KINDS}
    for kind in KINDS:
        for f in FRACTIONS:
            budget = int(profile.static_bytes + f * profile.baseline_activation_bytes)
            try:
                first, second = (solve(p, budget, cost=kind) for p in profiles)
            except BudgetTooSmallError:
                continue
            again[kind].append(_plan_key(first) == _plan_key(second))
    log(f"[{name}] {len(plans)} distinct plans; timing {rounds} rounds")
    configs = [("no recomputation", None, copy.deepcopy(case.model))]
    for key, plan in plans.items():
        model = copy.deepcopy(case.model)
        apply_plan(model, plan)
        configs.append((key, plan, model))
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-4) for _, _, m in configs]
    times = [[] for _ in configs]
    for r in range(rounds + 1):
        for i, (_, _, model) in enumerate(configs):
            torch.manual_seed(0)
            seconds = _step(model, optimizers[i], case.step)
            if r:  # the first round warms up (Adam's state, caches)
                times[i].append(seconds)
    base = statistics.median(times[0])
    rows = []
    for (key, plan, _), t in zip(configs[1:], times[1:]):
        rows.append(dict(modules=len(plan.checkpointed), segments=len(plan.segments),
                         measured=statistics.median(t) / base - 1, predicted=predicted_overheads(profile, plan)))
    measured = [r["measured"] for r in rows]
    agreement = {}
    for kind in KINDS:
        predicted = [r["predicted"][kind] for r in rows]
        agreement[kind] = dict(
            spearman=spearman(predicted, measured) if len(rows) > 2 else None,
            mean_abs_error=statistics.fmean(abs(p - m) for p, m in zip(predicted, measured)) if rows else None,
            same_plans_on_a_second_profile=f"{sum(again[kind])}/{len(again[kind])}")
    return dict(model=name, plans=len(rows), base_step_seconds=base, rows=rows, agreement=agreement)


def table(results: list[dict]) -> str:
    lines = ["| model | plans | cost | rank correlation with wall-clock | mean abs. error (points) | same plans on a second profile |",
             "|---|---|---|---|---|---|"]
    for result in results:
        for kind, a in result["agreement"].items():
            rho = "-" if a["spearman"] is None else f"{a['spearman']:.2f}"
            mae = "-" if a["mean_abs_error"] is None else f"{a['mean_abs_error'] * 100:.1f}"
            lines.append(f"| {result['model']} | {result['plans']} | {kind} | {rho} | {mae} | "
                         f"{a['same_plans_on_a_second_profile']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "bert", "vit", "llama", "mlp"])
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (one step of every plan each)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    results = [run(name, args.rounds) for name in args.models]
    write_results(args.out, "cost_agreement", results, table(results))

if __name__ == "__main__":
    main()
