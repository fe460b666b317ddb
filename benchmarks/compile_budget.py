#!/usr/bin/env python
"""torch.compile's own activation memory budget as a peer (issues 12 and 23), on the CPU with inductor.

``torch._functorch.config.activation_memory_budget`` makes AOTAutograd's partitioner recompute
more of the forward in the compiled backward. This compares, for 2-layer Qwen2- and Phi3-like
models (and GPT-2 and Llama at the benchmark's shapes with ``--models gpt2 llama``; dropout off:
compiled and eager dropout draw different numbers):

- eager, no recomputation; compiled with the default partitioner (budget 1.0);
- compiled with budgets 0.5 and 0.2 (``--compile-budgets``);
- our plans applied and then compiled, solved on the profile of the compiled model (recomputed
  pointwise ops priced as fused, ``cost="roofline"``, every policy offered), at the peak torch's
  budget measured (the budget is that peak: equal peak), and at our least peak.

What is measured, each on the same compiled step: the bytes the step saves for backward (distinct
storages handed to autograd's saved-tensor hooks during the forward, parameters left out); the
peak of a forward and backward from torch.profiler's allocator events (``tests/torch_meter.TorchPeak``:
the parameters alive at its start plus the largest running sum of allocations); the median
wall-clock of a forward and backward. "x torch" is our saved bytes over those of the budget whose
peak our plan was given.

    python benchmarks/compile_budget.py        # 5-15 minutes on 2 busy CPU cores (compiling; less when cached)
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

from lightning_remat import ProfileOptions, apply_plan, profile_step, solve  # noqa: E402
from lightning_remat.core.errors import BudgetTooSmallError  # noqa: E402
from lightning_remat.models import ModelCase, build  # noqa: E402
from tests.torch_meter import TorchPeak  # noqa: E402

COMPILE_BUDGETS = (0.5, 0.2)


def _causal_lm(name: str, config_class: str, batch_size: int = 4, seq_len: int = 128, **extra) -> ModelCase:
    """A 2-layer causal LM of a transformers family with random weights, on random tokens."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = getattr(transformers, config_class)(
        num_hidden_layers=2, hidden_size=128, intermediate_size=344, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1024, max_position_embeddings=seq_len, use_cache=False, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, 1024, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return ModelCase(name, model, lambda m: m(input_ids=ids, labels=ids).loss, batch_size, True)


LOCAL = {"qwen2": lambda: _causal_lm("qwen2", "Qwen2Config"),
         "phi3": lambda: _causal_lm("phi3", "Phi3Config", pad_token_id=0)}


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


def peak_bytes(model, step) -> int:
    """The peak of one forward and backward from torch.profiler's allocator events."""
    meter = TorchPeak(model).start()
    step(model).backward()
    peak = meter.stop()
    model.zero_grad(set_to_none=True)
    return peak


