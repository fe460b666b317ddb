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
from dataclasses import replace
from pathlib import Path

import torch
import transformers

from lightning_remat.core.batch_fit import ProfileFit
from lightning_remat.core.binding import Binding
from lightning_remat.core.config import ProfileOptions, RematConfig
from lightning_remat.core.offload_model import is_offload, without_offload
from lightning_remat.core.solve import least_peak, solve
from lightning_remat.runtime.profiling.profile import profile_step
from lightning_remat.service.batch_search import BatchSearch

GB = 10**9
DEVICE = 80 * GB
HOST = 1000 * GB  # host memory free for offloading (an 8-GPU H100 server has 1-2 TB)
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
                         recomputed=len(b.checkpointed), inputs_offloaded=len(b.offloaded_inputs),
                         host_gb=round(b.host_bytes / GB, 1)))
    floor = least_peak(p)
    rows.append(dict(budget_gb=round(floor / GB, 2), recompute_only=None,
                     with_offload=round(solve(p, floor, "time").predicted_overhead, 4), note="least peak with offload"))
    return rows


class _Variant:
    """A ``ProfileFit`` with some options withdrawn at every batch size (what the search reads)."""

    def __init__(self, fit: ProfileFit, keep):
        self.fit, self.keep, self.batch_sizes = fit, keep, fit.batch_sizes

    def at(self, batch: int):
        return self.keep(self.fit.at(batch))


def no_recompute(p):
    """Keep and the offload options only (offloading alone, as in the seed paper)."""
    return replace(p, stages=tuple(replace(s, options=tuple(o for o in s.options if o.name == "keep" or is_offload(o)))
                                   for s in p.stages))


def binding(plan) -> str:
    """The term of the memory model that reaches ``plan``'s peak, and its size (``core.binding``)."""
    return Binding.from_dict(plan.binding).text()


def largest_batch(name: str, first) -> dict:
    """The largest batch whose least peak fits 80 GB, searched as ``find_remat_batch_size`` predicts it:
    the profiles at the table's batch and twice it fitted term by term (``ProfileFit``), then
    solved at every batch size tried (within ``HOST`` bytes of host memory). The least peak is
    not affine in the batch (the term that sets it changes), so it is not extrapolated itself."""
    b1 = MODELS[name][1]
    fit = ProfileFit([(b1, first), (2 * b1, profile(name, 2 * b1))])
    config = RematConfig(DEVICE, cost="time", profile=ProfileOptions(offload=True))
    result = {}
    for label, keep in (("offload_and_recompute", lambda p: p), ("recompute_only", only),
                        ("offload_only", no_recompute)):
        search = BatchSearch(None, None, None, config, DEVICE, float("inf"), 1, "binsearch", b1)
        search.fit, search.host_free = _Variant(fit, keep), HOST
        found = search.largest(True, 4096)
        plan = search.plan_for(found, True) if found else None
        result[label] = found
        if plan is not None:
            result[label + "_limited_by"] = binding(plan)
            result[label + "_host_gb"] = round(plan.host_bytes / GB, 1)
            result[label + "_inputs_offloaded"] = len(plan.offloaded_inputs)
        if label == "offload_and_recompute":
            result["neither"] = search.largest(False, 4096)
    def figures(batch: int) -> dict:
        at = fit.at(batch)
        head = max(s.peak_bytes for s in at.segments if s.stages_alive == len(at.stages))
        return dict(head_and_loss=head - at.parameter_bytes,
                    checkpoints=sum(s.option("whole").stored_bytes for s in at.stages),
                    first_stage_backward=at.stages[0].option("whole").local_peak_bytes - at.static_bytes)

    low, high = figures(b1), figures(2 * b1)
    result["static_gb"] = round(first.static_bytes / GB, 2)
    result["parameters_gb"] = round(first.parameter_bytes / GB, 2)
    # Beyond parameters (head) or static memory (first stage): per sample, and the fixed part.
    result["per_sample_gb"] = {k: round((high[k] - low[k]) / b1 / GB, 4) for k in low}
    result["fixed_gb"] = {k: round((2 * low[k] - high[k]) / GB, 3) for k in low}
    return result


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
