#!/usr/bin/env python
"""Does planning without the hardware predict the GPU? A fake-tensor plan against the real step on CUDA.

A Llama of about a billion parameters is planned on fake tensors for ``cuda`` (nothing allocated,
as one would plan on a laptop) in a precision, then built for real on the GPU in that precision,
the plan applied, and trained for a few steps with AdamW (its CUDA default, the batched "foreach"
step); ``max_memory_allocated`` over the steady steps is compared with the fake plan's prediction.

- ``bf16-true``: parameters, gradients and AdamW state in bfloat16;
- ``bf16-mixed``: float32 parameters, gradients and state, the step under bfloat16 autocast;
- GPT-2 124M (bf16-mixed, 8 x 1024 tokens, static + 70%) with attention dropout 0.1: the fake plan
  runs attention in the fused kernel CUDA chooses with dropout.

    python benchmarks/gpu_fake_check.py            # on a GPU; a minute or two on an H100
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from lightning_remat import ProfileOptions, apply_plan, format_bytes, profile_step, solve  # noqa: E402


def build(layers: int, hidden: int, device: str):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.6875) // 64 * 64,
                                      num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128,
                                      num_hidden_layers=layers, vocab_size=32000, max_position_embeddings=4096,
                                      use_cache=False)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.train()


def build_gpt2(layers: int, hidden: int, device: str):
    """GPT-2 (hidden 768 = 12 heads of 64) with its default dropouts, attention dropout 0.1 included:
    planned on fake tensors for CUDA, attention runs in the fused kernel CUDA picks with dropout
    (runtime/targets/fake_attention.py), not the CPU's math path."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=hidden // 64, n_positions=1024,
                                     use_cache=False)
    with torch.device(device):
        model = transformers.GPT2LMHeadModel(config)
    return model.train()


def check(precision: str, layers: int, hidden: int, batch: int, seq: int, budget_share: float,
          builder=build, vocab: int = 32000) -> dict:
    ids = torch.randint(0, vocab, (batch, seq))
    meta = builder(layers, hidden, "meta")
    step = lambda m: m(input_ids=ids.to(next(m.parameters()).device), labels=ids.to(next(m.parameters()).device)).loss
    profile = profile_step(meta, step, optimizer=torch.optim.AdamW(meta.parameters()),
                           options=ProfileOptions(fake=True, precision=precision, device="cuda"))
    budget = int(profile.static_bytes + budget_share * profile.baseline_activation_bytes)
    plan = solve(profile, budget, cost="flops")
    del meta
    torch.manual_seed(0)
    model = builder(layers, hidden, "cuda")
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    apply_plan(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    peaks = []
    for _ in range(4):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = step(model)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        peaks.append(int(torch.cuda.max_memory_allocated()))
    measured = max(peaks[1:])
    result = {"model": builder.__name__, "precision": precision, "parameters": sum(p.numel() for p in model.parameters()),
              "budget": budget, "predicted": plan.predicted_peak_bytes, "measured": measured,
              "reserved": int(torch.cuda.max_memory_reserved()), "checkpointed": len(plan.checkpointed),
              "error": (measured - plan.predicted_peak_bytes) / plan.predicted_peak_bytes,
              "held": measured <= budget}
    del model, optimizer
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: nothing to compare with", file=sys.stderr)
        return 0
    rows = [check(p, args.layers, args.hidden, args.batch, args.seq, 0.5) for p in ("bf16-true", "bf16-mixed")]
    # GPT-2 124M with attention dropout, 8 x 1024 tokens, at static + 70% (its head's logits put 50%
    # below the least reachable peak): the fake plan's attention kernel against CUDA's.
    rows.append(check("bf16-mixed", 12, 768, 8, 1024, 0.7, builder=build_gpt2, vocab=50257))
    for r in rows:
        print(f"{r['model']:<10} {r['precision']:<10} {r['parameters'] / 1e9:.2f}B params, {r['checkpointed']} recomputed: budget "
              f"{format_bytes(r['budget'])}, fake-planned {format_bytes(r['predicted'])}, measured "
              f"{format_bytes(r['measured'])} ({100 * r['error']:+.1f}%), reserved {format_bytes(r['reserved'])}, "
              f"held: {r['held']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_fake_check.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["held"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