def median_seconds(model, step, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step(model).backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(rows: list, name: str, case: ModelCase, rounds: int, label: str, model, compiled: bool, **extra) -> dict:
    start = time.perf_counter()
    case.step(model).backward()  # compiles (when compiled) and warms up
    model.zero_grad(set_to_none=True)
    warm = time.perf_counter() - start
    rows.append(dict(config=label, compiled=compiled, saved_bytes=saved_bytes(model, case.step),
                     peak_bytes=peak_bytes(model, case.step), seconds=median_seconds(model, case.step, rounds),
                     first_step_seconds=warm, **extra))
    log(f"[{name}] {label}: {rows[-1]['saved_bytes'] / 2**20:.2f} MiB saved, peak {rows[-1]['peak_bytes'] / 2**20:.2f} MiB")
    return rows[-1]


def _ours(rows: list, name: str, case: ModelCase, rounds: int, profile, budget, label: str, peer: dict | None,
          compile_budget: float = 1.0) -> None:
    try:
        plan = solve(profile, budget, cost="roofline")
    except BudgetTooSmallError as err:
        rows.append(dict(config=label, compiled=True, infeasible=str(err)))
        log(f"[{name}] {label}: {err}")
        return
    model = apply_plan(copy.deepcopy(case.model), plan)
    torch._dynamo.reset()
    what = f"{len(plan.checkpointed)} modules, {len(plan.policies)} with a policy, +{plan.predicted_overhead:.1%} roofline"
    how = "compiled" if compile_budget == 1.0 else f"compiled with activation_memory_budget={compile_budget}"
    # Both together: our decisions are tags the partitioner keeps; its budget acts on the rest.
    functorch_config.activation_memory_budget = compile_budget
    try:
        row = _measure(rows, name, case, rounds, f"{label} ({what}), {how}", torch.compile(model), True,
                       predicted_peak_bytes=plan.predicted_peak_bytes, policies=dict(plan.policies))
    finally:
        functorch_config.activation_memory_budget = 1.0
    if peer is not None:
        row["peer"], row["saved_vs_peer"] = peer["config"], row["saved_bytes"] / peer["saved_bytes"]
        row["peak_vs_peer"] = row["peak_bytes"] / peer["peak_bytes"]


def run(name: str, rounds: int, compile_budgets=COMPILE_BUDGETS) -> dict:
    case = LOCAL[name]() if name in LOCAL else build(name, seed=0)
    torch.manual_seed(0)
    for module in case.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    rows: list[dict] = []
    _measure(rows, name, case, rounds, "eager, no recomputation", copy.deepcopy(case.model), False)
    peers = []
    for budget in (1.0, *compile_budgets):
        functorch_config.activation_memory_budget = budget
        torch._dynamo.reset()
        label = "compiled" if budget == 1.0 else f"compiled, activation_memory_budget={budget}"
        row = _measure(rows, name, case, rounds, label, torch.compile(copy.deepcopy(case.model)), True)
        if budget < 1.0:
            peers.append(row)
    functorch_config.activation_memory_budget = 1.0
    # Profiled as compiled (profiling compiles nothing): recomputed pointwise ops priced as fused.
    profiled = torch.compile(copy.deepcopy(case.model))
    profile = profile_step(profiled, case.step, options=ProfileOptions(policies=None))
    for peer in peers:
        _ours(rows, name, case, rounds, profile, peer["peak_bytes"], f"AutoRemat at {peer['config'][10:]}'s peak",
              peer)
    _ours(rows, name, case, rounds, profile, "min", "AutoRemat least peak", None)
    if compile_budgets:
        _ours(rows, name, case, rounds, profile, "min", "AutoRemat least peak", None, min(compile_budgets))
    base = rows[0]
    for row in rows:
        if "saved_bytes" in row:
            row["saved_fraction"] = row["saved_bytes"] / base["saved_bytes"]
            row["time_ratio"] = row["seconds"] / base["seconds"]
    return dict(model=name, rows=rows)


def table(results: list[dict]) -> str:
    lines = ["| model | configuration | saved for backward (MiB, share of eager) | peak (MiB) | "
             "forward+backward time (x eager) | saved, x torch at equal peak |",
             "|---|---|---|---|---|---|"]
    for result in results:
        for r in result["rows"]:
            if "infeasible" in r:
                lines.append(f"| {result['model']} | {r['config']} | infeasible | | | |")
                continue
            versus = f"{r['saved_vs_peer']:.2f} (peak {r['peak_vs_peer']:.2f}x)" if "saved_vs_peer" in r else ""
            lines.append(f"| {result['model']} | {r['config']} | {r['saved_bytes'] / 2**20:.2f} ({r['saved_fraction']:.0%}) | "
                         f"{r['peak_bytes'] / 2**20:.2f} | {r['time_ratio']:.2f} | {versus} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--models", nargs="+", default=["qwen2", "phi3"])
    parser.add_argument("--compile-budgets", nargs="+", type=float, default=list(COMPILE_BUDGETS))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    results = [run(name, args.rounds, tuple(args.compile_budgets)) for name in args.models]
    write_results(args.out, "compile_budget", results, table(results))


if __name__ == "__main__":
    main()
