#!/usr/bin/env python
"""Issue 12's targets at real model sizes on an H100, planned on fake tensors (no GPU needed).

The CPU benchmark (benchmarks/run.py) measures small shapes. This script plans the real sizes for
an 80 GB H100 under fake tensors (bf16 mixed precision, AdamW) and reports, from each profile, the
peers and our plans: activation memory (peak minus static), and the roofline overhead
(recomputation's roofline seconds over the step's forward and backward, on the H100's data-sheet
ceilings; FLOPs priced at 989 TFLOP/s and bytes at 3.35 TB/s):

- Hugging Face every-layer checkpointing (every stage recomputed whole: transformers checkpoints
  the same blocks);
- op-level SAC on every layer, torchtitan-style (``save_matmuls``);
- ours, with the op-level policies offered, at static + 70/50/30% of activations and at Hugging
  Face's peak; and the least reachable peak.

Everything here is a prediction: the fake profile equals a real one byte for byte on the CPU
(tests/test_fake.py), and a GPU run of benchmarks/gpu_fake_check.py checks it against CUDA.

    python benchmarks/gpu_targets.py                 # about a minute on 2 CPU cores
    python benchmarks/gpu_targets.py --models gpt2
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from results_io import RESULTS, log, write_results  # noqa: E402

from lightning_remat import BudgetTooSmallError, ProfileOptions, format_bytes, profile_step, solve  # noqa: E402
from lightning_remat.core.memory_model import plan_cost, predict_peak  # noqa: E402
from lightning_remat.core.solve import least_peak  # noqa: E402

FRACTIONS = (0.7, 0.5, 0.3)


def _gpt2():
    import transformers
    config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, use_cache=False)
    return transformers.GPT2LMHeadModel(config), (8, 1024), config.vocab_size, "GPT-2 124M, 8 x 1024"


def _bert():
    import transformers
    config = transformers.BertConfig()
    return transformers.BertForMaskedLM(config), (32, 512), config.vocab_size, "BERT-base, 32 x 512"


def _llama():
    import transformers
    config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                                      num_key_value_heads=16, num_hidden_layers=16, vocab_size=32000,
                                      max_position_embeddings=2048, use_cache=False)
    return transformers.LlamaForCausalLM(config), (4, 2048), config.vocab_size, "Llama 1.1B (16 x 2048), 4 x 2048"


MODELS = {"gpt2": _gpt2, "bert": _bert, "llama": _llama}


def _option_index(profile, name):
    return [[o.name for o in s.options].index(name) for s in profile.stages]


def run(name: str) -> dict:
    import transformers
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model, shape, vocab, label = MODELS[name]()
    model.train()
    ids = torch.randint(0, vocab, shape)

    def step(m):
        device = next(m.parameters()).device
        return m(input_ids=ids.to(device), labels=ids.to(device)).loss

    start = time.perf_counter()
    profile = profile_step(model, step, optimizer=torch.optim.AdamW(model.parameters()),
                           options=ProfileOptions(fake=True, precision="bf16-mixed", gpu="h100", policies=None))
    seconds = time.perf_counter() - start
    static, activations = profile.static_bytes, profile.baseline_activation_bytes
    base = profile.baseline_costs["roofline"]

    def row(config, peak, overhead, detail=""):
        fraction = None if peak is None else (peak - static) / activations
        return dict(config=config, peak_bytes=peak, activation_fraction=fraction,
                    roofline_overhead=overhead, detail=detail)

    rows = [row("no checkpointing", profile.baseline_peak_bytes, 0.0)]
    whole = _option_index(profile, "whole")
    hf_peak = predict_peak(profile, whole)
    rows.append(row("HF every layer", hf_peak, plan_cost(profile, whole, "roofline") / base))
    matmuls = _option_index(profile, "sac:save_matmuls")
    rows.append(row("op-SAC every layer (save_matmuls)", predict_peak(profile, matmuls),
                    plan_cost(profile, matmuls, "roofline") / base))
    budgets = [(f"ours at static + {f:.0%}", int(static + f * activations)) for f in FRACTIONS]
    budgets += [("ours at HF's peak", hf_peak), ("ours, least peak", least_peak(profile))]
    for config, budget in budgets:
        try:
            plan = solve(profile, budget, cost="roofline")
        except BudgetTooSmallError:
            rows.append(row(config, None, None, "infeasible: below the least reachable peak"))
            continue
        used = {}
        for choice in plan.choices:
            used[choice.option] = used.get(choice.option, 0) + 1
        detail = ", ".join(f"{o} x{n}" for o, n in sorted(used.items(), key=lambda kv: -kv[1]))
        rows.append(row(config, plan.predicted_peak_bytes, plan.predicted_overhead, detail))
    return dict(model=name, label=label, static_bytes=static, activation_bytes=activations,
                stages=len(profile.stages), profile_seconds=seconds, rows=rows)


def table(results: list[dict]) -> str:
    lines = ["| model | configuration | peak | activations (% of baseline) | roofline overhead | options |",
             "|---|---|---|---|---|---|"]
    for result in results:
        for r in result["rows"]:
            if r["peak_bytes"] is None:
                lines.append(f"| {result['label']} | {r['config']} | - | - | - | {r['detail']} |")
                continue
            lines.append(f"| {result['label']} | {r['config']} | {format_bytes(r['peak_bytes'])} | "
                         f"{format_bytes(r['peak_bytes'] - result['static_bytes'])} ({r['activation_fraction']:.0%}) | "
                         f"{r['roofline_overhead']:.1%} | {r['detail']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    results = []
    for name in args.models:
        log(f"[{name}] planning on fake tensors for an H100")
        results.append(run(name))
    write_results(args.out, "gpu_targets", results, table(results))

if __name__ == "__main__":
    main()
