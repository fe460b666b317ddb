"""Multi-stage segments: the MLP chain against checkpoint_sequential, and ResNet-50's least peak.

Measured peaks (MemTracker, the second step, Adam state alive) and counted FLOPs, for:
- mlp: no recomputation; ``checkpoint_sequential`` with sqrt(n) segments; our least peak with and
  without segments; our least peak at checkpoint_sequential's FLOP overhead; our plan at its peak;
  the same with the op-level selective-checkpointing policies offered too (``policies=None``), at
  its FLOP and at its roofline overhead (FlopCounterMode counts matmuls only, so a policy that
  recomputes GELU and LayerNorm costs ~0 FLOPs; the roofline prices their memory traffic).
Every plan's roofline overhead is the profile's (checkpoint_sequential's: its plan as our segments).
- resnet50: our least peak with and without segments: the activation memory cut and its overhead.

    python benchmarks/segments.py [--quick] [--models mlp resnet50]

Writes benchmarks/results/segments.json and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from lightning_remat.core.config import ProfileOptions  # noqa: E402
from lightning_remat.core.errors import BudgetTooSmallError  # noqa: E402
from lightning_remat.core.solve import least_peak, plan_from_choices, solve  # noqa: E402
from lightning_remat.models import build  # noqa: E402
from lightning_remat.runtime.installing.apply import apply_plan  # noqa: E402
from lightning_remat.runtime.measuring.measure import count_step_flops, measure_step  # noqa: E402
from lightning_remat.runtime.profiling.profile import profile_step  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_agreement import plan_overhead  # noqa: E402
from run import SequentialCheckpointed  # noqa: E402

# ResNet-50 at ImageNet's 224 px, Feng & Huang's setting: at 64 px Adam's step temporaries are
# half the activation memory and bound every plan (docs/segments.md).
KWARGS = {"mlp": {}, "resnet50": dict(batch_size=8, image_size=224), "tv_resnet": dict(batch_size=8, image_size=224)}
FENG_HUANG_CUT = 0.63  # ResNet-50's activation memory cut by Feng & Huang (CVPR 2021), at 31% time
QUICK = {"mlp": dict(batch_size=128, depth=16, width=64), "resnet50": dict(batch_size=4, image_size=32, width=4),
         "tv_resnet": dict(batch_size=4, image_size=32, width=4)}
MIB = 2 ** 20


def _measure(model, step):
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(1):  # creates Adam's state
        torch.manual_seed(0)
        step(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peak = measure_step(model, step, opt).peak_bytes
    torch.manual_seed(0)
    flops = count_step_flops(model, step)
    start = time.perf_counter()
    for _ in range(2):
        step(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return peak, flops, (time.perf_counter() - start) / 2


def _forward_backward_peak(model, step):
    """MemTracker's peak of forward and backward alone, Adam's state alive but its step not run:
    the activation memory Feng & Huang count, without the optimizer step's own temporaries."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    torch.manual_seed(0)
    step(model).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    opt.step = lambda *args, **kwargs: None  # the state stays tracked; nothing is updated
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return measure_step(model, step, opt).peak_bytes


def _plan_row(label, case, plan, base, profile):
    model = copy.deepcopy(case.model)
    apply_plan(model, plan)
    peak, flops, seconds = _measure(model, case.step)
    return dict(config=label, peak=peak, fb_peak=_forward_backward_peak(model, case.step), predicted=plan.predicted_peak_bytes, flop_overhead=flops / base["flops"] - 1,
                predicted_overhead=plan.predicted_overhead, roofline_overhead=plan_overhead(profile, plan, "roofline"),
                seconds=seconds, segments=[len(s) for s in plan.segments], alone=len(plan.checkpointed),
                policies=len(plan.policies))


