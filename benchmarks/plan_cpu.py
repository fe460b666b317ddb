"""Planning CPU seconds, A/B: one fake plan of a small Llama with AdamW, on two checkouts of the package.

Each run is a fresh process that imports ``lightning_remat`` from one checkout (``PYTHONPATH``) and times
``plan_remat(..., fake=True, device="cuda", gpu="h100", optimizer=AdamW)`` alone with
``time.process_time()`` (imports and model building excluded). Two budgets: one where the plan fits
and a stage or the head binds its peak, and ``"min"``, where the optimizer step binds (its advice,
"would reach X with fused=True", is printed). Runs alternate A, B, A, B, ... (a noisy shared machine:
interleaving spreads its load over both). The plans' dicts (advice included) must be equal across
checkouts; the table says so.

    python benchmarks/plan_cpu.py --a /work/main --b . --runs 3
    python benchmarks/plan_cpu.py --row fits       # one plan here, its JSON on stdout
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_results  # noqa: E402

# Budgets: "fits" lies between the least peak (~134 MB, the optimizer step binds) and the baseline
# (~169 MB), so a plan recomputes some stages and the head and loss bind; "min" is the least peak.
BUDGETS = {"fits": 150_000_000, "binds": "min"}


def row(name: str) -> dict:
    """Plan once in this process; the CPU seconds of ``plan_remat`` and a digest of the plan."""
    import torch
    import transformers

    from lightning_remat import plan_remat
    from lightning_remat.runtime.profiling import optimizer_step

    # Counts the optimizer-step measurements made for the settings' advice (optimizer_step_alternatives
    # calls the module's optimizer_step_cost; the profile's own step measurement holds another reference).
    measured = []
    counted = optimizer_step.optimizer_step_cost
    optimizer_step.optimizer_step_cost = lambda *a, **k: measured.append(1) or counted(*a, **k)

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=8000, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 8000, (2, 256), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters())
    start = time.process_time()
    plan = plan_remat(model, lambda m: m(input_ids=ids, labels=ids).loss, BUDGETS[name], fake=True, device="cuda",
                      gpu="h100", optimizer=optimizer)
    seconds = time.process_time() - start
    text = json.dumps(plan.to_dict(), sort_keys=True, default=str)
    return {"budget": name, "cpu_seconds": round(seconds, 3), "binds": plan.binding["term"],
            "advice": plan.binding["advice"], "advice_step_measurements": len(measured), "plan_sha": hashlib.sha256(text.encode()).hexdigest()[:12],
            "package": str(Path(sys.modules["lightning_remat"].__file__).parent.parent)}


def _run(checkout: str, name: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}
    out = subprocess.run([sys.executable, __file__, "--row", name], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", choices=sorted(BUDGETS), help="plan once here and print its JSON")
    parser.add_argument("--a", default="/work/main", help="checkout A (before)")
    parser.add_argument("--b", default=str(Path(__file__).resolve().parent.parent), help="checkout B (after)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each checkout per budget")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(row(args.row)))
        return
    runs = []
    for name in BUDGETS:
        for i in range(args.runs):
            for label, checkout in (("A", args.a), ("B", args.b)):
                runs.append({"checkout": label, "run": i, **_run(checkout, name)})
                print(json.dumps(runs[-1]), flush=True)
    lines = ["| budget | binds | A cpu s (runs) | B cpu s (runs) | A median | B median | B/A | advice step measurements A/B | same plans |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in BUDGETS:
        got = {label: [r for r in runs if r["budget"] == name and r["checkout"] == label] for label in "AB"}
        a, b = ([r["cpu_seconds"] for r in got[label]] for label in "AB")
        same = len({r["plan_sha"] for r in got["A"] + got["B"]}) == 1
        lines.append(f"| {name} ({BUDGETS[name]}) | {got['A'][0]['binds']} | {', '.join(f'{x:.2f}' for x in a)} | "
                     f"{', '.join(f'{x:.2f}' for x in b)} | {statistics.median(a):.2f} | {statistics.median(b):.2f} | "
                     f"{statistics.median(b) / statistics.median(a):.2f} | {got['A'][0]['advice_step_measurements']}/"
                     f"{got['B'][0]['advice_step_measurements']} | {'yes' if same else 'NO'} |")
    results = {"a": str(Path(args.a).resolve()), "b": str(Path(args.b).resolve()), "cpus": os.cpu_count(),
               "note": "shared machine, runs interleaved A/B", "runs": runs}
    write_results(args.out, "plan_cpu", results, "\n".join(lines))


if __name__ == "__main__":
    main()
