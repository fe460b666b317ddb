"""Least peak of a Llama-3-8B fine-tune at 64K-128K tokens without and with a tiled MLP (``tile_mlp=True``).

Planned on fake tensors for an H100 (80 GB, bf16-true: weights, gradients and AdamW state in bf16; batch 1;
budget "min": the plan of least peak; cost: counted FLOPs), the model built on the meta device with LoRA (r=16) on
q/v, its head and loss chunked (``chunk_loss=True``). Each length is planned without and with ``tile_mlp``, and with
offloading of the recomputed layers' inputs to host memory (``offload=True``, 1 TB of host memory) and without.
The 32 layers are profiled as 4 and 5 and extrapolated.

    python benchmarks/tiled_mlp.py                      # 64K and 128K, the table and docs/benchmarks/tiled_mlp.json
    python benchmarks/tiled_mlp.py --tokens 65536 --no-offload
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

GiB = 2**30
LLAMA_3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256)
H100_BYTES = 80 * 10**9  # 74.51 GiB
OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "tiled_mlp.json"


def build(tokens: int) -> torch.nn.Module:
    """Llama-3-8B on the meta device, training mode, LoRA (r=16) on q/v."""
    import transformers
    from peft import LoraConfig, get_peft_model

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(**LLAMA_3_8B, max_position_embeddings=tokens, use_cache=False)
    with torch.device("meta"):
        model = get_peft_model(transformers.LlamaForCausalLM(config),
                               LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    return model.train()


def plan_row(tokens: int, tile: bool, offload: bool) -> dict:
    """The least-peak plan's figures: peak, what binds, host bytes, overhead, the options chosen, planning time."""
    from lightning_remat.core.config import ProfileOptions, RematConfig
    from lightning_remat.service.planning import Planner

    model = build(tokens)
    ids = torch.randint(0, LLAMA_3_8B["vocab_size"], (1, tokens))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    # No device_memory: a least peak above the GPU's is reported (``fits``), not refused.
    options = ProfileOptions(fake=True, precision="bf16-true", device="cuda", gpu="h100",
                             chunk_loss=True, tile_mlp=tile, offload=offload, host_memory="1TB" if offload else None)
    planner = Planner(RematConfig("min", cost="flops", profile=options), verbose=False)
    start = time.perf_counter()
    plan = planner.decide(model, lambda m: m(input_ids=ids, labels=ids).loss, optimizer)
    seconds = time.perf_counter() - start
    chosen: dict[str, int] = {}
    for choice in plan.choices:
        chosen[choice.option] = chosen.get(choice.option, 0) + 1
    binding = plan.binding or {}
    return dict(tokens=tokens, tile_mlp=tile, offload=offload, least_peak_gib=round(plan.predicted_peak_bytes / GiB, 2),
                fits=plan.predicted_peak_bytes <= H100_BYTES,
                binds=_binds(binding), host_gib=round(plan.host_bytes / GiB, 2),
                overhead=round(plan.predicted_overhead or 0.0, 4), options=chosen, seconds=round(seconds, 1))


def _binds(binding: dict) -> str:
    """The term at the peak, short: its kind, the last two parts of its name, the bytes of its own."""
    if not binding:
        return ""
    name = ".".join(str(binding["name"]).split(".")[-2:])
    return (f"{binding['term']} {name}: own {binding['own_bytes'] / GiB:.2f}, stored {binding['stored_bytes'] / GiB:.2f}, "
            f"static {binding['static_bytes'] / GiB:.2f} GiB")


def table(rows: list[dict]) -> str:
    lines = ["| tokens | offload | tile_mlp | least peak | what binds | host memory | overhead (FLOPs) | options chosen "
             "| planned in |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        options = ", ".join(f"{name} x{count}" for name, count in sorted(r["options"].items()))
        lines.append(f"| {r['tokens'] // 1024}K | {'yes' if r['offload'] else 'no'} | {'yes' if r['tile_mlp'] else 'no'} "
                     f"| {r['least_peak_gib']:.2f} GiB ({'fits' if r['fits'] else 'does not fit'}) | {r['binds']} | {r['host_gib']:.2f} GiB | {r['overhead']:.1%} | {options} "
                     f"| {r['seconds']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--no-offload", action="store_true", help="only the plans without offloading")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rows = []
    for tokens in args.tokens:
        for offload in (False,) if args.no_offload else (False, True):
            for tile in (False, True):
                rows.append(plan_row(tokens, tile, offload))
                print(rows[-1], flush=True)
    print(table(rows))
    args.out.write_text(json.dumps({"rows": rows, "gpu": "h100", "precision": "bf16-true", "model": "Llama-3-8B",
                                    "trainable": "LoRA r=16 on q/v", "chunk_loss": True}, indent=1) + "\n")


if __name__ == "__main__":
    main()