def _least_peak_within(profile, overhead, cost):
    """Our least predicted peak whose ``cost`` overhead is at most ``overhead`` (bisection on the budget)."""
    low, high = least_peak(profile), profile.baseline_peak_bytes
    while high - low > max(1, profile.baseline_peak_bytes // 2000):
        middle = (low + high) // 2
        # FLOP counts are integers, the overheads their ratios: equal counts can differ in the
        # last bit (58.53 MiB at +22.38% was missed for that), hence the tolerance.
        fits = solve(profile, middle, cost=cost).predicted_overhead <= overhead + 1e-9
        low, high = (low, middle) if fits else (middle, high)
    return solve(profile, high, cost=cost)


def _gradient_error(case, plan):
    """The largest difference between the plan's gradients and the plain model's, one step from the same weights."""
    plain, planned = copy.deepcopy(case.model), copy.deepcopy(case.model)
    apply_plan(planned, plan)
    for model in (plain, planned):
        torch.manual_seed(0)
        case.step(model).backward()
    return max((a.grad - b.grad).abs().max().item() for a, b in zip(plain.parameters(), planned.parameters()))


def _tv_resnet_rows(case, base, profile):
    """torchvision's layout: the least peak without the residual blocks' twins (as before) and with them."""
    profiled = copy.deepcopy(case.model)
    with warnings.catch_warnings(), mock.patch("lightning_remat.runtime.profiling.profile.twin_stages", lambda *a: []):
        warnings.simplefilter("ignore")
        before = profile_step(profiled, case.step, optimizer=torch.optim.Adam(profiled.parameters(), lr=1e-4))
    rows = [_plan_row("least peak, bottlenecks whole or kept (before)", case, solve(before, "min", cost="flops"),
                      base, before)]
    plan = solve(profile, "min", cost="flops")
    rows.append(_plan_row("least peak, bottlenecks through checkpointed parts", case, plan, base, profile))
    rows[-1]["gradient_error"] = _gradient_error(case, plan)
    rows[-1]["parts"] = sum(1 for a in plan.actions if dict(a.extra).get("residual_parts"))
    return rows


def run(name, kwargs, log):
    case = build(name, **kwargs)
    opt = torch.optim.Adam(case.model.parameters(), lr=1e-4)
    profiled = copy.deepcopy(case.model)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = profile_step(profiled, case.step, optimizer=torch.optim.Adam(profiled.parameters(), lr=1e-4))
    log(f"[{name}] profiled in {time.perf_counter() - start:.0f} s; {len(profile.stages)} stages, "
        f"groups {[len(g) for g in profile.span_groups]}")
    del opt
    peak, flops, seconds = _measure(copy.deepcopy(case.model), case.step)
    base = dict(config="no recomputation", peak=peak, fb_peak=_forward_backward_peak(copy.deepcopy(case.model), case.step), flops=flops, flop_overhead=0.0, seconds=seconds,
                predicted=profile.baseline_peak_bytes)
    rows = [base]
    alone = dataclasses.replace(profile, span_groups=())
    if name != "tv_resnet":  # its least peak is in its own rows below
        rows.append(_plan_row("least peak, stages alone", case, solve(alone, "min", cost="flops"), base, profile))
        rows.append(_plan_row("least peak, with segments", case, solve(profile, "min", cost="flops"), base, profile))
    if case.sequential is case.model:
        n = len(case.model)
        k = max(1, round(math.sqrt(n)))
        seq_peak, seq_flops, seq_seconds = _measure(SequentialCheckpointed(copy.deepcopy(case.model), k), case.step)
        overhead = seq_flops / flops - 1
        # Its plan as our segments: k - 1 checkpoints of n // k items, the rest run plainly.
        size = n // k
        theirs = plan_from_choices(profile, [0] * n, 0, "flops",
                                   spans=[(a, a + size - 1) for a in range(0, size * (k - 1), size)])
        roofline = plan_overhead(profile, theirs, "roofline")
        seq_fb = _forward_backward_peak(SequentialCheckpointed(copy.deepcopy(case.model), k), case.step)
        rows.append(dict(config=f"checkpoint_sequential ({k} segments)", peak=seq_peak, fb_peak=seq_fb, flop_overhead=overhead,
                         seconds=seq_seconds, predicted=theirs.predicted_peak_bytes, roofline_overhead=roofline))
        rows.append(_plan_row("ours at checkpoint_sequential's peak", case, solve(profile, seq_peak, cost="flops"), base, profile))
        rows.append(_plan_row("ours, least peak at checkpoint_sequential's FLOP overhead", case,
                              _least_peak_within(profile, overhead, "flops"), base, profile))
        profiled = copy.deepcopy(case.model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sac = profile_step(profiled, case.step, optimizer=torch.optim.Adam(profiled.parameters(), lr=1e-4),
                               options=ProfileOptions(policies=None))
        rows.append(_plan_row("+ op-level policies: least peak", case, solve(sac, "min", cost="flops"), base, sac))
        rows.append(_plan_row("+ op-level policies: at checkpoint_sequential's peak", case,
                              solve(sac, seq_peak, cost="flops"), base, sac))
        rows.append(_plan_row("+ op-level policies: least peak at its FLOP overhead", case,
                              _least_peak_within(sac, overhead, "flops"), base, sac))
        rows.append(_plan_row("+ op-level policies: at its peak, cost=roofline", case,
                              solve(sac, seq_peak, cost="roofline"), base, sac))
        rows.append(_plan_row("+ op-level policies: least peak at its roofline overhead", case,
                              _least_peak_within(sac, roofline, "roofline"), base, sac))
    if name == "tv_resnet":
        rows.extend(_tv_resnet_rows(case, base, profile))
    if name in ("resnet50", "tv_resnet"):
        # The automatic candidates hold the stem (resnet.embedder) and the bottlenecks. Feng &
        # Huang's point: the cheapest plan that cuts 63% of the activation memory.
        budget = int(profile.static_bytes + (1 - FENG_HUANG_CUT) * (base["peak"] - profile.static_bytes))
        for cost in ("flops", "roofline"):
            try:
                rows.append(_plan_row(f"least {cost} cutting {FENG_HUANG_CUT:.0%} of activations", case,
                                      solve(profile, budget, cost=cost), base, profile))
            except BudgetTooSmallError as err:
                log(f"[{name}] no plan cuts {FENG_HUANG_CUT:.0%}: {err}")
    if name == "resnet50":
        # Without the stem, as before it was a candidate: its saved activations (64 channels at half
        # the resolution) stay alive under every bottleneck's recompute.
        profiled = copy.deepcopy(case.model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            no_stem = profile_step(profiled, case.step, optimizer=torch.optim.Adam(profiled.parameters(), lr=1e-4),
                                   candidates=["ResNetBottleNeckLayer"])
        rows.append(_plan_row("bottlenecks without the stem: least peak", case, solve(no_stem, "min", cost="flops"),
                              base, no_stem))
        # Stages one level down: each conv+bn+relu of a bottleneck and its shortcut, segments within
        # a bottleneck's Sequential of three (docs/segments.md: what bounds the least peak).
        profiled = copy.deepcopy(case.model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fine = profile_step(profiled, case.step, optimizer=torch.optim.Adam(profiled.parameters(), lr=1e-4),
                                candidates=["ResNetConvLayer", "ResNetShortCut"])
        log(f"[{name}] finer candidates: {len(fine.stages)} stages, groups {[len(g) for g in fine.span_groups]}")
        rows.append(_plan_row("finer candidates: least peak", case, solve(fine, "min", cost="flops"), base, fine))
        no_step = dataclasses.replace(fine, segments=tuple(s for s in fine.segments if s.name != "optimizer step"))
        row = _plan_row("finer candidates: least forward/backward peak", case, solve(no_step, "min", cost="flops"), base, fine)
        row["predicted_fb"], row["predicted"] = row["predicted"], None
        rows.append(row)
    static = profile.static_bytes
    for row in rows:
        row["activation_cut"] = 1 - (row["peak"] - static) / (base["peak"] - static)
        row["fb_activation_cut"] = 1 - (row["fb_peak"] - static) / (base["fb_peak"] - static)
        row["wall_ratio"] = row["seconds"] / base["seconds"]
        if row.get("predicted"):
            row["prediction_error"] = row["predicted"] / row["peak"] - 1
        if row.get("predicted_fb"):
            row["fb_prediction_error"] = row["predicted_fb"] / row["fb_peak"] - 1
    return dict(model=name, kwargs=kwargs, static_bytes=static, stages=len(profile.stages), rows=rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet50"])
    args = parser.parse_args(argv)
    results = []
    for name in args.models:
        results.append(run(name, (QUICK if args.quick else KWARGS)[name], lambda m: print(m, file=sys.stderr, flush=True)))
        out = Path(__file__).resolve().parent / "results" / ("segments_quick.json" if args.quick else "segments.json")
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    for result in results:
        print(f"\n{result['model']} {result['kwargs']}: {result['stages']} stages, static {result['static_bytes'] / MIB:.1f} MiB")
        print(f"{'config':58} {'peak MiB':>9} {'pred err':>8} {'act cut':>8} {'f/b cut':>8} {'FLOPs+':>7} {'roofl+':>7} {'wall':>6}  segments/alone/policies")
        for r in result["rows"]:
            err = (f"{r['prediction_error']:+.1%}" if "prediction_error" in r
                   else f"{r['fb_prediction_error']:+.1%}fb" if "fb_prediction_error" in r else "-")
            print(f"{r['config']:58} {r['peak'] / MIB:9.2f} {err:>8} {r['activation_cut']:8.1%} {r['fb_activation_cut']:8.1%} "
                  f"{r['flop_overhead']:7.1%} {r.get('roofline_overhead', 0.0):7.1%} {r['wall_ratio']:6.2f}  "
                  f"{r.get('segments', '')} {r.get('alone', '')} {r.get('policies', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
