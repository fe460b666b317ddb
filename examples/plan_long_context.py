"""Which 7-8B fine-tunes fit one 80 GB H100 at long context: least peaks with and without chunk_loss.

Llama-3-8B and Qwen2.5-7B shapes are built on the meta device (nothing is allocated) and planned on
fake tensors for an H100 (80 GB, bf16-true: weights, gradients and AdamW state in bf16; AdamW's
batched "foreach" step as CUDA runs it; batch 1; budget "min": the plan of least peak). Each row is
planned twice: the layers' options only, and with ``chunk_loss=True``, where the head and its loss are
a stage too, whole or over 2-32 sequence chunks each recomputed in backward (the planner chooses).

    python examples/plan_long_context.py              # Llama-3-8B, LoRA on q/v, 32K tokens (two plans)
    python examples/plan_long_context.py --all        # both models, full and LoRA q/v, 8K and 32K
    python examples/plan_long_context.py --all --markdown

Each plan takes about 10-40 s on a laptop CPU (the 32 layers are profiled as 4 and 5 and extrapolated).
"""

from __future__ import annotations

import argparse
import time

import torch

GiB = 2**30
# Published sizes (config.json of each model).
SHAPES = {
    "Llama-3-8B": dict(family="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    "Qwen2.5-7B": dict(family="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064),
}
TUNES = ("LoRA q/v", "full")
SEQUENCES = (8192, 32768)


def build(name: str, tune: str) -> torch.nn.Module:
    """The model ``name`` on the meta device, training mode, all trainable or LoRA (r=16) on q/v."""
    import transformers

    transformers.logging.set_verbosity_error()
    shape = dict(SHAPES[name])
    family = shape.pop("family")
    config_class = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    config = config_class(**shape, max_position_embeddings=32768, use_cache=False)
    model_class = transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen2ForCausalLM
    with torch.device("meta"):
        model = model_class(config)
        if tune != "full":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    return model.train()


def least_peak(name: str, tune: str, seq: int, chunk_loss: bool) -> tuple[float, dict, float]:
    """The least peak (GiB) on an 80 GB H100, the chunked heads of its plan, and the seconds planning took."""
    from lightning_remat import plan_remat

    model = build(name, tune)
    ids = torch.randint(0, SHAPES[name]["vocab_size"], (1, seq))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    start = time.perf_counter()
    plan = plan_remat(model, lambda m: m(input_ids=ids, labels=ids).loss, "min", optimizer=optimizer, cost="flops",
                      fake=True, precision="bf16-true", device="cuda", gpu="h100", device_memory="80GB",
                      chunk_loss=chunk_loss)
    return plan.predicted_peak_bytes / GiB, plan.chunked_loss, time.perf_counter() - start


def rows(full_table: bool) -> list[dict]:
    """Every (model, tune, sequence) asked for, with its least peak without and with chunk_loss."""
    cases = [(n, t, s) for n in SHAPES for t in TUNES for s in SEQUENCES] if full_table else \
        [("Llama-3-8B", "LoRA q/v", 32768)]
    table = []
    for name, tune, seq in cases:
        plain, _, plain_s = least_peak(name, tune, seq, False)
        chunked, heads, chunked_s = least_peak(name, tune, seq, True)
        table.append(dict(model=name, tune=tune, seq=seq, plain=plain, chunked=chunked,
                          chunks=next(iter(heads.values()), 1), seconds=plain_s + chunked_s))
    return table


def render(table: list[dict], markdown: bool) -> str:
    """The table as text (or Markdown): least peaks in GiB, and whether each fits 80 GB (74.5 GiB)."""
    fits = lambda gib: "fits" if gib * GiB <= 80e9 else "does not fit"  # noqa: E731
    head = ("model", "trainable", "tokens", "least peak", "with chunk_loss", "chunks", "planned in")
    lines = [[r["model"], r["tune"], f"{r['seq'] // 1024}K", f"{r['plain']:.2f} GiB ({fits(r['plain'])})",
              f"{r['chunked']:.2f} GiB ({fits(r['chunked'])})", str(r["chunks"]), f"{r['seconds']:.0f} s"]
             for r in table]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(line) + " |" for line in lines])
    widths = [max(len(x) for x in column) for column in zip(head, *lines)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [head, *lines])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="the full table: 2 models x full/LoRA x 8K/32K")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown (docs/long_context.md)")
    args = parser.parse_args(argv)
    table = rows(args.all)
    print(render(table, args.markdown))
    return table


if __name__ == "__main__":
    main()
