#!/usr/bin/env python
"""How much the CPU's roofline ceilings move, and what that does to a plan (issue 23).

``cost="roofline"`` on the CPU prices with fixed figures (``core.hardware.CPU_FLOPS``,
``CPU_MEMORY_BANDWIDTH``), so a profile gives the same plan in every process. This measures this
CPU's ceilings (``measured_cpu_peaks``: a float32 matmul, an 8 MiB copy) in several fresh processes,
and plans GPT-2 (op-level policies, static + 50% of activations, the benchmark's shape) under the
fixed figures, under each measured ridge point (FLOPs per byte moved where an op turns from priced by
its bytes to priced by its FLOPs) and under the ridge points of other machines (``--ridges``).

    python benchmarks/roofline_cpu.py              # about a minute on 2 CPU cores
    python benchmarks/roofline_cpu.py --processes 8

Writes benchmarks/results/roofline_cpu.json and .md and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from results_io import RESULTS, log, write_results  # noqa: E402

from lightning_remat import profile_step, solve  # noqa: E402
from lightning_remat.core import hardware  # noqa: E402
from lightning_remat.models import build  # noqa: E402

MEASURE = "from roofline_cpu import measured_cpu_peaks; print(*measured_cpu_peaks())"


def measured_cpu_peaks() -> tuple[float, float]:
    """This CPU's measured ceilings (a float32 matmul's FLOP/s, a large copy's bytes/s)."""
    # A generator of its own: calibrating must not move the global random state training uses.
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(384, 384, generator=g), torch.randn(384, 384, generator=g)
    src = torch.zeros(8 * 2**20 // 4)  # 8 MiB: beyond most caches
    dst = torch.empty_like(src)

    def best(fn, repeats: int = 5) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return max(min(times), 1e-9)

    return 2 * 384**3 / best(lambda: torch.mm(a, b)), 2 * src.nbytes / best(lambda: dst.copy_(src))


def measured(processes: int) -> list[tuple[float, float]]:
    """(FLOP/s, bytes/s) measured in ``processes`` fresh processes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    out = []
    for _ in range(processes):
        text = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, env=env, check=True).stdout
        flops, bandwidth = map(float, text.split()[-2:])
        out.append((flops, bandwidth))
    return out


def plan_at(ridge: float) -> dict:
    """GPT-2's roofline plan at static + 50% of activations, the CPU's ridge point at ``ridge``."""
    hardware.CPU_FLOPS = ridge * hardware.CPU_MEMORY_BANDWIDTH
    case = build("gpt2")
    profile = profile_step(case.model, case.step, optimizer=torch.optim.AdamW(case.model.parameters()),
                           policies=("save_matmuls", "save_attention"))
    plan = solve(profile, profile.static_bytes + profile.baseline_activation_bytes // 2, cost="roofline")
    return {"ridge": ridge, "plan": [f"{c.stage}:{c.option}" for c in plan.choices if c.option != "keep"],
            "overhead": plan.predicted_overhead}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--ridges", type=float, nargs="*", default=[2.0, 20.0],
                        help="ridge points of other machines to plan at too (FLOP per byte)")
    args = parser.parse_args()
    fixed = hardware.CPU_FLOPS / hardware.CPU_MEMORY_BANDWIDTH
    peaks = measured(args.processes)
    log(f"measured {len(peaks)} processes")
    rows = [{"source": "fixed (core.hardware)", **plan_at(fixed)}]
    for flops, bandwidth in peaks:
        rows.append({"source": f"measured {flops / 1e9:.0f} GFLOP/s, {bandwidth / 1e9:.1f} GB/s",
                     **plan_at(flops / bandwidth)})
    rows += [{"source": "another machine", **plan_at(ridge)} for ridge in args.ridges]
    lines = ["| ceilings | ridge FLOP/byte | overhead | same plan as fixed |", "|---|---|---|---|"]
    lines += [f"| {r['source']} | {r['ridge']:.2f} | {r['overhead']:.1%} | {'yes' if r['plan'] == rows[0]['plan'] else 'no'} |"
              for r in rows]
    write_results(RESULTS, "roofline_cpu", {"rows": rows, "plan_fixed": rows[0]["plan"]}, "\n".join(lines))
    print(json.dumps(rows[0]["plan"]))


if __name__ == "__main__":
    main()
