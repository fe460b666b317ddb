#!/usr/bin/env python
"""Plans that follow the batch's shape (issue 21): a dynamic-padding run, and how well the shape fit predicts.

Part 1, a run: a small GPT-2 (attention dropout: SDPA's math path on the CPU, whose score matrices
grow with the square of the sequence), 12 batches of 4 sequences padded to their longest (32..127
tokens), the longest batch (128 tokens) first at step 8, Adam; budget static + 50% of the activations
of the longest batch. Each step's peak is ``torch.profiler``'s allocation events (planning work
included, ``tests/torch_meter.py``); recomputed FLOPs are counted (``FlopCounterMode``, on the same
step run again outside the measured one) against the same step without the package. Rows:

- ``plan once (first batch)``: what the Accelerate session did before: one plan from the first batch;
- ``per shape``: ``ShapePlans`` (plan_for="shape", the default);
- ``largest so far``: ``ShapePlans(plan_for="largest")``, for torch.compile;
- ``longest, declared``: ``ShapePlans(plan_for="largest", max_shape=(4, 128))``: every step planned
  for the longest batch.

Part 2, the fit: fake-tensor nodes at a grid of shapes, against real profiles at shapes between
them (batch 2..8, sequence 36..120): the interpolation (``chord``, what plans are made on) and the
least-squares law (``law``, for shapes outside the nodes), on every memory term, the baseline peak,
and plans solved on the prediction (their real peak against the budget, their cost against the
optimal plan's).

    python benchmarks/dynamic_shapes.py          # about 3-4 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from results_io import RESULTS, log, write_results  # noqa: E402

from lightning_remat import apply_plan, profile_step, solve  # noqa: E402
from lightning_remat.core.budget import format_bytes  # noqa: E402
from lightning_remat.core.errors import BudgetTooSmallError  # noqa: E402
from lightning_remat.core.predict import predict  # noqa: E402
from lightning_remat.core.shape_fit import ShapeFit  # noqa: E402
from lightning_remat.core.shapes import Shape  # noqa: E402
from lightning_remat.models import build, padded_batches  # noqa: E402
from lightning_remat.runtime.measuring.measure import count_step_flops, preserved_training_state  # noqa: E402
from lightning_remat.runtime.profiling.batch_shape import resize_batch  # noqa: E402
from lightning_remat.service.shape_plans import ShapePlans  # noqa: E402
from tests.torch_meter import TorchPeak  # noqa: E402

SIZES = dict(layers=3, hidden=64, seq_len=128, vocab=128)


def loss_fn(model, batch):
    return model(**batch).loss


def fresh():
    torch.manual_seed(0)
    model = build("gpt2", **SIZES).model
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train(batches, prepare=None) -> dict:
    """One run: per step the peak (planning included), the FLOPs of forward and backward, the loss."""
    model, optimizer = fresh()
    torch.manual_seed(1)
    before = prepare(model, optimizer) if prepare else None
    steps, started = [], time.perf_counter()
    for batch in batches:
        meter = TorchPeak(model, optimizer)
        meter.start()
        planning = time.perf_counter()
        if before is not None:
            before(batch)
        planning = time.perf_counter() - planning
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.append({"shape": list(batch["input_ids"].shape), "peak": meter.stop(), "loss": loss.item(),
                      "planning_s": planning})
        del loss
        # Counted apart: a dispatch mode inside the measured step would change its memory.
        with preserved_training_state(model, optimizer):
            steps[-1]["flops"] = count_step_flops(model, lambda m: loss_fn(m, batch))
    return {"steps": steps, "seconds": time.perf_counter() - started}


def run_rows(batches, budget: int) -> dict:
    """The reference run and one run per way of planning."""
    def plan_once(model, optimizer):
        first = {"done": False}

        def before(batch):
            if not first["done"]:
                apply_plan(model, solve(profile_step(model, lambda m: loss_fn(m, batch), optimizer=optimizer),
                                        budget, "flops"))
                first["done"] = True
        return before

    def shape_plans(**options):
        def prepare(model, optimizer):
            plans = ShapePlans(model, loss_fn, budget, optimizer=optimizer, **options)
            rows_plans[-1] = plans
            return plans.use
        return prepare

    rows_plans: list = [None]
    reference = train(batches)
    rows = {}
    for name, prepare in (("plan once (first batch)", plan_once), ("per shape", shape_plans()),
                          ("largest so far", shape_plans(plan_for="largest")),
                          ("longest, declared", shape_plans(plan_for="largest", max_shape=(4, 128)))):
        log(f"run: {name}")
        rows_plans[-1] = None
        run = train(batches, prepare)
        plans = rows_plans[-1]
        run["counts"] = vars(plans.counts) if plans is not None else {"real_profiles": 1, "fake_profiles": 0,
                                                                       "solves": 1, "installs": 1}
        run["plans"] = {str(k): {"checkpointed": p.checkpointed, "predicted_overhead": p.predicted_overhead,
                                 "how": plans.sources[k]} for k, p in plans.plans.items()} if plans else {}
        rows[name] = run
    return {"reference": reference, "rows": rows}


def _flat_bytes(profile) -> dict:
    """Every byte term of a profile by a readable key (stages' options, segments, static memory)."""
    terms = {f"segment {s.name} ({s.stages_alive})": s.peak_bytes for s in profile.segments}
    for stage in profile.stages:
        for option in stage.options:
            terms[f"{stage.name} {option.name} stored"] = option.stored_bytes
            terms[f"{stage.name} {option.name} local peak"] = option.local_peak_bytes
    return terms


def fit_errors(batch, node_lengths, node_batches, target_lengths, target_batches) -> dict:
    """The shape fit against real profiles: per node set and method, the errors of every term and
    of plans solved on the prediction (budget: static + 50% of that shape's activations)."""
    model, optimizer = fresh()

    def profile(shape, fake):
        stretched = resize_batch(batch, shape)
        return profile_step(model, lambda m: loss_fn(m, stretched), optimizer=optimizer, fake=fake)

    log(f"fit: {len(node_lengths['quarter octave']) * len(node_batches)} fake nodes")
    nodes = {Shape(b, s): profile(Shape(b, s), True) for b in node_batches for s in node_lengths["quarter octave"]}
    log(f"fit: {len(target_lengths) * len(target_batches)} real profiles")
    reals = {Shape(b, s): profile(Shape(b, s), False) for b in target_batches for s in target_lengths}
    results = {}
    for spacing, lengths in node_lengths.items():
        fit = ShapeFit({shape: p for shape, p in nodes.items() if shape.seq_len in lengths})
        for method in ("chord", "law"):
            results[f"{spacing}, {method}"] = [_errors(fit.at(shape, method), real, str(shape))
                                               for shape, real in reals.items()]
    return results


def _errors(predicted, real, shape: str) -> dict:
    activations = real.baseline_peak_bytes - real.static_bytes
    budget = real.static_bytes + activations // 2
    got, want = _flat_bytes(predicted), _flat_bytes(real)
    errors = [(got[k] - want[k]) / activations for k in want if k in got]
    row = {"shape": shape, "baseline": (predicted.baseline_peak_bytes - real.baseline_peak_bytes) / activations,
           "term_max": max(errors), "term_min": min(errors), "plan_real_peak_over": None, "plan_extra_overhead": None}
    try:
        plan, optimal = solve(predicted, budget, "flops"), solve(real, budget, "flops")
    except BudgetTooSmallError:  # no plan reaches half the activations at this shape
        return row
    on_real = predict(real, plan.actions, "flops")
    row.update(plan_real_peak_over=(on_real.peak_bytes - budget) / budget,
               plan_extra_overhead=on_real.overhead - optimal.predicted_overhead)
    return row


def run_table(runs: dict, budget: int) -> str:
    reference = runs["reference"]["steps"]
    longest = None
    lines = [f"Dynamic padding, GPT-2 ({SIZES['layers']} layers, hidden {SIZES['hidden']}), {len(reference)} steps of 4 "
             f"sequences, {len({tuple(s['shape']) for s in reference})} distinct shapes, the longest (4x128) first "
             f"at step 8; budget {format_bytes(budget)} (static + 50% of the longest batch's activations); without "
             f"the package the largest step peaks at {format_bytes(max(s['peak'] for s in reference))}.", "",
             "| run | real profiles | fake profiles | solves | plan changes | max step peak / budget | steps over budget "
             "| recompute GFLOP | recompute / step FLOPs | vs the longest's plan | planning s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in runs["rows"].items():
        steps, counts = run["steps"], run["counts"]
        extra = sum(s["flops"] - r["flops"] for s, r in zip(steps, reference))
        longest = extra if name == "longest, declared" else longest
        lines.append(f"| {name} | {counts['real_profiles']} | {counts['fake_profiles']} | {counts['solves']} | "
                     f"{counts['installs']} | {max(s['peak'] for s in steps) / budget:.3f} | "
                     f"{sum(s['peak'] > budget for s in steps)} | {extra / 1e9:.3f} | "
                     f"{extra / sum(r['flops'] for r in reference):.1%} | {{vs:{name}}} | "
                     f"{sum(s['planning_s'] for s in steps):.1f} |")
    table = "\n".join(lines)
    for name, run in runs["rows"].items():
        extra = sum(s["flops"] - r["flops"] for s, r in zip(run["steps"], reference))
        table = table.replace(f"{{vs:{name}}}", f"{extra / longest:.2f}x" if longest else "-")
    return table


def steps_table(runs: dict, budget: int) -> str:
    lines = ["| step | shape | no package | " + " | ".join(runs["rows"]) + " |",
             "|---|---|---|" + "---|" * len(runs["rows"])]
    for i, ref in enumerate(runs["reference"]["steps"]):
        cells = [f"{run['steps'][i]['peak'] / budget:.3f}" for run in runs["rows"].values()]
        lines.append(f"| {i} | {ref['shape'][0]}x{ref['shape'][1]} | {ref['peak'] / budget:.3f} | " + " | ".join(cells) + " |")
    return "Each step's peak / budget (planning work included):\n\n" + "\n".join(lines)


def fit_table(errors: dict) -> str:
    lines = ["| nodes, method | baseline peak error (of activations): mean / min / max | every term: min / max "
             "| plans over budget (real peak) | worst real peak over budget | plan overhead above optimal: mean / max |",
             "|---|---|---|---|---|---|"]
    for name, rows in errors.items():
        base = [r["baseline"] for r in rows]
        planned = [r for r in rows if r["plan_real_peak_over"] is not None]
        over = [r["plan_real_peak_over"] for r in planned]
        extra = [r["plan_extra_overhead"] for r in planned]
        lines.append(f"| {name} | {sum(base) / len(base):+.2%} / {min(base):+.2%} / {max(base):+.2%} | "
                     f"{min(r['term_min'] for r in rows):+.2%} / {max(r['term_max'] for r in rows):+.2%} | "
                     f"{sum(o > 0 for o in over)} of {len(over)} | {max(over):+.2%} | "
                     f"{sum(extra) / len(extra):+.2%} / {max(extra):+.2%} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--skip-fit", action="store_true", help="only the run (part 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    batches = padded_batches(steps=12, batch_size=4, longest_at=8)
    model, optimizer = fresh()
    longest = profile_step(model, lambda m: loss_fn(m, batches[8]), optimizer=optimizer)
    budget = longest.static_bytes + (longest.baseline_peak_bytes - longest.static_bytes) // 2
    runs = run_rows(batches, budget)
    results = {"budget": budget, "runs": runs}
    table = run_table(runs, budget) + "\n\n" + steps_table(runs, budget)
    if not args.skip_fit:
        errors = fit_errors(batches[0], {"octave": (32, 64, 128), "quarter octave": (32, 40, 48, 56, 64, 80, 96, 112, 128)},
                            (2, 4, 8), (36, 44, 52, 60, 72, 88, 104, 120), (2, 3, 4, 6, 8))
        results["fit"] = errors
        table += ("\n\nThe shape fit against real profiles at 40 shapes between the nodes (batch 2, 3, 4, 6, 8; "
                  "sequence 36..120), nodes on fake tensors at batch 2, 4, 8 and the sequence lengths named:\n\n"
                  + fit_table(errors))
    write_results(args.out, "dynamic_shapes", results, table)


if __name__ == "__main__":
    main()
