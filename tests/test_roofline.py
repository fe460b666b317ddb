"""The roofline cost is reproducible: the same profile gives the same plan in every process.

``cost="roofline"`` on the CPU priced ops with a calibration measured in each process (one matmul,
one copy), so the same check run twice chose different plans. The CPU's ceilings are now fixed
figures (``core.hardware.CPU_FLOPS``, ``CPU_MEMORY_BANDWIDTH``): two fresh processes profile a
small model with op-level policies and get the same roofline costs and the same plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, torch
from lightning_remat import profile_step, solve
from lightning_remat.core.solve import least_peak
from lightning_remat.models import build

case = build("mlp", depth=4, width=64, batch_size=512)
profile = profile_step(case.model, case.step, optimizer=torch.optim.AdamW(case.model.parameters()),
                       policies=("save_matmuls",))
budget = (least_peak(profile) + profile.baseline_peak_bytes) // 2
plan = solve(profile, budget, cost="roofline")
print(json.dumps({"costs": [[o.name, o.costs.roofline] for s in profile.stages for o in s.options],
                  "step": profile.baseline_costs.roofline, "plan": [repr(a) for a in plan.actions],
                  "overhead": plan.predicted_overhead}))
"""


def _fresh_process() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_processes_price_the_same_profile_alike_and_choose_the_same_plan():
    first, second = _fresh_process(), _fresh_process()
    assert first["costs"] and all(cost > 0 for name, cost in first["costs"] if name != "keep")
    assert first == second
