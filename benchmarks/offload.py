"""Offloading activations to host memory vs recomputation alone, planned on fake tensors for one H100.

Llama-2-7B at batch 4 x 2048 and a Llama-2-13B-sized model at 1 x 4096, pure bf16 with plain SGD
(with AdamW, the 7B's optimizer step alone peaks at 67 GB, a floor neither recomputation nor
offloading lowers, and the 13B's state does not fit 80 GB), are built on the meta device from
transformers' ``LlamaConfig`` and profiled with ``offload=True`` for an 80 GB H100 (PCIe 5 host
link, 50 GB/s; and, for comparison, a GH200's NVLink-C2C, 400 GB/s). For budgets where
recomputation alone costs more than 10% of the step, the table gives the least predicted time
overhead with recomputation only and with offloading allowed too. Then the largest batch that fits
80 GB with neither, recomputation only, and offload + recompute: every byte term is affine in the
batch size, so the peaks are profiled at the table's batch and twice it and extrapolated.

    python benchmarks/offload.py            # prints the tables, writes docs/benchmarks/offload.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import transformers

from lightning_remat.core.config import ProfileOptions
from lightning_remat.core.offload_model import without_offload
from lightning_remat.core.solve import least_peak, solve
from lightning_remat.runtime.profile import profile_step

GB = 10**9
DEVICE = 80 * GB
MODELS = {
    "llama-2-7b": (dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                        intermediate_size=11008), 4, 2048, "sgd"),
    "llama-2-13b": (dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=40, num_key_value_heads=40,
                         intermediate_size=13824), 1, 4096, "sgd"),
}
OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "offload.json"


def profile(name: str, batch: int, gpu: str = "h100"):
    sizes, _, tokens, opt = MODELS[name]
    config = transformers.LlamaConfig(**sizes, vocab_size=32000, max_position_embeddings=tokens, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters()) if opt == "adamw" else torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 32000, (batch, tokens))
    options = ProfileOptions(fake=True, dtype=torch.bfloat16, device="cuda", gpu=gpu, offload=True)
    return profile_step(model, lambda m: m(input_ids=ids, labels=ids).loss, optimizer=optimizer, options=options)


def only(p):
    return without_offload(p, set(range(len(p.stages))))


def overheads(p, fractions=(0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05, 0.0)) -> list[dict]:
    rec = only(p)
    low, high = least_peak(rec), p.baseline_peak_bytes
    rows = []
    for f in fractions:
        budget = int(low + (high - low) * f)
        a, b = solve(rec, budget, "time"), solve(p, budget, "time")
        if a.predicted_overhead <= 0.10:
            continue
        rows.append(dict(budget_gb=round(budget / GB, 2), recompute_only=round(a.predicted_overhead, 4),
                         with_offload=round(b.predicted_overhead, 4), offloaded=len(b.offloaded),
                         hidden=sum(1 for c in b.choices if c.option == "offload:hidden"),
                         recomputed=len(b.checkpointed), host_gb=round(b.host_bytes / GB, 1)))
    floor = least_peak(p)
    rows.append(dict(budget_gb=round(floor / GB, 2), recompute_only=None,
                     with_offload=round(solve(p, floor, "time").predicted_overhead, 4), note="least peak with offload"))
    return rows


def largest_batch(name: str, first) -> dict:
    b1 = MODELS[name][1]
    one, two = first, profile(name, 2 * b1)

    def fit(f) -> int:
        a, b = f(one), f(two)
        slope = (b - a) / b1  # per sample
        return max(0, int(b1 + (DEVICE - a) // slope)) if slope > 0 else 0

    neither = fit(lambda p: p.baseline_peak_bytes)
    rec = fit(lambda p: least_peak(only(p)))
    off = fit(lambda p: least_peak(p))
    return dict(neither=neither, recompute_only=rec, offload_and_recompute=off,
                baseline_gb=[round(p.baseline_peak_bytes / GB, 2) for p in (one, two)],
                least_recompute_only_gb=[round(least_peak(only(p)) / GB, 2) for p in (one, two)],
                least_with_offload_gb=[round(least_peak(p) / GB, 2) for p in (one, two)])


def main() -> dict:
    transformers.logging.set_verbosity_error()
    result = {}
    for name, (_, batch, tokens, opt) in MODELS.items():
        start = time.perf_counter()
        profiles = {gpu: profile(name, batch, gpu) for gpu in ("h100", "gh200")}
        print(name, "profiled", round(time.perf_counter() - start, 1), "s", profiles["h100"].notes[:1], flush=True)
        rows = {gpu: overheads(p) for gpu, p in profiles.items()}
        result[name] = dict(batch=batch, tokens=tokens, optimizer=opt, overheads=rows,
                            largest_batch=largest_batch(name, profiles["h100"]),
                            seconds=round(time.perf_counter() - start, 1))
        print(json.dumps({name: result[name]}, indent=1), flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
