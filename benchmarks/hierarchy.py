#!/usr/bin/env python
"""Hierarchical candidates on CNNs whose blocks nest (issue 23): least peak with candidates at one
level and with blocks planned whole or through their children, and plans against the usual peers.

Models (random weights, Adam, CPU): transformers' ConvNeXt (depths 2-2-4-2), transformers' bottleneck
ResNet (``resnet50``, the benchmark shape of ``benchmarks/run.py``), and a bottleneck ResNet in
torchvision's layout (a loose stem on the root: ``models.TorchvisionResNet``). Per model, each on its
own copy with the same seed, the second step measured (``benchmarks/run.py``'s ``_measure``:
MemTracker peak, FlopCounterMode FLOPs):

- no checkpointing; every block recomputed (each ConvNeXt layer / bottleneck: per-layer checkpointing);
  sqrt(n) segments (each stage of blocks one checkpoint: 4 segments of 10 or 16 blocks);
- the least peak predicted with the candidates of one level (``find_stages``, passed by hand so no
  block is expanded; for torchvision's layout the bottlenecks alone, as before its loose stem and head
  were stages) and with the automatic, hierarchical candidates (the profile's ``blocks``);
- AutoRemat at static + 50% of the baseline's activations and at ``"min"``: measured peak, predicted
  peak, FLOP overhead, planning time.

Prints a table and writes ``docs/benchmarks/hierarchy.json``.

    python benchmarks/hierarchy.py            # about 5-6 minutes on 2 shared CPU cores
    python benchmarks/hierarchy.py --quick    # smaller shapes
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.run import Config, _adam, _measure  # noqa: E402  (the peers' measurement, shared)

from lightning_remat.core.errors import BudgetTooSmallError  # noqa: E402
from lightning_remat.core.solve import least_peak, solve  # noqa: E402
from lightning_remat.models import build  # noqa: E402
from lightning_remat.runtime.installing.apply import apply_plan  # noqa: E402
from lightning_remat.runtime.profiling.candidates import find_stages  # noqa: E402
from lightning_remat.runtime.profiling.profile import profile_step  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "hierarchy.json"
# (model, shape): the benchmark shapes (resnet50's is benchmarks/run.py's, where Adam's step bounds
# the least peak), and each ResNet at a shape where activations bound it.
CASES = [
    ("convnext", dict(batch_size=16, image_size=64)),
    ("resnet50", dict(batch_size=8, image_size=64)),
    ("resnet50", dict(batch_size=8, image_size=128, width=2)),
    ("tv_resnet", dict(batch_size=8, image_size=64)),
    ("tv_resnet", dict(batch_size=8, image_size=128, width=2)),
]
QUICK = {
    "convnext": dict(batch_size=4, image_size=32, width=4),
    "resnet50": dict(batch_size=2, image_size=32, width=4),
    "tv_resnet": dict(batch_size=2, image_size=32, width=4),
}
# The blocks every-layer checkpointing recomputes, and the stages sqrt(n) segments recompute whole.
LAYERS = {"convnext": "ConvNextLayer", "resnet50": "ResNetBottleNeckLayer", "tv_resnet": "Bottleneck"}
STAGES = {"convnext": "convnext.encoder.stages.*", "resnet50": "resnet.encoder.stages.*", "tv_resnet": "layer?"}
# The candidates before: one level (find_stages's, passed by hand, so nothing is expanded); for
# torchvision's layout, the bottlenecks alone (its loose stem and head were no stages).
BEFORE = {"tv_resnet": "Bottleneck"}


def _profile(case, candidates: Any) -> tuple[Any, float]:
    model = copy.deepcopy(case.model)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = profile_step(model, case.step, optimizer=_adam(model), candidates=candidates)
    return profile, time.perf_counter() - start


def _run(case, label: str, recompute: list[str] | None = None, plan: Any = None) -> Config:
    config = Config(label, "autoremat" if plan is not None else "peer", copy.deepcopy(case.model), case.step)
    if recompute:
        apply_plan(config.model, recompute)
    if plan is not None:
        apply_plan(config.model, plan)
        config.plan = plan
    config.optimizer = _adam(config.model)
    _measure(config)
    return config


def _row(config: Config, baseline: Config, planning: float | None = None) -> dict[str, Any]:
    flops = config.measured["flops"] / baseline.measured["flops"] - 1
    row = {"label": config.label, "measured_peak_bytes": config.measured["peak_bytes"], "flop_overhead": flops}
    if config.plan is not None:
        plan = config.plan
        row.update(budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
                   held=config.measured["peak_bytes"] <= plan.budget_bytes,
                   predicted_error=config.measured["peak_bytes"] / plan.predicted_peak_bytes - 1,
                   recomputed=list(plan.checkpointed), segments=[list(s) for s in plan.segments],
                   planning_seconds=planning)
    return row


def run_model(name: str, shape: dict[str, Any], log) -> dict[str, Any]:
    """Every row of one model at one shape."""
    case = build(name, seed=0, **shape)
    one_level = find_stages(case.model, BEFORE.get(name))
    log(f"[{name} {shape}] profiling (one level)")
    flat, _ = _profile(case, one_level)
    log(f"[{name} {shape}] profiling (hierarchical)")
    deep, seconds = _profile(case, None)
    baseline = _run(case, "no checkpointing")
    modules = dict(case.model.named_modules())
    layers = [n for n, m in modules.items() if type(m).__name__ == LAYERS[name]]
    stages = find_stages(case.model, STAGES[name])
    rows = [_row(baseline, baseline),
            _row(_run(case, f"every block ({len(layers)})", recompute=layers), baseline),
            _row(_run(case, f"sqrt(n) segments ({len(stages)} stages whole)", recompute=stages), baseline)]
    static = deep.static_bytes
    activations = baseline.measured["peak_bytes"] - static
    for label, budget in (("AutoRemat static + 50%", int(static + 0.5 * activations)), ("AutoRemat min", "min")):
        log(f"[{name} {shape}] {label}")
        start = time.perf_counter()
        try:
            plan = solve(deep, budget, cost="flops")
        except BudgetTooSmallError as err:
            rows.append({"label": label, "error": f"infeasible: least peak {err.smallest_peak_bytes}"})
            continue
        rows.append(_row(_run(case, label, plan=plan), baseline, seconds + time.perf_counter() - start))
    return {"model": name, "shape": shape, "static_bytes": static,
            "baseline_activation_bytes": activations,
            "one_level": {"stages": len(flat.stages), "least_peak_bytes": least_peak(flat)},
            "hierarchical": {"stages": len(deep.stages), "blocks": [b for b, _ in deep.blocks],
                             "least_peak_bytes": least_peak(deep), "profile_seconds": seconds},
            "rows": rows}


def print_table(results: list[dict[str, Any]]) -> None:
    mib = 2 ** 20
    for r in results:
        one, deep = r["one_level"], r["hierarchical"]
        print(f"\n{r['model']} {r['shape']}: static {r['static_bytes'] / mib:.1f} MiB, activations "
              f"{r['baseline_activation_bytes'] / mib:.1f} MiB; least peak {one['least_peak_bytes'] / mib:.1f} MiB "
              f"({one['stages']} stages, one level) -> {deep['least_peak_bytes'] / mib:.1f} MiB ({deep['stages']} "
              f"stages, {len(deep['blocks'])} blocks planned through their children)")
        print(f"  {'configuration':38} {'measured':>10} {'FLOPs':>8} {'budget':>10} {'predicted':>10} {'error':>7} held")
        for row in r["rows"]:
            if "error" in row:
                print(f"  {row['label']:38} {row['error']}")
                continue
            line = f"  {row['label']:38} {row['measured_peak_bytes'] / mib:>8.1f}Mi {row['flop_overhead']:>+8.1%}"
            if "predicted_peak_bytes" in row:
                line += (f" {row['budget_bytes'] / mib:>8.1f}Mi {row['predicted_peak_bytes'] / mib:>8.1f}Mi "
                         f"{row['predicted_error']:>+7.2%} {'yes' if row['held'] else 'NO'}")
            print(line)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(QUICK), choices=list(QUICK))
    parser.add_argument("--quick", action="store_true", help="smaller shapes (a smoke run)")
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON goes")
    args = parser.parse_args(argv)
    cases = [(name, QUICK[name]) for name in args.models] if args.quick else [c for c in CASES if c[0] in args.models]
    results = [run_model(name, shape, lambda text: print(text, file=sys.stderr)) for name, shape in cases]
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"quick": args.quick, "models": results}, indent=1) + "\n")
    print(f"written {args.out}")
    return results


if __name__ == "__main__":
    main()
